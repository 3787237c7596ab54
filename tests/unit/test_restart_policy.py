"""The restart budget and record (pipeline_rl/launch/restarts.py), on a clock the test moves."""

from __future__ import annotations

import orjson

from pipeline_rl.launch.restarts import RESTART_WINDOW_S, TRAINER_POOL, RestartPolicy, restart_target


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_trainer_rank_restarts_the_pool_and_services_are_not_restarted():
    pools = {"actor0", "preprocessor0", "trainer0", "trainer1"}
    assert restart_target("actor0", pools) == "actor0"
    assert restart_target("trainer1", pools) == TRAINER_POOL
    assert restart_target("redis", pools) is None


def test_the_budget_counts_restarts_within_the_window_per_process(tmp_path):
    clock = Clock()
    policy = RestartPolicy(2, tmp_path / "restarts.jsonl", clock)
    for _ in range(2):
        assert policy.allows("actor0")
        policy.record("actor0", "actor0", "killed")
        clock.now += 60
    assert not policy.allows("actor0")
    assert "actor0 was already restarted 2 times within 1 h (world.max_restarts=2)" in policy.spent("actor0")
    assert policy.allows("actor1") and policy.allows(TRAINER_POOL)  # a budget per process
    clock.now += RESTART_WINDOW_S - 120  # the first restart leaves the window, the second not yet
    assert policy.allows("actor0")
    policy.record("actor0", "actor0", "killed")
    assert not policy.allows("actor0")
    assert policy.counts() == {"restarts_total": 3, "restarts/actor0_total": 3}


def test_recovery_is_timed_by_the_first_report_written_after_the_restart(tmp_path):
    clock = Clock()
    policy = RestartPolicy(3, tmp_path / "restarts.jsonl", clock)
    lost = policy.record(TRAINER_POOL, "trainer1", "process trainer1 failed: killed by SIGKILL")
    clock.now += 1
    policy.started(lost)
    clock.now += 4
    assert policy.recovered("trainer0", step=True, at=clock.now - 10) is None  # the dead pool's last step
    assert policy.recovered("trainer0", step=True, at=clock.now - 4.5) is None  # a peer ending its step
    assert policy.recovered("actor0", step=False, at=clock.now) is None  # not what was restarted
    assert policy.recovered("trainer0", step=False, at=clock.now) is None  # a heartbeat, not a step
    restart = policy.recovered("trainer0", step=True, at=clock.now)
    assert restart is not None and restart.recovered_s == 5.0 and not policy.pending
    lines = [orjson.loads(line) for line in (tmp_path / "restarts.jsonl").read_bytes().splitlines()]
    assert [(r["what"], r["died"], r["recovered_s"]) for r in lines] == [
        (TRAINER_POOL, "trainer1", None),
        (TRAINER_POOL, "trainer1", 5.0),
    ]


def test_the_dry_run_says_what_the_policy_does():
    assert "any lost process stops the run" in RestartPolicy(0, None).describe(on_ray=False)
    one_node = RestartPolicy(3, None).describe(on_ray=False)
    assert "up to 3 per process within 1 h" in one_node and "trainer pool from the last checkpoint" in one_node
    on_ray = RestartPolicy(3, None).describe(on_ray=True)
    assert "in its Ray bundle (where Ray places it again when its node is lost" in on_ray


def test_launch_dry_run_prints_the_restart_policy(tmp_path, capsys):
    from pipeline_rl.launch.launcher import main

    assert main(["conf=tiny", f"run_dir={tmp_path}", "world.max_restarts=5", "--dry-run"]) == 0
    assert "restarts: up to 5 per process within 1 h (world.max_restarts)" in capsys.readouterr().out
