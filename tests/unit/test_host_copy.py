"""The swap's host copy: memmoves that equal torch's copy, merge adjacent spans, refuse what is
not a plain byte copy, and keep the GIL for the whole copy."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
import torch

from pipeline_rl.engine.host_copy import HostSpans


def test_spans_copy_what_torch_copies_and_merge_adjacent_slices():
    # A fused parameter written by two slices from one contiguous source (as a q/k/v plan does),
    # and a separate parameter from another source.
    fused, other = torch.zeros(6, 4), torch.zeros(3, dtype=torch.bfloat16)
    src, src2 = torch.randn(6, 4), torch.randn(3).to(torch.bfloat16)
    pairs = [(fused[:2], src[:2]), (fused[2:], src[2:]), (other, src2)]
    spans = HostSpans.of(pairs)
    assert spans is not None
    assert len(spans.spans) == 2  # the two slices are adjacent on both sides
    assert spans.spans[0][2] == 6 * 4 * 4 and spans.spans[1][2] == 3 * 2
    spans.copy()
    assert torch.equal(fused, src) and torch.equal(other, src2)


def test_spans_do_not_merge_slices_that_are_adjacent_on_one_side_only():
    dst, src = torch.zeros(4), torch.arange(8.0)
    spans = HostSpans.of([(dst[:2], src[:2]), (dst[2:], src[4:6])])
    assert spans is not None and len(spans.spans) == 2
    spans.copy()
    assert dst.tolist() == [0.0, 1.0, 4.0, 5.0]


@pytest.mark.parametrize(
    "dst, src",
    [
        (torch.zeros(4, 4)[:, :2], torch.ones(4, 2)),  # strided destination (a column shard)
        (torch.zeros(4, 2), torch.ones(4, 4)[:, :2]),  # strided source
        (torch.zeros(4), torch.ones(4, dtype=torch.float64)),  # a cast, not a byte copy
        (torch.zeros(2, 2), torch.ones(4)),  # another shape
        (torch.zeros(4, device="meta"), torch.ones(4)),  # not on the host
    ],
)
def test_pairs_that_are_not_plain_host_copies_get_no_spans(dst, src):
    assert HostSpans.of([(torch.zeros(2), torch.ones(2)), (dst, src)]) is None


def _other_thread_ran_during(copy) -> int:
    """Ticks another Python thread made while `copy` ran in this one. The switch interval is
    made long, so this thread keeps the GIL unless the copy lets go of it."""
    ticks: list[float] = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    before = sys.getswitchinterval()
    thread = threading.Thread(target=tick)
    thread.start()
    try:
        while not ticks:
            time.sleep(0.001)
        sys.setswitchinterval(0.2)
        time.sleep(0.01)  # blocking: the ticker gets the GIL, and keeps it no longer than this
        began = time.perf_counter()
        copy()
        ended = time.perf_counter()
    finally:
        sys.setswitchinterval(before)
        stop.set()
        thread.join()
    return sum(began < t < ended for t in ticks)


def test_the_copy_keeps_the_gil_where_a_plain_memmove_lets_go_of_it():
    dst, src = torch.zeros(16 << 20, dtype=torch.uint8), torch.ones(16 << 20, dtype=torch.uint8)
    spans = HostSpans.of([(dst, src)])
    assert spans is not None
    # Eight copies (tens of ms), well inside the switch interval.
    assert _other_thread_ran_during(lambda: [spans.copy() for _ in range(8)]) == 0
    assert bool(dst.all())
    # The control: ctypes.memmove releases the GIL, and the other thread runs meanwhile.
    dst.zero_()
    released = lambda: [ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel()) for _ in range(8)]  # noqa: E731
    assert _other_thread_ran_during(released) > 0
