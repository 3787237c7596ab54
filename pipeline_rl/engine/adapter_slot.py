"""The policy's LoRA adapter in a vLLM engine: one slot of the engine's stacked LoRA buffers,
written in place by each update (the LoRA counterpart of engine/engine_weights.py).

The engine runs with LoRA enabled and one adapter, `POLICY_LORA_ID`, loaded from a PEFT
directory when it starts, pinned in its slot and named by every request. vLLM keeps each
LoRA layer's adapters stacked, [slots, 1, rank, in] for A and [slots, 1, out, rank] for B
(B scaled by alpha / rank), and copies an adapter into a slot with the layer's `set_lora`
(which also slices it for this worker's tensor-parallel shard). An update here:

- `prepare` (no lock): checks every tensor against the adapter the engine started with (names,
  shapes: a wrong rank or target module is refused naming the tensor), then has vLLM's own code
  turn it into what a slot holds (q/k/v and gate/up packed, B scaled) on the engine's device;
- `load` (under the swap lock): one copy into the slot by a copy plan that `set_lora` traced
  when the engine started (`AdapterSlot`): memmoves that keep the GIL when every view is a
  plain host copy (`host_copy.py`), else one `_foreach_copy_`. Requests in flight keep their
  slot and decode their next step with the new adapter. The registered adapter is replaced
  too, so that if vLLM ever activated it again it would write this one.

No adapter id per version, no request restarted. Like the full-weight swap this relies on vLLM
internals (the LoRA manager's modules, slots and packing), checked on the release
`vllm_hook.check_vllm_version` accepts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pipeline_rl.engine.engine_weights import check_update
from pipeline_rl.engine.host_copy import HostSpans
from pipeline_rl.engine.load_plan import Copies, CopyRecorder, PlanRefused, bind
from pipeline_rl.lora import CONFIG_FILE, WEIGHTS_FILE

log = logging.getLogger(__name__)

POLICY_LORA_ID = 1
"""vLLM's int id of the policy's adapter (ids must be > 0)."""
POLICY_LORA_NAME = "policy"


def engine_max_rank(rank: int) -> int:
    """The smallest rank vLLM can reserve (its max_lora_rank choices) that holds `rank`; a slot's
    rows beyond `rank` stay zero."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"bad value for 'model.lora.rank': {rank}, vLLM serves ranks up to 512")


def lora_request(adapter_dir: str | Path) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(POLICY_LORA_NAME, POLICY_LORA_ID, str(adapter_dir))


Write = tuple[Any, Any, Any]
"""A LoRA layer of the engine and its (A, B) in the form its `set_lora` takes (a tensor, or a
list with one entry per packed slice), or (layer, None, None): the adapter leaves it alone."""


def _inputs(write: Write) -> list[torch.Tensor | None]:
    """The tensors `set_lora` copies from, in a fixed order: A's slices, then B's."""
    _, lora_a, lora_b = write
    return [*(lora_a if isinstance(lora_a, list) else [lora_a]), *(lora_b if isinstance(lora_b, list) else [lora_b])]


@dataclass(frozen=True)
class PreparedAdapter:
    """A checked adapter in the form a slot holds: bound to the slot's copy plan (`dsts`,
    `srcs`), or the per-layer writes for `set_lora` when the engine allowed no plan."""

    writes: list[Write]
    model: Any
    """vLLM's LoRAModel of this adapter."""
    dsts: list[torch.Tensor] | None = None
    srcs: list[torch.Tensor] | None = None
    host: HostSpans | None = None
    """The plan's copies as memmoves that keep the GIL, when all of them are plain host copies."""


