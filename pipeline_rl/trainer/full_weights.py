"""The trainer's published parameters at full size with their names, gathered one broadcast
bucket at a time: what the weight broadcast and the checkpoint's model (or adapter) both
consume. Which parameters, under which names: pipeline_rl/lora.py `trained_parameters` (all of
them by their Hugging Face names, or with LoRA the adapter's by PEFT's saved names)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import deepspeed
import torch

from pipeline_rl.weight_layout import plan_buckets

Named = list[tuple[str, torch.nn.Parameter]]


def parameter_specs(named: Named) -> list[tuple[str, list[int], torch.dtype]]:
    """Name, full shape and dtype of every parameter, without gathering anything (ZeRO-3 keeps
    a partitioned parameter's full shape in ds_shape)."""
    return [(name, list(getattr(p, "ds_shape", p.shape)), p.dtype) for name, p in named]


def gathered_chunks(named: Named, rank: int, bucket_mb: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The parameters at full size with their names, in the weight broadcast's
    buckets (weight_sync.plan_buckets), so that no GPU holds more than its own share plus one
    bucket. On rank 0 a chunk's tensors are valid until the next chunk is asked for (under
    ZeRO-3 they are gathered storage, released then); other ranks get empty chunks and, under
    ZeRO-3, must iterate to the end too (each gather is collective)."""
    specs = parameter_specs(named)
    params = [p for _, p in named]
    zero3 = any(hasattr(p, "ds_id") for p in params)
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in specs]
    first = 0
    for count in plan_buckets(sizes, bucket_mb):
        names, chunk = [n for n, _, _ in specs[first : first + count]], params[first : first + count]
        first += count
        with deepspeed.zero.GatheredParameters(chunk, modifier_rank=None) if zero3 else contextlib.nullcontext():
            yield [(n, p.detach()) for n, p in zip(names, chunk)] if rank == 0 else []
