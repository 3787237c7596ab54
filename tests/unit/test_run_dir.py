"""The run directory one launcher prepares and every process checks (pipeline_rl/launch/run_dir.py)."""

from __future__ import annotations

import pytest

from pipeline_rl.config import ConfigError, load_config, load_saved_config
from pipeline_rl.core.process import RunDirNotShared, check_run_dir, run_pool_process
from pipeline_rl.launch.run_dir import prepare_run_dir
from pipeline_rl.wire import RUN_NONCE_ENV, RUN_NONCE_FILE


def test_each_start_writes_the_config_atomically_and_a_new_nonce(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path / 'run'}", "shared.max_steps=7"])
    resumed, first = prepare_run_dir(cfg, fresh=False)
    assert not resumed
    assert load_saved_config(tmp_path / "run" / "config.yaml").shared.max_steps == 7
    assert (tmp_path / "run" / RUN_NONCE_FILE).read_text() == first
    (tmp_path / "run" / "checkpoints").mkdir()
    resumed, second = prepare_run_dir(cfg, fresh=False)
    assert resumed and second != first and (tmp_path / "run" / "checkpoints").exists()
    # No temporary file is left beside the config.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "config.yaml", RUN_NONCE_FILE]
    resumed, _ = prepare_run_dir(cfg, fresh=True)
    assert not resumed and not (tmp_path / "run" / "checkpoints").exists()


def test_a_directory_that_is_not_a_run_is_left_alone(tmp_path):
    (tmp_path / "mine.txt").write_text("x")
    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="is not a pipeline_rl run"):
        prepare_run_dir(cfg, fresh=False)
    assert (tmp_path / "mine.txt").exists()


def test_a_process_accepts_only_the_nonce_its_launcher_wrote(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    _, nonce = prepare_run_dir(cfg, fresh=False)
    check_run_dir(tmp_path, "actor0", {RUN_NONCE_ENV: nonce})
    check_run_dir(tmp_path, "actor0", {})  # started by hand: nothing to compare with
    with pytest.raises(RunDirNotShared, match=r"holds another run's nonce.*must be on a file system every node shares"):
        check_run_dir(tmp_path, "actor0", {RUN_NONCE_ENV: "f" * 32})
    with pytest.raises(RunDirNotShared, match=r"actor0 on .* cannot read .*run.nonce"):
        check_run_dir(tmp_path / "elsewhere", "actor0", {RUN_NONCE_ENV: nonce})


def test_the_pool_entry_refuses_a_run_directory_it_does_not_share(tmp_path, monkeypatch, capsys):
    """What a pool process on a node with a node-local run_dir does: exit 1 before reading the
    config, saying why."""
    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    prepare_run_dir(cfg, fresh=False)
    monkeypatch.setenv(RUN_NONCE_ENV, "0" * 32)
    ran = []
    code = run_pool_process("trainer", lambda *a: ran.append(a) or "", ["--run-dir", str(tmp_path), "--index", "1"])
    assert code == 1 and not ran
    err = capsys.readouterr().err
    assert "trainer1 failed: RunDirNotShared" in err and "must be on a file system every node shares" in err
