"""LoRA on real DeepSpeed ranks (gloo): the trainer trains and broadcasts only the adapter, its
checkpoint is a PEFT adapter that a restart resumes exactly from, and a merged export is the
plain model with the adapter folded in."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.helpers import ROOT, hf_model, peft_model
from fixtures.trainer_runs import (
    LINEAR_ADAM,
    REL_TOL,
    make_steps,
    start_ranks_with_receiver,
    train,
    trainer_config,
    wait_all,
    write_steps,
)
from safetensors.torch import load_file

from pipeline_rl import lora
from pipeline_rl.config import save_config
from pipeline_rl.trainer import checkpoint

pytestmark = pytest.mark.deepspeed

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "trainer.optimizer.lr=1e-2")


def adapter_of(run_dir: Path, version: int) -> tuple[Path, dict[str, torch.Tensor]]:
    found = checkpoint.latest_checkpoint(run_dir)
    assert found is not None and found[1] == version, found
    adapter_dir = found[0]
    assert adapter_dir.name == checkpoint.ADAPTER_DIR and not (adapter_dir.parent / checkpoint.HF_DIR).exists()
    return adapter_dir, load_file(adapter_dir / lora.WEIGHTS_FILE)


def b_error(adapter: dict, reference: dict) -> float:
    """|B - B_ref| / |B_ref| over the lora_B tensors (zero when training starts, so the reference
    is all update)."""
    names = [n for n in reference if ".lora_B." in n]
    diff = sum(((adapter[n] - reference[n]) ** 2).sum() for n in names) ** 0.5
    size = sum((reference[n] ** 2).sum() for n in names) ** 0.5
    assert size > 0, "training did not move the adapter"
    return float(diff / size)


def test_lora_trains_broadcasts_and_resumes_only_the_adapter(tiny_model, tmp_path):
    steps = make_steps(tiny_model, steps=3, groups=2, seed=7)
    ref = trainer_config(tmp_path / "uninterrupted", tiny_model, "shared.max_steps=3", *LORA)
    write_steps(ref, steps, ranks=1)
    procs, receiver, received, errors = start_ranks_with_receiver(ref, 1, 3)
    wait_all(procs, Path(ref.run_dir), timeout=180)
    receiver.join(30)
    assert not errors and sorted(received) == [1, 2, 3], f"received {sorted(received)}, errors {errors}"

    # Only the adapter is trained, published and checkpointed, under PEFT's saved names.
    assert ref.model.lora is not None
    shapes = lora.adapter_shapes(tiny_model, ref.model.lora)
    adapter_dir, expected = adapter_of(Path(ref.run_dir), 3)
    assert {k: list(v.shape) for k, v in expected.items()} == shapes
    assert received[3].keys() == expected.keys() and all(torch.equal(received[3][k], expected[k]) for k in expected)
    log = (Path(ref.run_dir) / "trainer0.log").read_text()
    found = re.search(r"training (\d+) parameter elements \((\d+) tensors\)", log)
    assert found and int(found[1]) == sum(v.numel() for v in expected.values()), log[-2000:]
    base_bytes = (tiny_model / "model.safetensors").stat().st_size
    ds_bytes = sum(p.stat().st_size for p in (adapter_dir.parent / checkpoint.DEEPSPEED_DIR).rglob("*") if p.is_file())
    # The DeepSpeed state holds the adapter's weights and fp32 Adam moments (about 3 x 4 bytes
    # per adapter element, well under the base's 4 bytes per element), not the frozen base.
    assert ds_bytes < base_bytes / 2, f"DeepSpeed state {ds_bytes} bytes, base model {base_bytes}"

    # PEFT loads the checkpoint's adapter: the same model as the one the tensors make.
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(hf_model(tiny_model, {}), str(adapter_dir)).eval()
    ids = torch.tensor([[3, 14, 15, 9, 2, 6, 5]])
    with torch.no_grad():
        want = peft_model(tiny_model, expected, ref.model.lora)(ids).logits
        assert torch.equal(loaded(ids).logits, want)

    # Merged into a plain model: the same function (folding B A into W reorders fp32 sums:
    # relative differences of a few 2^-24 per layer).
    merged_dir = tmp_path / "merged"
    export = [sys.executable, str(ROOT / "scripts" / "merge_lora.py"), str(ref.run_dir), str(merged_dir)]
    subprocess.run(export, check=True, capture_output=True, timeout=120)
    assert (merged_dir / "tokenizer.json").is_file()
    with torch.no_grad():
        merged = hf_model(merged_dir, {})(ids).logits
    assert (merged - want).abs().max() < 1e-4 * want.abs().max()
    assert (hf_model(tiny_model, {})(ids).logits - want).abs().max() > 1e-2

    # A restart from the checkpoint of version 2 continues exactly (adapter, Adam moments, LR).
    run_dir = tmp_path / "resumed"
    cfg = trainer_config(run_dir, tiny_model, "shared.max_steps=2", *LORA)
    write_steps(cfg, steps, ranks=1)
    train(cfg)
    cfg.shared.max_steps = 3
    save_config(cfg, run_dir / "config.yaml")
    train(cfg)
    _, resumed = adapter_of(run_dir, 3)
    assert b_error(resumed, expected) < REL_TOL
    # Control: one step moves the adapter far beyond the tolerance, so a step lost or trained
    # twice by the resume would show.
    assert b_error(received[2], expected) > 100 * REL_TOL


def test_lora_under_zero3_on_two_ranks_gives_the_one_rank_update(tiny_model, tmp_path):
    """The base partitioned over 2 ranks (zero.Init), the adapter added by peft on each rank from
    the same seed: the same adapter after two steps as one ZeRO-2 rank."""
    steps = make_steps(tiny_model, steps=2, groups=4, seed=8)
    adapters = {}
    for name, ranks, stage in (("zero2_1rank", 1, 2), ("zero3_2ranks", 2, 3)):
        cfg = trainer_config(
            tmp_path / name,
            tiny_model,
            "shared.max_steps=2",
            f"world.trainers={ranks}",
            f"trainer.zero_stage={stage}",
            *LORA,
            *LINEAR_ADAM,
            # Output layer chunk by chunk: under ZeRO-3 the frozen layer is gathered once per micro-batch.
            "model.logprob_chunk_tokens=8",
        )
        write_steps(cfg, steps, ranks=ranks)
        train(cfg, ranks=ranks, timeout=240)
        adapters[name] = adapter_of(Path(cfg.run_dir), 2)[1]
    one, two = adapters["zero2_1rank"], adapters["zero3_2ranks"]
    assert one.keys() == two.keys()
    # A starts from the same random values on every rank (a rank with other values would give
    # a mixed adapter far from the one-rank run); B starts at zero, so it is all update.
    a_names = [n for n in one if ".lora_A." in n]
    assert max((one[n] - two[n]).abs().max() / one[n].abs().max() for n in a_names) < REL_TOL
    assert b_error(two, one) < REL_TOL
