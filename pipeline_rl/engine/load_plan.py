"""A copy plan: where every byte of a checkpoint's tensors lands in a model's parameters,
recorded once by running the model's own `load_weights` under a torch function mode
(`CopyRecorder`), then replayed for each update as one copy per recorded pair (`LoadPlan`).
engine/engine_weights.py says why and what the plan refuses; the LoRA slot records its own plan
the same way (engine/adapter_slot.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

Named = list[tuple[str, torch.Tensor]]


class PlanRefused(Exception):
    """The model's loaders do something a copy plan cannot replay."""


_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__"}


def _writes_in_place(name: str) -> bool:
    """Whether a tensor method of this name writes into its tensor (torch's trailing-underscore
    convention, item assignment, augmented assignment)."""
    if name.startswith("__"):
        return name in _IN_PLACE_DUNDERS
    return name.endswith("_") and name != "requires_grad_"


Copies = dict[Any, list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], int]]]
"""Per incoming tensor's key, the (parameter view, source shape, stride, storage offset) of each
copy made from it."""


class CopyRecorder(TorchFunctionMode):
    """Records each `dst.copy_(src)` whose src is a view of one of the tensors being loaded
    (`incoming`, by key); any other in-place write while tensors are being loaded refuses the
    plan. With `perform=False` the recorded copies are not made (the incoming tensors are
    placeholders, and the parameters hold the checkpoint already). Also used for the LoRA
    slot's plan (engine/adapter_slot.py)."""

    def __init__(self, perform: bool = True) -> None:
        super().__init__()
        self.incoming: dict[Any, torch.Tensor] = {}
        self.copies: Copies = {}
        self.perform = perform

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.incoming and _writes_in_place(name):
            loading = ", ".join(map(str, self.incoming))
            constant = name in ("fill_", "zero_") or (
                name == "__setitem__" and len(args) > 2 and isinstance(args[2], (int, float))
            )
            if constant:  # vocabulary padding, a cleared LoRA slot: in place already, for good
                return func(*args, **kwargs)
            if name != "copy_":
                raise PlanRefused(f"loading {loading} writes a tensor with {name}")
            dst, src = args[0], args[1]
            key = next(
                (
                    k
                    for k, t in self.incoming.items()
                    if isinstance(src, torch.Tensor)
                    and src.device == t.device
                    and src.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                ),
                None,
            )
            if key is None:
                raise PlanRefused(f"loading {loading} copies a transformed tensor, not a view of it")
            offset = int(src.storage_offset()) - int(self.incoming[key].storage_offset())
            self.copies.setdefault(key, []).append((dst, tuple(src.shape), tuple(src.stride()), offset))
            if not self.perform:
                return dst
        return func(*args, **kwargs)


def bind(copies: Copies, key: Any, tensor: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (parameter view, source view) pairs that the recorded copies from `key` make from
    `tensor` (of the recorded tensor's shape and layout)."""
    return [
        (dst, tensor.as_strided(shape, stride, tensor.storage_offset() + offset))
        for dst, shape, stride, offset in copies.get(key, ())
    ]


class LoadPlan:
    """Per checkpoint name, the (parameter view, source slice) pairs one update copies."""

    def __init__(self, copies: Copies):
        self.copies = copies
        self.device = next((dst.device for pairs in copies.values() for dst, *_ in pairs), torch.device("cpu"))

    @classmethod
    def capture(
        cls,
        model: torch.nn.Module,
        tensors: Iterable[tuple[str, torch.Tensor]],
        required: Iterable[str],
        perform: bool = True,
    ) -> LoadPlan:
        """Load `tensors` (the checkpoint the engine already serves) through the model's own
        `load_weights`, recording where every byte goes; with `perform=False` (placeholders of
        the checkpoint's tensors, checkpoint_placeholders) only recording. Raises PlanRefused."""
        recorder = CopyRecorder(perform)

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                recorder.incoming = {name: tensor.contiguous()}
                yield name, recorder.incoming[name]
            recorder.incoming = {}

        load_weights: Any = getattr(model, "load_weights", None)
        if load_weights is None:
            raise PlanRefused(f"{type(model).__name__} has no load_weights")
        try:
            with torch.no_grad(), recorder:
                load_weights(feed())
        except PlanRefused:
            raise
        except Exception as e:  # e.g. a CPU engine whose linear weights were packed and freed
            raise PlanRefused(f"the model's load_weights failed on its own checkpoint: {e}") from e
        missing = sorted(set(required) - set(recorder.copies))
        if missing:
            raise PlanRefused(f"no copy came from {len(missing)} parameter(s), e.g. {missing[:3]}")
        return cls(recorder.copies)

    def bind(self, named_tensors: Named) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (parameter view, source view) pairs that load an update (contiguous tensors of
        the checkpoint's shapes): the per-update work done before the lock is taken."""
        return [pair for name, tensor in named_tensors for pair in bind(self.copies, name, tensor)]

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], synchronize: bool = True) -> None:
        """Copy bound pairs into the parameters: all a swap does under the lock. One call for
        all of them: torch lets go of the GIL around every op, and a copy per tensor gave a
        busy thread of the actor the GIL between each two. On CUDA the copies are queued on
        the current stream; `synchronize` waits for them (a caller that queues them on the
        stream of the next forward pass, engine/swap_streams.py, needs not)."""
        with torch.no_grad():
            torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs], non_blocking=True)
        if synchronize and self.device.type == "cuda":
            # The next forward pass may run on another stream: the copies must be done first.
            torch.cuda.synchronize(self.device)