class AdapterSlot:
    """The policy adapter's slot in one model runner's LoRA layers.

    When the engine starts, `set_lora` writes the start-up adapter into the slot once under a
    copy recorder (engine/engine_weights.py's), which notes every slot view it copies into and
    from where (this worker's shard of which A or B slice). An update is then one
    copy of the same views from the new tensors, in the lock; the slot's rows beyond
    the rank stay as that first write cleared them. A layer whose write the recorder cannot
    replay (a copy from a transformed tensor) makes every update go through `set_lora`."""

    def __init__(self, model_runner, adapter_dir: str | Path):
        from vllm.lora.peft_helper import PEFTHelper

        self.manager: Any = model_runner.lora_manager._adapter_manager
        if POLICY_LORA_ID not in self.manager.lora_index_to_id:
            raise RuntimeError("the policy's LoRA adapter is not active in the engine (add and pin it first)")
        self.slot = self.manager.lora_index_to_id.index(POLICY_LORA_ID)
        self._config = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text())
        self._helper = PEFTHelper.from_dict(dict(self._config))
        initial = load_file(str(Path(adapter_dir) / WEIGHTS_FILE))
        self.expected: dict[str, list[int]] = {name: list(t.shape) for name, t in initial.items()}
        layer = next(iter(self.manager.modules.values()))
        self.device = layer.lora_a_stacked[0].device
        self.dtype = layer.lora_a_stacked[0].dtype
        self.copies: Copies | None = None
        self.plan_refused: str | None = None
        self._layouts: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        try:
            self._capture(self._writes(list(initial.items()))[0])
        except PlanRefused as e:
            self.plan_refused = str(e)
            log.warning("adapter swaps write through vLLM's set_lora (slower): %s", e)

    def _capture(self, writes: list[Write]) -> None:
        recorder = CopyRecorder()
        with torch.no_grad(), recorder:
            for m, write in enumerate(writes):
                module, lora_a, lora_b = write
                if lora_a is None:
                    module.reset_lora(self.slot)
                    continue
                recorder.incoming = {(m, i): t for i, t in enumerate(_inputs(write)) if t is not None}
                self._layouts.update({k: (tuple(t.shape), tuple(t.stride())) for k, t in recorder.incoming.items()})
                module.set_lora(self.slot, lora_a, lora_b)
            recorder.incoming = {}
        self.copies = recorder.copies

    def check(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError, naming the tensor, unless the update has every tensor of the engine's
        adapter with its shape (its rank, its target modules) and nothing else."""
        holder = f"the engine's rank-{self._config['r']} adapter on {sorted(self._config['target_modules'])}"
        check_update(named_tensors, self.expected, what="adapter update", unit="tensor", holder=holder)

    def _writes(self, named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[Write], Any]:
        """Check an update and have vLLM's own code turn it into per-layer slot contents: q/k/v
        and gate/up packed, B scaled by alpha / rank, on the engine's device (copies: the
        caller's tensors stay as they are)."""
        from vllm.lora.lora_model import LoRAModel

        self.check(named_tensors)
        tensors = {name: t.to(self.device, self.dtype, copy=True) for name, t in named_tensors}
        model = LoRAModel.from_lora_tensors(
            POLICY_LORA_ID, tensors, self._helper, device=str(self.device), dtype=self.dtype
        )
        self.manager._create_merged_loras_inplace(model)
        writes: list[Write] = []
        for module_name, module in self.manager.modules.items():
            weights = self.manager._get_lora_layer_weights(model, module_name)
            writes.append((module, None, None) if not weights else (module, weights.lora_a, weights.lora_b))
        return writes, model

    def prepare(self, named_tensors: list[tuple[str, torch.Tensor]]) -> PreparedAdapter:
        """Check an update and bind it to the slot's copy plan (no lock needed); raises
        ValueError."""
        writes, model = self._writes(named_tensors)
        if self.copies is None:
            return PreparedAdapter(writes, model)
        dsts, srcs = [], []
        for m, write in enumerate(writes):
            for i, t in enumerate(_inputs(write)):
                if t is None or write[1] is None:
                    continue
                if self._layouts.get((m, i)) != (tuple(t.shape), tuple(t.stride())):
                    return PreparedAdapter(writes, model)  # not the layout the plan was made from
                for dst, src in bind(self.copies, (m, i), t):
                    dsts.append(dst)
                    srcs.append(src)
        return PreparedAdapter(writes, model, dsts, srcs, HostSpans.of(list(zip(dsts, srcs))))

    def load(self, update: PreparedAdapter) -> None:
        """Write a prepared adapter into the policy's slot; the caller makes sure no forward pass
        runs meanwhile."""
        with torch.no_grad():
            if update.host is not None:
                update.host.copy()
            elif update.dsts is not None and update.srcs is not None:
                torch._foreach_copy_(update.dsts, update.srcs)
            else:
                for module, lora_a, lora_b in update.writes:
                    if lora_a is None:
                        module.reset_lora(self.slot)
                    else:
                        module.set_lora(self.slot, lora_a, lora_b)
        self.manager._registered_adapters.put(POLICY_LORA_ID, update.model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the next forward pass may run on another stream


def single_slot_cpu_lora() -> None:
    """Make vLLM's CPU LoRA kernels multiply by the one slot's matrices directly when the engine
    has one slot (as the policy's engine does). Its torch kernels gather every token's adapter
    matrices (`weights[indices]`: tokens x out x in copied per layer and step) and einsum them;
    with one slot every index, -1 included, selects slot 0, so a plain matmul computes the same.
    Measured by scripts/bench_lora.py. Idempotent; call it before an engine runs."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, "_pipeline_rl", False):
        return
    shrink, expand, expand_slice = lora_ops.bgmv_shrink, lora_ops.bgmv_expand, lora_ops.bgmv_expand_slice

    def only(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The one slot's matrix, [out, in]."""
        w = weights[0]
        return (w[0] if w.dim() == 3 else w).to(dtype)

    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        if lora_a_weights.shape[0] != 1:
            return shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        dtype = output_tensor.dtype
        outputs = inputs.to(dtype) @ only(lora_a_weights, dtype).T
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        if lora_b_weights.shape[0] != 1:
            return expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        dtype = output_tensor.dtype
        outputs = inputs.to(dtype) @ only(lora_b_weights, dtype).T
        limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        common = min(outputs.shape[1], output_tensor.shape[1])
        if add_inputs:
            output_tensor[:, :common] += outputs[:limit, :common]
        else:
            output_tensor[:, :common] = outputs[:limit, :common]

    def bgmv_expand_slice(
        inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True
    ):
        if lora_b_weights.shape[0] != 1:
            return expand_slice(
                inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs
            )
        dtype = output_tensor.dtype
        outputs = inputs.to(dtype) @ only(lora_b_weights, dtype).T
        if add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
        else:
            output_tensor[:, slice_offset : slice_offset + slice_size] = outputs

    for fast in (bgmv_shrink, bgmv_expand, bgmv_expand_slice):
        fast._pipeline_rl = True  # pyright: ignore[reportFunctionMemberAccess]
        # The sgmv kernels call these through lora_ops' globals; the CPU wrapper imported its own names.
        setattr(lora_ops, fast.__name__, fast)
        setattr(punica_cpu, fast.__name__, fast)
