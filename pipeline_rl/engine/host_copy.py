"""A swap's copy into host (CPU) parameters as plain memmoves that keep the GIL.

torch lets go of the GIL for every op, `_foreach_copy_` included, and runs a CPU copy through
its thread pool. Under the swap lock that costs twice: when the copy ends, the swap thread
queues for the GIL behind the actor's other threads (engine output processing, streams), and
each tensor's parallel region wakes the pool. A memmove called without releasing the GIL
(ctypes' PYFUNCTYPE calling convention) does neither: no other thread of the process runs
Python until the whole update is in place, which is what the lock is held for anyway.

Only for pairs that are plain byte copies: same dtype and size, both contiguous, both on
the CPU. Anything else (a GPU engine, a strided tensor-parallel slice) keeps torch's copy.
"""

from __future__ import annotations

import ctypes

import torch

# memmove from the C library, called as if it were a Python C-API function: ctypes then keeps
# the GIL for the call (CFUNCTYPE, as in ctypes.memmove, would release it).
_MEMMOVE_ADDRESS = ctypes.cast(ctypes.CDLL(None).memmove, ctypes.c_void_p).value
if not _MEMMOVE_ADDRESS:
    raise ImportError("the C library's memmove has no address")
_memmove_keeping_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    _MEMMOVE_ADDRESS
)


class HostSpans:
    """(destination address, source address, bytes) spans for a list of (dst, src) tensor pairs,
    adjacent spans merged into one; `of` returns None unless every pair is a plain host copy.
    Keeps the tensors referenced, so the addresses stay valid as long as the spans live."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], spans: list[tuple[int, int, int]]):
        self._pairs = pairs
        self.spans = spans

    @classmethod
    def of(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> HostSpans | None:
        spans: list[tuple[int, int, int]] = []
        for dst, src in pairs:
            if not _plain_host_copy(dst, src):
                return None
            size = dst.numel() * dst.element_size()
            if size == 0:
                continue
            d, s = dst.data_ptr(), src.data_ptr()
            if spans and spans[-1][0] + spans[-1][2] == d and spans[-1][1] + spans[-1][2] == s:
                spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + size)
            else:
                spans.append((d, s, size))
        return cls(pairs, spans)

    def copy(self) -> None:
        """Copy every span; no other thread of this process runs Python meanwhile."""
        for dst, src, size in self.spans:
            _memmove_keeping_gil(dst, src, size)


def _plain_host_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    )
