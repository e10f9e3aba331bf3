"""How experts are held: all resident on the backend, or a fixed number of slots per MoE layer acting as a
cache over the full host copy of the experts (`ExpertCache`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError
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
    slot_row_bytes: int = 0  # one slot in every MoE layer, each at its layer's own stride (0: not known)

    @property
    def is_cached(self) -> bool:
        """Fewer slots than experts: the expert cache runs."""
        return self.slots_per_layer < self.num_experts

    def step_prefetches(self, tokens: int, top_k: int, large_steps: bool = False) -> bool:
        """Whether a step of `tokens` tokens prefetches (plan or lookahead): only while every expert its tokens may
        route to fits a layer's slots (tokens x top_k <= slots), unless `large_steps`
        (EngineConfig.prefetch_large_steps). A larger step misses most of what a prediction names anyway, its demand
        copies already fill the link, and its prefetches evict experts its own later tokens hit."""
        return large_steps or tokens * top_k <= self.slots_per_layer

    def describe(self) -> str:
        """One log line: what the settings came to, the bytes the slots take against the budget (a budget is
        floored to whole slots per layer, and one holding every expert runs no cache)."""
        held = self.slots_per_layer * self.slot_row_bytes
        if self.budget_bytes:
            budget = f"--expert-cache-gb {self.budget_bytes / GIB:.4g} ({self.budget_bytes} bytes)"
        else:
            budget = "no --expert-cache-gb"
        if not self.is_cached:
            return (
                f"expert cache: off, all {self.num_experts} experts of each of {self.num_moe_layers} MoE layers "
                f"resident ({held} bytes; {budget})"
            )
        spare = f", {self.budget_bytes - held} bytes of the budget unused" if self.budget_bytes else ""
        return (
            f"expert cache: {self.slots_per_layer} of {self.num_experts} slots in each of {self.num_moe_layers} MoE "
            f"layers, {held} bytes ({budget}{spare})"
        )


def plan_slots(model: ModelDir, expert_cache_gb: float, expert_cache_slots: int) -> SlotPlan:
    """Explicit slots win (and must fit a budget given beside them); else as many slots per layer as the budget
    holds; else all. A slot of layer L takes the layer's own expert stride, as the device allocates it, so a
    layer of int8 experts costs about half what a bf16 one does. Settings that cannot be met raise ConfigError."""
    cfg = model.config
    layers, num_experts = cfg.moe_layers, cfg.num_experts
    row = sum(model.expert_strides[layer] for layer in layers)  # one slot in every MoE layer
    budget = int(expert_cache_gb * GIB)
    if expert_cache_slots > num_experts:
        raise ConfigError(
            f"expert_cache_slots: {expert_cache_slots} slots per MoE layer is more than the model's "
            f"{num_experts} experts per layer (at most {num_experts}; 0 = from --expert-cache-gb)"
        )
    if not layers:  # every layer dense: no expert to cache, and a cache of no layer is one no backend builds
        return SlotPlan(num_experts, num_experts, 0, model.max_expert_nbytes, budget, row)
    slots = expert_cache_slots or num_experts
    if expert_cache_gb > 0:  # a positive budget under one byte is still a budget, not "none"
        fits = budget // row
        if fits < 1:
            raise ConfigError(
                f"expert_cache_gb: {expert_cache_gb:g} GiB holds no expert slot: one slot in each of the "
                f"{len(layers)} MoE layers needs {row} bytes ({row / GIB:.6g} GiB)"
            )
        if expert_cache_slots > fits:
            raise ConfigError(
                f"expert_cache_slots: {expert_cache_slots} slots per MoE layer need {expert_cache_slots * row} "
                f"bytes; --expert-cache-gb {expert_cache_gb:g} ({budget} bytes) holds {fits}"
            )
        slots = expert_cache_slots or min(fits, num_experts)
    return SlotPlan(slots, num_experts, len(layers), model.max_expert_nbytes, budget, row)
