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
