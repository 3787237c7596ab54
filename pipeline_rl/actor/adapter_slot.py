"""The policy's LoRA adapter in a vLLM engine: one slot of the engine's stacked LoRA buffers,
written in place by each update (the LoRA counterpart of actor/engine_weights.py).

The engine runs with LoRA enabled and one adapter, `POLICY_LORA_ID`, loaded from a PEFT
directory when it starts, pinned in its slot and named by every request. vLLM keeps each
LoRA layer's adapters stacked, [slots, 1, rank, in] for A and [slots, 1, out, rank] for B
(B scaled by alpha / rank), and copies an adapter into a slot with the layer's `set_lora`
(which also slices it for this worker's tensor-parallel shard). An update here:

- `prepare` (no lock): checks every tensor against the adapter the engine started with (names,
  shapes: a wrong rank or target module is refused naming the tensor), then has vLLM's own code
  turn it into what a slot holds (q/k/v and gate/up packed, B scaled) on the engine's device;
- `load` (under the swap lock): each layer's `set_lora` into the policy's slot: requests in
  flight keep their slot and decode their next step with the new adapter. The registered
  adapter is replaced too, so that if vLLM ever activated it again it would write this one.

No adapter id per version, no request restarted. Like the full-weight swap this relies on vLLM
internals (the LoRA manager's modules, slots and packing), checked on the release
`vllm_hook.check_vllm_version` accepts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pipeline_rl.lora import CONFIG_FILE, WEIGHTS_FILE

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


@dataclass(frozen=True)
class PreparedAdapter:
    """A checked adapter in the form a slot holds: per LoRA layer of the engine, its (A, B) or
    None (the adapter leaves that layer alone)."""

    writes: list[tuple[Any, Any, Any]]
    model: Any
    """vLLM's LoRAModel of this adapter."""


class AdapterSlot:
    """The policy adapter's slot in one model runner's LoRA layers."""

    def __init__(self, model_runner, adapter_dir: str | Path):
        from vllm.lora.peft_helper import PEFTHelper

        self.manager: Any = model_runner.lora_manager._adapter_manager
        if POLICY_LORA_ID not in self.manager.lora_index_to_id:
            raise RuntimeError("the policy's LoRA adapter is not active in the engine (add and pin it first)")
        self.slot = self.manager.lora_index_to_id.index(POLICY_LORA_ID)
        self._config = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text())
        self._helper = PEFTHelper.from_dict(dict(self._config))
        self.expected: dict[str, list[int]] = {}
        with safe_open(str(Path(adapter_dir) / WEIGHTS_FILE), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                self.expected[name] = list(f.get_slice(name).get_shape())
        layer = next(iter(self.manager.modules.values()))
        self.device = layer.lora_a_stacked[0].device
        self.dtype = layer.lora_a_stacked[0].dtype

    def check(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError, naming the tensor, unless the update has every tensor of the engine's
        adapter with its shape (its rank, its target modules) and nothing else."""
        seen = set()
        for name, tensor in named_tensors:
            if name not in self.expected:
                raise ValueError(f"adapter update has {name!r}, which the engine's adapter has not (target modules?)")
            if list(tensor.shape) != self.expected[name]:
                raise ValueError(
                    f"adapter update: {name} has shape {list(tensor.shape)}, the engine's adapter has "
                    f"{self.expected[name]} (rank {self._config['r']})"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"adapter update: {name} has non-float dtype {tensor.dtype}")
            seen.add(name)
        missing = sorted(set(self.expected) - seen)
        if missing:
            raise ValueError(f"adapter update lacks {len(missing)} tensor(s), e.g. {missing[:3]}")

    def prepare(self, named_tensors: list[tuple[str, torch.Tensor]]) -> PreparedAdapter:
        """Check an update and turn it into per-layer slot contents (no lock needed); raises
        ValueError. The tensors are copied: the caller's stay as they are."""
        from vllm.lora.lora_model import LoRAModel

        self.check(named_tensors)
        tensors = {name: t.to(self.device, self.dtype, copy=True) for name, t in named_tensors}
        model = LoRAModel.from_lora_tensors(
            POLICY_LORA_ID, tensors, self._helper, device=str(self.device), dtype=self.dtype
        )
        self.manager._create_merged_loras_inplace(model)  # packs q/k/v and gate/up, scales B
        writes = []
        for module_name, module in self.manager.modules.items():
            weights = self.manager._get_lora_layer_weights(model, module_name)
            writes.append((module, None, None) if not weights else (module, weights.lora_a, weights.lora_b))
        return PreparedAdapter(writes, model)

    def load(self, update: PreparedAdapter) -> None:
        """Write a prepared adapter into the policy's slot; the caller makes sure no forward pass
        runs meanwhile."""
        with torch.no_grad():
            for module, lora_a, lora_b in update.writes:
                if lora_a is None:
                    module.reset_lora(self.slot)
                else:
                    module.set_lora(self.slot, lora_a, lora_b)
        self.manager._registered_adapters.put(POLICY_LORA_ID, update.model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the next forward pass may run on another stream
