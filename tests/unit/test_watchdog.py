from pipeline_rl.launch.watchdog import SLOWEST_STEP_FACTOR, Watchdog
from pipeline_rl.streams.records import Metrics


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def record(process, **values):
    return Metrics(process=process, time=0.0, values=values)


def test_startup_allowance_then_adaptive_limit():
    clock = Clock()
    dog = Watchdog(stall_s=10, startup_s=100, clock=clock)
    clock.now = 99
    assert dog.stalled() is None  # still starting
    dog.observe(record("trainer0", version=1))
    clock.now = 105
    dog.observe(record("trainer0", version=2))  # an interval of 6 s: limit max(10, 5 x 6) = 30
    assert dog.limit_s() == SLOWEST_STEP_FACTOR * 6
    clock.now = 105 + 30
    assert dog.stalled() is None
    dog.observe(record("preprocessor0", waiting_on="rollout groups for step 2"))
    clock.now = 105 + 31
    report = dog.stalled()
    assert report is not None and "stayed at 2 for 31 s" in report
    assert "preprocessor0: last report 1 s ago, waiting on: rollout groups for step 2" in report
    assert "trainer0: last report 31 s ago" in report


def test_startup_stall_and_disabled():
    clock = Clock()
    dog = Watchdog(stall_s=10, startup_s=100, clock=clock)
    clock.now = 101
    assert "stayed at 0" in dog.stalled()
    assert "no process has reported" in dog.stalled()
    off = Watchdog(stall_s=0, startup_s=100, clock=clock)
    clock.now = 1e6
    assert off.stalled() is None


def test_only_a_higher_trainer_version_is_progress():
    clock = Clock()
    dog = Watchdog(stall_s=10, startup_s=100, clock=clock)
    dog.observe(record("trainer0", version=3))  # first version: from now on the limit is stall_s
    clock.now = 5
    dog.observe(record("trainer0", version=3, waiting_on="micro-batches of step 3"))  # a heartbeat
    dog.observe(record("actor0", version=7))  # an actor's own version is not training progress
    clock.now = 10
    assert dog.stalled() is None
    clock.now = 10.5
    assert "stayed at 3" in dog.stalled()
