"""Trainer checkpoints: written atomically, found through one pointer file.

Layout under RUN_DIR/checkpoints:

    step_000050/hf/                    Hugging Face model: config, safetensors shards (one per
                                       weight bucket, with their index), the tokenizer files
    step_000050/adapter/               instead of hf/ with model.lora: the PEFT adapter
                                       (adapter_config.json, adapter_model.safetensors); the
                                       DeepSpeed state then leaves out the frozen base
    step_000050/deepspeed/             engine.save_checkpoint: ZeRO shards, optimizer, LR schedule
    step_000050/position_rank{r}.json  rank r's position in the "trainer" stream
    step_000050/state.json             {"version", "world_size", ...}
    latest                             the name of the newest complete checkpoint

Writing goes into `.tmp-step_N`, which is renamed to `step_N` once every rank has written
its part, and only then is `latest` replaced (write a temp file, rename it). A crash at any
point leaves `latest` naming a complete checkpoint; the leftovers (a temp dir, or a renamed
dir that `latest` never named) are removed by `clean_leftovers` when the trainer restarts.
All ranks must call `save` (DeepSpeed writes each rank's ZeRO shards); the directory must be
on a file system every trainer node sees.

The Hugging Face weights are written as they are gathered, one weight bucket per shard, so
rank 0 never holds the whole model (under ZeRO-3) and the host never holds more than a shard.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from pipeline_rl.config import LoraConfig

# The read side of the layout (shared with the actors), re-exported: this module is the whole layout.
from pipeline_rl.core.checkpoint_layout import ADAPTER_DIR as ADAPTER_DIR
from pipeline_rl.core.checkpoint_layout import HF_DIR as HF_DIR
from pipeline_rl.core.checkpoint_layout import LATEST as LATEST
from pipeline_rl.core.checkpoint_layout import STATE as STATE
from pipeline_rl.core.checkpoint_layout import checkpoints_root as checkpoints_root
from pipeline_rl.core.checkpoint_layout import latest_checkpoint as latest_checkpoint
from pipeline_rl.core.checkpoint_layout import latest_dir as latest_dir
from pipeline_rl.lora import write_adapter
from pipeline_rl.streams import PositionStore
from pipeline_rl.trainer.host_staging import host_chunks

log = logging.getLogger(__name__)

DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"
_NAME = re.compile(r"^step_(\d+)$")
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _version_of(path: Path) -> int | None:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def clean_leftovers(run_dir: str | os.PathLike) -> list[Path]:
    """Remove what an interrupted save left (temp dirs, dirs newer than `latest`); rank 0 only."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = latest_dir(run_dir)
    latest_version = _version_of(found[0]) if found is not None else None
    if latest_version is None:
        latest_version = -1
    removed = []
    for path in root.iterdir():
        version = _version_of(path)
        # Dot names are temp dirs and pointer temp files; a step dir newer than `latest` was never published.
        if path.name.startswith(".") or (version is not None and version > latest_version):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    for path in removed:
        log.warning("removed %s, left by an interrupted checkpoint save", path)
    return removed


def copy_tokenizer_files(model_path: str | os.PathLike, hf_dir: Path) -> None:
    """Copy every top-level file of the source model dir that is not a weight file and that
    save_pretrained did not write (tokenizer, vocab, chat template...)."""
    for src in Path(model_path).iterdir():
        if src.is_file() and not src.name.endswith(_WEIGHT_FILES) and not (hf_dir / src.name).exists():
            shutil.copy2(src, hf_dir / src.name)


