"""The request a `--actors N` command leaves in the run directory and the launcher's answer
(launch/scaling.py): taken once, answered by id; a malformed request is reported and dropped;
no launcher: the command says so instead of waiting forever; a request from an earlier launch
is not taken by the next."""

from __future__ import annotations

import threading
import time

from pipeline_rl.launch.scaling import REQUEST_FILE, ScaleRequests, request_actors


def test_a_request_is_taken_once_and_its_answer_reaches_the_command(tmp_path):
    launcher = ScaleRequests(tmp_path)
    result = {}
    asker = threading.Thread(target=lambda: result.update(answer=request_actors(tmp_path, 3, wait_s=10)))
    asker.start()
    deadline = time.monotonic() + 10
    while (request := launcher.take()) is None:
        assert time.monotonic() < deadline, "no request arrived"
        time.sleep(0.05)
    assert request.actors == 3 and launcher.take() is None
    launcher.answer(request, True, "the job has 3 actors")
    asker.join(timeout=10)
    assert result["answer"] == (True, "the job has 3 actors")


def test_without_a_launcher_the_command_says_so(tmp_path):
    ok, message = request_actors(tmp_path, 2, wait_s=0.3)
    assert not ok and "no launcher answered within 0.3 s" in message
    ok, message = request_actors(tmp_path / "missing", 2, wait_s=0.3)
    assert not ok and "no run directory" in message
    assert request_actors(tmp_path, 0, wait_s=0.3) == (False, "--actors 0: a job needs at least one actor")


def test_a_malformed_or_stale_request_is_not_acted_on(tmp_path, capsys):
    (tmp_path / REQUEST_FILE).write_text('{"actors": "x"}')
    assert ScaleRequests(tmp_path).take() is None  # an earlier launch's: removed at start
    launcher = ScaleRequests(tmp_path)
    (tmp_path / REQUEST_FILE).write_text('{"actors": "x"}')
    assert launcher.take() is None and not (tmp_path / REQUEST_FILE).exists()
    assert "ignored a malformed scale request" in capsys.readouterr().out


class Backend:
    """The run loop's scaling on a backend that records what it is asked to do."""

    def __init__(self, tmp_path, actors: int, fits: bool = True):
        from pipeline_rl.config import RunConfig
        from pipeline_rl.launch.run_loop import RunLoop
        from pipeline_rl.streams.jsonl_backend import JsonlStreams

        cfg = RunConfig()
        cfg.run_dir, cfg.world.actors = str(tmp_path), actors
        self.streams = JsonlStreams(tmp_path / "streams")
        self.calls: list[tuple] = []
        backend = self

        class Loop(RunLoop):
            heals = True

            def prepare_actors(self, n):
                counts = self_counts()
                backend.calls.append(("prepare", n, counts))
                if not fits:
                    raise RuntimeError("no room")
                return n

            def start_actors(self, placed):
                backend.calls.append(("start", placed, self_counts()))

        def self_counts() -> list[int]:
            from pipeline_rl.streams.records import ActorCount
            from pipeline_rl.wire import Topic

            reader = self.streams.reader(Topic.ACTOR_COUNT, ActorCount)
            return [e.record.count for e in reader.read(timeout=0.0)]

        self.loop = Loop(cfg)
        self.requests = ScaleRequests(tmp_path)

    def scale(self, actors: int):
        from pipeline_rl.launch.scaling import ScaleRequest, read_answers

        self.loop.scale(ScaleRequest(str(actors), actors, time.time()), self.streams)
        return read_answers(self.requests.answers)[-1]


def test_the_count_is_written_before_added_actors_start_and_draining_ones_are_kept(tmp_path):
    b = Backend(tmp_path, actors=2)
    up = b.scale(4)
    assert up.ok and up.message == "the job has 4 actors (added actors 2..3)"
    # Placed before the count changes (a failure leaves it as it was), started after.
    assert b.calls == [("prepare", 4, []), ("start", 4, [4])]
    down = b.scale(1)
    assert down.ok and b.loop.draining == {"actor1", "actor2", "actor3"} and b.loop.actors == 1
    again = b.scale(3)  # actors 1 and 2 are still draining: they go on, nothing is started for them
    assert again.ok and b.loop.draining == {"actor3"} and b.calls[-1] == ("start", 3, [4, 1, 3])
    assert b.scale(3).message == "the job already has 3 actors"
    assert not b.scale(0).ok


def test_actors_that_do_not_fit_are_refused_and_nothing_changes(tmp_path):
    b = Backend(tmp_path, actors=2, fits=False)
    answer = b.scale(3)
    assert not answer.ok and answer.message == "cannot add actors 2..2: no room"
    assert b.loop.actors == 2 and [c[0] for c in b.calls] == ["prepare"]
    assert b.calls[0][2] == []  # no count was written
