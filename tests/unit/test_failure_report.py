"""Which failure a run reports when several processes fail (pipeline_rl/launch/run_loop.py): a
process that failed because a weight-update peer is gone (exit ExitCode.PEER_GONE) is not the cause;
the launcher waits for the peer's own failure and reports that one."""

from __future__ import annotations

import sys
import time

import pytest

from pipeline_rl.config import load_config
from pipeline_rl.core.process import run_pool_process
from pipeline_rl.launch import run_loop
from pipeline_rl.launch.launcher import Launcher
from pipeline_rl.launch.run_dir import prepare_run_dir
from pipeline_rl.launch.supervisor import Supervisor
from pipeline_rl.streams import open_streams
from pipeline_rl.weight_sync import PeerGone, WeightGroupFailed
from pipeline_rl.wire import ExitCode


def exits(code: int, after_s: float) -> list[str]:
    return [sys.executable, "-c", f"import sys, time; time.sleep({after_s}); sys.exit({code})"]


def watch(tmp_path, children: dict[str, list[str]]) -> tuple[int, float]:
    """Run the launcher's loop over these children (trainer0 is the one expected to finish),
    restarting none (a restart policy would replace them: tests/system/test_restarts.py)."""
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "world.max_restarts=0"])
    launcher = Launcher(cfg, nonce="x")
    for name, argv in children.items():
        launcher.supervisor.spawn(name, argv, env={}, expected_exit=name.startswith("trainer"))
    started = time.monotonic()
    streams = open_streams(cfg)
    try:
        code = launcher.watch(streams)
    finally:
        streams.close()
    return code, time.monotonic() - started


@pytest.mark.parametrize(
    "error, code", [(PeerGone("gone: actor0"), ExitCode.PEER_GONE), (WeightGroupFailed("hung"), ExitCode.FAILED)]
)
def test_a_pool_process_that_lost_a_peer_exits_with_its_own_code(tmp_path, error, code):
    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    prepare_run_dir(cfg, fresh=False)

    def body(*_):
        raise error

    assert run_pool_process("trainer", body, ["--run-dir", str(tmp_path), "--index", "0"]) == code


def test_the_peer_that_failed_later_is_reported_as_the_cause(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_loop, "PEER_REPORT_WAIT_S", 20.0)
    code, took = watch(
        tmp_path, {"trainer0": exits(ExitCode.PEER_GONE, 0.0), "actor0": exits(1, 2.0), "preprocessor0": exits(0, 60)}
    )
    err = capsys.readouterr().err
    assert code == 1
    assert 2.0 <= took < 20.0, took  # waited for actor0, not for the whole window
    assert "process actor0 failed: exit code 1 (before it: process trainer0 failed: exit code 3" in err, err


def test_a_peer_failure_with_no_cause_in_time_is_reported_itself(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_loop, "PEER_REPORT_WAIT_S", 1.0)
    code, took = watch(tmp_path, {"trainer0": exits(ExitCode.PEER_GONE, 0.0), "actor0": exits(0, 60)})
    err = capsys.readouterr().err
    assert code == 1 and 1.0 <= took < 30.0, took
    assert "process trainer0 failed: exit code 3 (a weight-update peer is gone); stopped the others" in err, err


def test_a_process_killed_by_a_signal_is_blamed_before_a_peer_that_exited_with_it(tmp_path):
    """Seen in one poll, trainer1 killed by SIGKILL and trainer0, which its collective error made
    exit 1 and which comes first in the spawn order: trainer1 is the cause."""
    import signal

    supervisor = Supervisor(tmp_path)
    first = supervisor.spawn("trainer0", exits(1, 0.0), env={}, expected_exit=True)
    second = supervisor.spawn("trainer1", exits(0, 60), env={}, expected_exit=True)
    second.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    second.proc.wait(timeout=30)
    failure, _ = supervisor.poll()
    assert failure is not None and failure.child.name == "trainer1" and failure.code == -signal.SIGKILL
    supervisor.stop()


def test_exit_process_runs_the_exit_handlers_flushes_and_keeps_the_code(tmp_path):
    """A pool process ends through exit_process: its exit handlers (reward pools, MCP servers)
    still run, what it printed without a newline still reaches the launcher, the code is kept."""
    import subprocess

    marker = tmp_path / "handler"
    script = (
        "import atexit\n"
        "from pipeline_rl.core.process import exit_process\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ran'))\n"
        "print('no newline', end='')\n"
        "exit_process(7)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, done.stderr
    assert done.stdout == "no newline"
    assert marker.read_text() == "ran"