def write_hf_weights(chunks: Iterable[list[tuple[str, torch.Tensor]]], hf_dir: Path) -> dict[str, float]:
    """One safetensors shard per chunk, written as it comes, and the index Hugging Face loaders
    read (a single chunk is `model.safetensors`, with no index). Each chunk reaches the host
    through pinned buffers while the chunk before it is written (host_staging.py). Returns the
    bytes written, the device's copy seconds and the seconds spent waiting for copies."""
    parts: list[tuple[Path, list[str]]] = []
    total = 0
    stats: dict[str, float] = {}
    for i, tensors in enumerate(host_chunks(chunks, stats)):
        part = hf_dir / f".part-{i:05d}.safetensors"
        save_file(tensors, str(part), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        parts.append((part, list(tensors)))
    if len(parts) == 1:
        os.rename(parts[0][0], hf_dir / "model.safetensors")
        return stats
    weight_map = {}
    for k, (part, names) in enumerate(parts):
        name = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        os.rename(part, hf_dir / name)
        weight_map.update(dict.fromkeys(names, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return stats


def save(
    engine: Any,
    run_dir: str | os.PathLike,
    model_path: str,
    version: int,
    position: dict,
    rank: int,
    world_size: int,
    weights: Iterable[list[tuple[str, torch.Tensor]]],
    keep: int,
    extra: dict[str, Any] | None = None,
    lora: LoraConfig | None = None,
) -> Path:
    """Collective: every rank calls it, and iterates `weights` (full_weights.gathered_chunks: the
    published parameters chunk by chunk, full size on rank 0, empty elsewhere): the model, or
    with `lora` the adapter."""
    root = checkpoints_root(run_dir)
    name = f"step_{version:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    engine.save_checkpoint(
        str(tmp / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=lora is not None
    )
    PositionStore(tmp / f"position_rank{rank}.json").save(position)
    if rank == 0 and lora is not None:
        write_adapter(tmp / ADAPTER_DIR, (pair for chunk in weights for pair in chunk), lora, model_path)
    elif rank == 0:
        hf_dir = tmp / HF_DIR
        hf_dir.mkdir()
        engine.module.config.save_pretrained(hf_dir)
        if getattr(engine.module, "generation_config", None) is not None:
            engine.module.generation_config.save_pretrained(hf_dir)
        copied = write_hf_weights(weights, hf_dir)
        if copied.get("copy_s"):
            log.info(
                "checkpoint weights: %.2f GB to host at %.1f GB/s (device copy time), %.2f s waited for copies",
                copied["bytes"] / 1e9,
                copied["bytes"] / copied["copy_s"] / 1e9,
                copied["wait_s"],
            )
        copy_tokenizer_files(model_path, hf_dir)
    else:
        for _ in weights:  # the gathers are collective
            pass
    dist.barrier()
    if rank == 0:
        _write_atomic(tmp / STATE, json.dumps({"version": version, "world_size": world_size, **(extra or {})}))
        if final.exists():  # left by a save whose pointer update never happened
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomic(root / LATEST, name)
        prune(root, keep)
    dist.barrier()
    return final


def prune(root: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints (at least the one `latest` names)."""
    latest = (root / LATEST).read_text().strip()
    done = sorted((p for p in root.iterdir() if _version_of(p) is not None), key=lambda p: _version_of(p) or 0)
    for path in done[: -max(keep, 1)]:
        if path.name != latest:
            shutil.rmtree(path)


def load(engine: Any, ckpt_dir: Path, state: dict[str, Any], rank: int, world_size: int) -> dict:
    """Restore the engine (weights, optimizer, LR schedule) from `ckpt_dir`; returns this
    rank's stream position. Collective. A LoRA checkpoint's DeepSpeed state holds the adapter
    only; the frozen base stays as loaded from model.path."""
    if state.get("world_size") != world_size:
        raise RuntimeError(
            f"checkpoint {ckpt_dir} was written by {state.get('world_size')} trainer ranks, "
            f"this run has {world_size} (world.trainers): resume with the same number"
        )
    path, _ = engine.load_checkpoint(
        str(ckpt_dir / DEEPSPEED_DIR),
        tag=DEEPSPEED_TAG,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_strict=not (ckpt_dir / ADAPTER_DIR).is_dir(),
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load its state from {ckpt_dir / DEEPSPEED_DIR}")
    position = PositionStore(ckpt_dir / f"position_rank{rank}.json").load()
    if position is None:
        raise RuntimeError(f"checkpoint {ckpt_dir} has no stream position for rank {rank}")
    return position
