"""The swap gate's priority, on a stand-in engine (no vLLM): an engine thread that calls its
gated step back to back, the pattern that starves a plain lock's waiter, and swaps from
another thread."""

import sys
import threading
import time

from pipeline_rl.engine.vllm_hook import Staged, SwapGate

STEP_S = 0.004


class Engine:
    def step(self) -> None:
        # Python work that holds the GIL, as vLLM's step does around the forward pass: the
        # engine thread re-takes the lock before the woken swap thread can.
        end = time.perf_counter() + STEP_S
        while time.perf_counter() < end:
            pass


class Gate(SwapGate):
    def stage(self, named_tensors) -> Staged:
        return Staged("local")

    def _check(self, staged: Staged) -> None:
        pass

    def _load(self, staged: Staged) -> None:
        pass


def test_a_swap_waits_for_at_most_the_call_in_progress():
    engine = Engine()
    gate = Gate(engine, "step", version=0)
    firsts: list[int] = []
    gate.on_new_version = firsts.append
    stop = threading.Event()

    def run_engine():
        while not stop.is_set():
            engine.step()  # the gated call: setattr replaced it

    thread = threading.Thread(target=run_engine)
    thread.start()
    try:
        stats = []
        for version in range(1, 61):
            time.sleep(STEP_S * 1.7)  # land at varying points of a call
            stats.append(gate.swap([], version))
    finally:
        stop.set()
        thread.join()
    # Without the turnstile some swaps wait for two or more calls (seen in about half of runs
    # of 30 swaps).
    assert max(s.calls_started for s in stats) <= 1, [s.calls_started for s in stats]
    waited = [s for s in stats if s.call_s > 0]
    assert waited, "no swap found the engine in a call"
    assert all(s.call_s >= STEP_S for s in waited)
    # Each new version was announced to one forward pass only, in order.
    assert firsts == sorted(set(firsts))
    assert gate.version == 60 and gate.swap_count == 60


def test_swap_history_reads_from_another_thread_while_swaps_append():
    """The actor's metrics read the swap history while the receiver's thread swaps (a run once
    died of 'deque mutated during iteration'): each read is a consistent snapshot."""
    gate = Gate(Engine(), "step", version=0, history=8)
    stop = threading.Event()

    def swap_forever():
        version = 0
        while not stop.is_set():
            version += 1
            gate.swap([], version)

    thread = threading.Thread(target=swap_forever)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, mid-iteration too
    thread.start()
    try:
        reads = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            history, count = gate.recent_swaps()
            versions = [s.version for s in history]
            assert versions == list(range(count - len(versions) + 1, count + 1)), (versions, count)
            reads += 1
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert reads > 100 and gate.swap_count > 8
