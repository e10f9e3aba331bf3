"""Routing plans on the worker (docs/routing.md; the type is `common.routing_plan.RoutingPlan`): the router's
per-layer prediction of which experts each of the step's tokens goes to. With `routing=lut` the plan is the
routing (combine weights = softmax of the gate logits of just the planned experts); with `routing=exact` it is
a prediction whose recall is measured.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.model_format import ModelDir
from common.routing_plan import RoutingPlan
from common.routing_table import TABLE_FILE, RoutingTable
from expert_service.engine.config import EngineConfig, PrefetchSource

ROUTER_PLANS = "router"  # EngineConfig.plan_table: the router's plans, never a table on the device


def routing_plan_recall(planned: dict[int, np.ndarray], exact: dict[int, np.ndarray]) -> float | None:
    """Share of the exact (token, expert) assignments the routing plan predicted, over all planned MoE layers
    (both as {layer: expert ids [T, k]})."""
    hits = total = 0
    for layer, exact_ids in exact.items():
        predicted = planned.get(layer)
        if predicted is None:
            continue
        hits += int((exact_ids[:, :, None] == predicted[:, None, :]).any(axis=-1).sum())
        total += exact_ids.size
    return hits / total if total else None


def warmup_routing_plan(moe_layers: list[int], num_experts: int, top_k: int, num_tokens: int) -> RoutingPlan:
    """A routing plan sending every token to experts 0..top_k-1 (the worker's own warm-up step under
    routing=lut)."""
    expert_ids = np.broadcast_to(np.arange(top_k, dtype=np.int32), (len(moe_layers), num_tokens, top_k))
    return RoutingPlan.from_expert_ids(moe_layers, expert_ids, num_experts)


def worker_plan_table(model: ModelDir, config: EngineConfig) -> RoutingTable | None:
    """The routing table the expert cache's plan prefetch looks each step's own tokens up in (on the device on
    the cuda backend; EngineConfig.plan_table), or None: the prefetch reads the router's plans (or is off)."""
    if config.plan_table == ROUTER_PLANS or PrefetchSource.PLAN not in config.prefetch_sources:
        return None
    path = Path(config.plan_table) if config.plan_table else model.path / TABLE_FILE
    if not path.is_file():
        if not config.plan_table:
            return None
        raise ConfigError(f"plan_table: {path} is not a file (a `colibri router-gen` table, or {ROUTER_PLANS!r})")
    return RoutingTable.load(path, model.config)
