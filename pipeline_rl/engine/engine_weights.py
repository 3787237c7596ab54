"""The weights of one model runner: an update checked against the checkpoint, then copied
straight into the engine's parameters by a plan made once.

vLLM's general reload (`model_runner.reload_weights`) walks the modules, runs the weight
loaders and, on CPU, repacks every linear layer for oneDNN at every update: over 200x a
memcpy of the update's bytes. Instead, when the engine starts, `LoadPlan.capture` runs the
model's own `load_weights` once on unfilled placeholders of the checkpoint's tensors (names,
shapes and dtypes from the safetensors headers: nothing is read, nothing copied) and records
every copy its weight loaders would make: for each checkpoint name, which slice of the incoming tensor lands in which view of
which parameter (a fused qkv or gate_up shard, this worker's tensor-parallel slice, a tied
weight once). An update is then one copy per recorded pair into storage the engine
computes from: no module walk, no loader, no allocation. On the CPU these copies are memmoves
that keep the GIL (`host_copy.py`), elsewhere one `_foreach_copy_`.

On CPU vLLM repacks linear weights after loading and frees the originals, so a copy into
`.weight` would not be seen. `keep_cpu_linear_weights()`, called before an engine loads its
model, has 2-D linear layers compute with `F.linear` from their own `.weight` instead (the
same kernel family torch uses; `scripts/bench_actor.py` measures the decode rate).

The plan refuses what it cannot replay exactly: a loader that copies from a tensor derived
from the incoming one (not a view of it), writes a parameter in any other way than a copy or a
constant fill (vocabulary padding, which stays as it is), or a required name no copy came from. The engine then loads through `reload_weights` as before and says why
once, at start-up.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pipeline_rl.engine.cpu_experts import ExpertRepack
from pipeline_rl.engine.fused_experts import per_expert
from pipeline_rl.engine.host_copy import HostSpans
from pipeline_rl.engine.load_plan import LoadPlan, PlanRefused
from pipeline_rl.engine.weight_delta import (
    Scatter,
    bind_delta,
    checksum_moves,
    checksum_parts,
    fused_blocks,
    scatter,
    split_fused,
)
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_layout import dtype_of
from pipeline_rl.weight_sync.delta import DENSE, MODULUS, weight_dtypes
from pipeline_rl.weight_sync.delta import decode as decode_delta

log = logging.getLogger(__name__)

Named = list[tuple[str, torch.Tensor]]


def checkpoint_shapes(model_path: str | Path) -> tuple[dict[str, list[int]], set[str]]:
    """Parameter names and shapes of a Hugging Face checkpoint (read from the safetensors
    headers), and the names an update may carry but need not (a tied lm_head)."""
    path = Path(model_path)
    shapes: dict[str, list[int]] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shapes[name] = list(f.get_slice(name).get_shape())
    optional: set[str] = set()
    config = json.loads((path / "config.json").read_text())
    embed = "model.embed_tokens.weight"
    if config.get("tie_word_embeddings") and embed in shapes and "lm_head.weight" not in shapes:
        shapes["lm_head.weight"] = shapes[embed]
        optional.add("lm_head.weight")
    return shapes, optional


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def checkpoint_placeholders(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A tensor of each checkpoint tensor's name, shape and dtype, from the safetensors headers
    alone, one at a time and never filled: what a copy plan is captured from (a TP worker of a
    32B model would otherwise read the whole checkpoint, 61 GiB, to learn where its shard goes)."""
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                info = f.get_slice(name)
                dtype = _DTYPES.get(info.get_dtype())
                if dtype is None:
                    raise PlanRefused(f"{file.name}: {name} has dtype {info.get_dtype()}, not a float type")
                yield name, torch.empty(info.get_shape(), dtype=dtype)


def keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU linear layers compute from their `.weight` (F.linear) instead of a packed
    copy made at load time, so that copies into the weight take effect. Idempotent; call it
    before an engine loads its model (in every process that loads one)."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_pipeline_rl", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:  # conv / expert weights: vLLM's own handling
            original(layer, remove_weight)
            return
        vars(layer)["cpu_linear"] = torch.nn.functional.linear  # a plain attribute, as vLLM sets it

    dispatch._pipeline_rl = True  # pyright: ignore[reportFunctionMemberAccess]
    utils.dispatch_cpu_unquantized_gemm = dispatch


def _tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules with processed weights (a quant_method) whose weight another module shares."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    return [m for ms in owners.values() if len(ms) > 1 for m in ms if getattr(m, "quant_method", None) is not None]


def _not_reloaded_classes(model: torch.nn.Module, tied: list[torch.nn.Module]) -> set[str]:
    """Classes of modules a reload never loads by name: tied ones and those without parameters
    (minus classes that also have ordinary weighted instances, whose warning would be real)."""
    tied_ids = {id(m) for m in tied}
    quiet, loud = set(), set()
    for m in model.modules():
        own = any(True for _ in m.parameters(recurse=False))
        if id(m) in tied_ids or not any(True for _ in m.parameters()):
            quiet.add(type(m).__name__)
        elif own:
            loud.add(type(m).__name__)
    return quiet - loud


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's per-reload "Failed to load weights" warning for the given module classes."""

    def __init__(self, classes: set[str]):
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (
            record.msg == "%s: Failed to load weights"
            and isinstance(args, tuple)
            and len(args) > 0
            and args[0] in self.classes
        )


