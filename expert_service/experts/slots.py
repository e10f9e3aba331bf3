"""How experts are held: all resident on the backend, or a fixed number of slots per MoE layer acting as a
cache over the full host copy of the experts (`ExpertCache`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.model_format import ModelDir

# --- slot plan ---------------------------------------------------------------------------------
GIB = 2**30


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """How experts are held: all resident, or `slots_per_layer` slots per MoE layer acting as a cache."""

    slots_per_layer: int  # == num_experts when every expert is resident
    num_experts: int
    num_moe_layers: int
    expert_block_bytes: int  # stored bytes of the largest expert block (matrices and scales)
    budget_bytes: int  # the --expert-cache-gb budget (0: none given)

    @property
    def is_cached(self) -> bool:
        """Fewer slots than experts: the expert cache runs."""
        return self.slots_per_layer < self.num_experts


def plan_slots(model: ModelDir, expert_cache_gb: float, expert_cache_slots: int) -> SlotPlan:
    """Explicit slots win; else floor(budget / (MoE layers x expert block bytes)), at least 1; else all."""
    cfg = model.config
    layers, num_experts = cfg.moe_layers, cfg.num_experts
    block = model.max_expert_nbytes  # a slot holds any expert of the model
    budget = int(expert_cache_gb * GIB)
    if expert_cache_slots > 0:
        slots = expert_cache_slots
    elif budget > 0 and layers:
        slots = max(1, budget // (len(layers) * block))
    else:
        slots = num_experts
    return SlotPlan(min(slots, num_experts), num_experts, len(layers), block, budget)
