"""The expert cache on the CPU backend: the slot plan (how many slots a budget buys) and a simulated copy
engine. Slots are float32 buffers allocated once; a copy reads the expert's one contiguous block from the
model's mmap and widens it into the slot on a single background thread, which stands in for the GPU's copy
stream: copies run in issue order and overlap with the numpy compute on the model thread (numpy releases
the GIL). Copies are accounted as the stored block's bytes — what a host-to-device copy would move.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from common import dtypes
from common.model_format import ModelDir

GIB = 2 ** 30


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """How experts are held: all resident, or `slots_per_layer` slots per MoE layer acting as a cache."""
    slots_per_layer: int           # == num_experts when every expert is resident
    num_experts: int
    num_moe_layers: int
    expert_block_bytes: int        # stored bytes of one expert (gate, up, down back to back)
    budget_bytes: int              # the --expert-cache-gb budget (0: none given)

    @property
    def is_cached(self) -> bool:
        """Fewer slots than experts: the expert cache runs."""
        return self.slots_per_layer < self.num_experts

    @property
    def slot_bytes(self) -> int:
        """Stored bytes the slots hold: what the device would allocate for them."""
        return self.slots_per_layer * self.num_moe_layers * self.expert_block_bytes


def plan_slots(model: ModelDir, expert_cache_gb: float, expert_cache_slots: int) -> SlotPlan:
    """Explicit slots win; else floor(budget / (MoE layers x expert block bytes)), at least 1; else all."""
    cfg = model.config
    layers, num_experts = cfg.moe_layers, cfg.num_experts
    block = model.expert_block(layers[0], 0)[2] if layers else 0
    budget = int(expert_cache_gb * GIB)
    if expert_cache_slots > 0:
        slots = expert_cache_slots
    elif budget > 0 and layers:
        slots = max(1, budget // (len(layers) * block))
    else:
        slots = num_experts
    return SlotPlan(min(slots, num_experts), num_experts, len(layers), block, budget)


class HostCopyEngine:
    """Float32 slot buffers [layer][slot] = (gate [F, D], up [F, D], down [D, F]) and a one-thread copier."""

    def __init__(self, model: ModelDir, moe_layers: list[int], slots_per_layer: int):
        self.model = model
        prefix = f"layers.{moe_layers[0]}.experts.0."
        self._shapes = tuple(model.entries[prefix + p].shape for p in ("gate_proj", "up_proj", "down_proj"))
        self.slots = {layer: [tuple(np.zeros(s, dtype=np.float32) for s in self._shapes)
                              for _ in range(slots_per_layer)] for layer in moe_layers}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-expert-copy")

    @property
    def nbytes(self) -> int:
        """Host bytes of the float32 slot buffers."""
        return sum(a.nbytes for layer in self.slots.values() for slot in layer for a in slot)

    def weights(self, layer: int, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.slots[layer][slot]

    def copy(self, layer: int, expert: int, slot: int) -> Future:
        return self._executor.submit(self._copy, layer, expert, slot)

    def _copy(self, layer: int, expert: int, slot: int) -> None:
        file, offset, nbytes = self.model.expert_block(layer, expert)
        dtype = self.model.dtype
        block = self.model._map(file)[offset:offset + nbytes].view(dtypes.STORAGE[dtype])
        start = 0
        for dst, shape in zip(self.slots[layer][slot], self._shapes):
            n = shape[0] * shape[1]
            src = block[start:start + n].reshape(shape)
            start += n
            if dtype == "bfloat16":      # widen in place: bf16 words are the top half of a float32
                bits = dst.view(np.uint32)
                np.copyto(bits, src)
                bits <<= 16
            else:
                np.copyto(dst, src)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
