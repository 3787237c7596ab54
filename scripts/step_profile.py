"""What a loop's steps do (`scripts/gpu_check.py --profile`, `--host-profile`, `--sync-debug`).
StepProfile: a torch profiler started before a chosen step and stopped after the last, and its
summary: self time of the device's kernels (on CPU, of the operators) by kind, attention's share
of it, the longest kernels, and on a GPU the share of the profiled span in which any kernel ran.
A loop whose kernels take no longer than another's but runs slower has a device that waits on
its host: the busy share says how much. Then what the host does in the trainer's steps (cProfile),
and where its steps wait for the device."""

from __future__ import annotations

import contextlib
import cProfile
import re
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType

KINDS: list[tuple[str, re.Pattern]] = [
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("attention", r"flash|fmha|sdpa|attention|scaled_dot_product"),
        ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|matmul|aten::(add|b)?mm\b|aten::linear"),
        ("optimizer", r"adam|multi_tensor|foreach"),
        ("communication", r"nccl|all_?reduce|all_?gather|reduce_scatter|gloo|broadcast"),
        ("copy", r"memcpy|memset|copy|\bcat\b|catarray|fill|clone|contiguous"),
        ("softmax", r"softmax"),
        ("norm and reduction", r"norm|reduce|\bsum\b|mean|\bmax\b"),
    )
]
"""Kinds of kernel or operator by name (lower case), the first that matches; the rest are
"elementwise"."""


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if pattern.search(lowered)), "elementwise")


def time_by_kind(items: Iterable[tuple[str, float]]) -> dict:
    """(name, self microseconds) pairs, summed by kind (seconds), with the total, attention's
    share and the five longest."""
    by_name: dict[str, float] = defaultdict(float)
    for name, us in items:
        by_name[name] += us
    kinds: dict[str, float] = defaultdict(float)
    for name, us in by_name.items():
        kinds[kind_of(name)] += us
    total = sum(kinds.values())
    longest = sorted(by_name.items(), key=lambda item: -item[1])[:5]
    return {
        "kernel_s": round(total / 1e6, 4),
        "attention_share": round(kinds["attention"] / total, 3) if total else None,
        "by_kind_s": {kind: round(us / 1e6, 4) for kind, us in sorted(kinds.items(), key=lambda item: -item[1])},
        "top_kernels": [(name[:70], round(us / 1e6, 4)) for name, us in longest],
    }


def busy_share(intervals: Iterable[tuple[float, float]], span_us: float) -> float | None:
    """The share of `span_us` covered by the union of (start, end) intervals (kernels on several
    streams overlap: each moment counts once)."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return round(covered / span_us, 3) if span_us > 0 else None


class StepProfile:
    """A torch profiler over a loop's steps: `start()` before the first profiled step (later
    calls do nothing), `stop()` after the last."""

    def __init__(self, gpu: bool):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.gpu = gpu
        self.started: float | None = None
        self.span_s = 0.0

    def _sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def start(self) -> None:
        if self.started is None:
            self._sync()
            self.profiler.start()
            self.started = time.perf_counter()

    def stop(self) -> None:
        if self.started is not None and not self.span_s:
            self._sync()
            self.span_s = time.perf_counter() - self.started
            self.profiler.stop()

    def trainer_steps(self, first: int, end: int) -> None:
        """Profile the trainer's steps from the one that makes version `first` + 1 (the steps
        before warm up kernels and the allocator) to the one that makes `end`, and nothing after
        (the final checkpoint)."""

        @contextlib.contextmanager
        def profiled(trainer) -> Iterator[None]:
            self.start()
            yield
            if trainer.version + 1 >= end:
                self.stop()

        around_trainer_steps(first, profiled)

    def summary(self) -> dict:
        """time_by_kind of the device's kernels (on CPU, of the operators), the profiled span, and
        on a GPU the kernels' busy share of it."""
        if self.started is None:
            return {}
        averages = self.profiler.key_averages()
        if self.gpu:
            items = [(e.key, e.self_device_time_total) for e in averages if e.self_device_time_total > 0]
        else:
            items = [(e.key, e.self_cpu_time_total) for e in averages if e.self_cpu_time_total > 0]
        result = {"profiled_span_s": round(self.span_s, 3), **time_by_kind(items)}
        if self.gpu:
            kernels = [
                (e.time_range.start, e.time_range.end)
                for e in self.profiler.events() or []
                if e.device_type == DeviceType.CUDA
            ]
            result["device_busy_share"] = busy_share(kernels, self.span_s * 1e6)
        return result

    def table(self) -> str:
        sort = "self_device_time_total" if self.gpu else "self_cpu_time_total"
        return self.profiler.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)


def around_trainer_steps(version: int, around: Callable[..., contextlib.AbstractContextManager]) -> None:
    """Run every trainer step from the one that makes `version` + 1 on inside `around(trainer)`
    (the trainer's `_step` replaced for the rest of the process)."""
    from pipeline_rl.trainer.trainer import Trainer

    step = Trainer._step

    def wrapped(trainer, *args, **kwargs):
        if trainer.version < version:
            return step(trainer, *args, **kwargs)
        with around(trainer):
            return step(trainer, *args, **kwargs)

    Trainer._step = wrapped  # pyright: ignore[reportAttributeAccessIssue]


def host_profile_trainer_steps(version: int, host: cProfile.Profile) -> None:
    """Have `host` profile every trainer step from `version` on (around_trainer_steps)."""

    @contextlib.contextmanager
    def enabled(_trainer) -> Iterator[None]:
        host.enable()
        try:
            yield
        finally:
            host.disable()

    around_trainer_steps(version, enabled)


def count_trainer_step_syncs(version: int, sites: Counter) -> None:
    """Count by call site every device synchronization in the trainer's steps from `version` on
    (torch's sync debug mode): what a micro-batch may wait on."""

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if re.search(r"pipeline_rl|deepspeed", f.filename)]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in reversed(frames[-3:]))] += 1

    @contextlib.contextmanager
    def watched(_trainer) -> Iterator[None]:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)

    around_trainer_steps(version, watched)