def check_update(
    named_tensors: Named,
    expected: dict[str, list[int]],
    optional: set[str] | frozenset[str] = frozenset(),
    what: str = "weight update",
    unit: str = "parameter",
    holder: str = "the engine's model",
) -> None:
    """Raise ValueError, naming the tensor, unless `named_tensors` has every name of `expected`
    (but `optional`) with its shape, as contiguous float tensors, and nothing else."""
    seen = set()
    for name, tensor in named_tensors:
        if name not in expected:
            raise ValueError(f"{what} has unknown {unit} {name!r} ({holder} has no such tensor)")
        if list(tensor.shape) != expected[name]:
            raise ValueError(f"{what}: {name} has shape {list(tensor.shape)}, {holder} has {expected[name]}")
        if not tensor.is_floating_point():
            raise ValueError(f"{what}: {name} has non-float dtype {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: {name} is not contiguous")
        seen.add(name)
    missing = set(expected) - set(optional) - seen
    if missing:
        raise ValueError(f"{what} lacks {len(missing)} {unit}(s), e.g. {sorted(missing)[:3]}")


class EngineWeights:
    """The weights of one model runner (a whole model, or one tensor-parallel shard): checks an
    update against the checkpoint's names and shapes, and loads it in place, by the copy plan
    when the model allows one, else by vLLM's reload."""

    def __init__(
        self,
        model_runner,
        expected_shapes: dict[str, list[int]],
        optional_names: Iterable[str] = (),
        checkpoint: Iterable[tuple[str, torch.Tensor]] | None = None,
        placeholders: bool = False,
    ):
        self._runner = model_runner
        self._expected = expected_shapes
        self._optional = set(optional_names)
        model = model_runner.get_model()
        self.plan: LoadPlan | None = None
        self.plan_refused: str | None = "no checkpoint to plan from"
        self._repack = ExpertRepack([])
        if checkpoint is not None:
            try:
                required = set(expected_shapes) - self._optional
                self.plan = LoadPlan.capture(model, checkpoint, required, perform=not placeholders)
                self._repack = ExpertRepack.of(model)
                if self._repack.layers:
                    self.plan = LoadPlan(
                        {
                            name: [
                                (self._repack.redirect(dst), shape, stride, offset)
                                for dst, shape, stride, offset in pairs
                            ]
                            for name, pairs in self.plan.copies.items()
                        }
                    )
                self.plan_refused = None
            except (PlanRefused, ValueError) as e:
                self.plan = None
                self.plan_refused = str(e)
                log.warning("weight swaps load through vLLM's reload_weights (slower): %s", e)
        self._held_sums: dict[str, tuple[int, int]] | None = None
        """Per tensor, the checksum of what the engine holds of it and the elements that covers,
        since the last summing (checksum_parts), kept in step by each delta's moves."""
        self._tied = _tied_modules(model)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            _ExpectedReloadWarnings(_not_reloaded_classes(model, self._tied))
        )

    @classmethod
    def of(cls, model_runner, model_path: str | Path) -> EngineWeights:
        shapes, optional = checkpoint_shapes(model_path)
        return cls(model_runner, shapes, optional, checkpoint_placeholders(model_path), placeholders=True)

    def check(self, named_tensors: Named) -> None:
        """Raise ValueError unless the update has every parameter of the engine's model with
        its shape, contiguous, and nothing else."""
        check_update(named_tensors, self._expected, self._optional)

    def prepare(self, named_tensors: Named) -> Prepared:
        """Check an update and bind it to the copy plan (no lock needed); raises ValueError. A
        trainer's fused expert tensors are taken as the checkpoint's per-expert ones."""
        named_tensors = per_expert(named_tensors)
        self.check(named_tensors)
        if self.plan is None:
            return Prepared(named=named_tensors)
        return Prepared.of(self.plan.bind(named_tensors))

    def source_views(self) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]] | None:
        """Per checkpoint name, the views of an incoming tensor the copy plan reads (a
        tensor-parallel worker's shard), in the plan's order; None without a plan (the reload
        path needs whole tensors). What `WeightReceiver(keep=...)` keeps."""
        if self.plan is None:
            return None
        return {
            name: [(shape, stride, offset) for _, shape, stride, offset in pairs]
            for name, pairs in self.plan.copies.items()
        }

    def prepare_kept(self, announced: Named, kept: dict[str, list[torch.Tensor]]) -> Prepared:
        """Check an update by its announced names and shapes (`announced`: tensors on the meta
        device are enough) and pair the plan's parameter views with the blocks a receiver kept
        for them (`source_views`' order); raises ValueError."""
        self.check(announced)
        assert self.plan is not None, "prepare_kept needs a copy plan (source_views was None)"
        return Prepared.of(
            [(dst, block) for name, pairs in self.plan.copies.items() for (dst, *_), block in zip(pairs, kept[name])]
        )

    def prepare_delta(self, update: WeightUpdate, pieces: Named) -> Prepared:
        """Decode a delta update's pieces and bind them to the copy plan (no lock needed);
        raises ValueError (also without a plan: vLLM's reload needs whole tensors)."""
        if self.plan is None:
            raise ValueError(f"this engine loads through vLLM's reload, which takes no delta ({self.plan_refused})")
        # A trainer may hold the experts fused: their changes go to the per-expert tensors.
        blocks = fused_blocks(self._expected)
        deltas = split_fused(decode_delta(update, pieces, self.numels()), blocks)
        sources: list[tuple[str, torch.Tensor]] = []
        pairs, scatters = bind_delta(self.plan.copies, deltas, sources)
        moves = None  # every checksum is summed again after the load
        if update.checksums and self._held_sums is not None:
            dtypes = {name: dtype_of(d) for name, d in weight_dtypes(update).items()}
            moves = checksum_moves(scatters, sources, dtypes, blocks)
        dense = {d.name for d in deltas if d.form == DENSE}
        return Prepared(pairs=pairs, host=HostSpans.of(pairs), scatters=scatters, moves=moves, dense=dense)

    def checksum_parts(self, update: WeightUpdate) -> dict[str, tuple[int, int]]:
        """Per tensor of `update`, the checksum of what this engine holds of it and how many
        elements that is (engine/weight_delta.py); {} without a copy plan. Computed over the
        weights after a full update (and for the tensors a delta sent dense); after a delta, the
        sums held before plus what its changes moved (an update's size, not the model's)."""
        if self.plan is None:
            return {}
        dtypes = {name: dtype_of(d) for name, d in weight_dtypes(update).items()}
        held = self._held_sums or {}
        missing = {name: dtype for name, dtype in dtypes.items() if name not in held}
        if missing:
            held |= checksum_parts(self.plan.copies, missing, fused_blocks(self._expected))
        self._held_sums = held
        return {name: held[name] for name in dtypes if name in held}

    def _note_sums(self, update: Prepared) -> None:
        """Keep the held checksums in step with a load: a delta moves them (and its dense tensors
        are summed again when next asked for); any other update makes every one be summed again."""
        if self._held_sums is None:
            return
        if update.moves is None:
            self._held_sums = None
            return
        for name in update.dense:
            self._held_sums.pop(name, None)
        for name, moved in update.moves.items():
            if name in self._held_sums:
                value, covered = self._held_sums[name]
                self._held_sums[name] = ((value + moved) % MODULUS, covered)

    def numels(self) -> dict[str, int]:
        """The element count of every checkpoint tensor, and of every fused expert tensor a
        trainer may send instead (engine/fused_experts.py)."""
        blocks = fused_blocks(self._expected)
        fused = {name: sum(n for _, _, n in parts) for name, parts in blocks.items()}
        return {name: math.prod(shape) for name, shape in self._expected.items()} | fused

    def load(self, update: Prepared, synchronize: bool = True) -> None:
        """Load a prepared update in place (each tensor-parallel worker its own shard); the
        caller makes sure no forward pass runs meanwhile (`synchronize`: LoadPlan.copy)."""
        self._note_sums(update)
        if update.host is not None or update.pairs is not None:
            if update.host is not None:
                update.host.copy()
            else:
                assert self.plan is not None and update.pairs is not None  # prepare bound it
                self.plan.copy(update.pairs, synchronize and not update.scatters)
            if update.scatters:
                scatter(update.scatters)
                if synchronize and self.plan is not None and self.plan.device.type == "cuda":
                    torch.cuda.synchronize(self.plan.device)
            self._repack.repack()
            return
        self._runner.reload_weights(weights_iterator=iter(update.named or ()))
        for module in self._tied:
            quant_method: Any = module.quant_method
            quant_method.process_weights_after_loading(module)


@dataclass(frozen=True)
class Prepared:
    """A checked update ready to load: bound to the copy plan (`pairs`), or the named tensors
    for vLLM's reload when the model allowed no plan."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    named: Named | None = None
    host: HostSpans | None = None
    """The pairs as memmoves that keep the GIL, when all of them are plain host copies."""
    scatters: list[Scatter] = field(default_factory=list)
    """A delta's changed elements, written after the pairs are copied (engine/weight_delta.py)."""
    moves: dict[str, int] | None = None
    """A delta's: per tensor, what it adds to the checksum of what the engine holds (None: not a
    delta, every checksum is summed again after it)."""
    dense: set[str] = field(default_factory=set)
    """A delta's tensors sent whole: their checksums are summed again after it."""

    @staticmethod
    def of(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Prepared:
        return Prepared(pairs=pairs, host=HostSpans.of(pairs))
