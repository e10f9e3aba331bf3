"""Routing plans from the static routing table: every step's tokens are looked up, vectorised, into per-MoE-layer
CSR arrays (expert -> indices of the step's tokens) that travel with the step.

Token order is the worker's: prompt chunks in step order, then one token per decoding request (the token it
sampled last, which the worker feeds next). The planner reads only the scheduled step, which carries both.
"""

from __future__ import annotations

import numpy as np

from common.routing_plan import RoutingPlan
from common.routing_table import RoutingTable
from router_service.scheduler import ScheduledStep


def step_token_ids(step: ScheduledStep) -> np.ndarray:
    """The step's tokens in the order the worker lays them out."""
    pieces = [np.asarray(chunk.token_ids, dtype=np.int64) for chunk in step.prefill_chunks]
    pieces.append(np.asarray(step.decode_token_ids, dtype=np.int64))
    return np.concatenate(pieces)


class RoutingPlanner:
    """Turns a scheduled step into its `RoutingPlan` (bench/routing_lookup.py times it)."""

    def __init__(self, table: RoutingTable, model_top_k: int | None = None):
        self.table = table
        self.model_top_k = model_top_k  # the model's experts a token: what a worker on --routing lut needs a plan of

    def routing_plan(self, step: ScheduledStep) -> RoutingPlan:
        """The step's plan: each token's predictions per layer, a NO_EXPERT entry (a token the table predicts
        nothing more for) naming no expert (rows padded, common/routing_plan.py)."""
        return self.table.routing_plan(step_token_ids(step))

    def narrowed(self, width: int) -> RoutingPlanner:
        """This planner with each token's first `width` predictions (the table's best ranks: its first k columns are
        router-gen's --top-k k table), over a view of the table; itself when it predicts no more."""
        table = self.table
        if not 0 < width < table.top_k:
            return self
        first = RoutingTable(table.table[:, :, :width], table.num_experts, table.moe_layers, table.model_digest)
        return RoutingPlanner(first, self.model_top_k)


def lut_plan_problem(worker_routing: str, planner: RoutingPlanner | None) -> str | None:
    """Why a worker whose Info reports `worker_routing` would refuse every step this router's `planner` plans (None:
    it would not): a worker on --routing lut routes each token to the plan's experts and refuses a step without
    exactly the model's top-k of them a token."""
    if worker_routing != "lut":
        return None
    if planner is None:
        return (
            "it runs --routing lut, which needs a routing plan with every step: start the router with --routing-table"
        )
    top_k, model_top_k = planner.table.top_k, planner.model_top_k
    if model_top_k is not None and top_k != model_top_k:
        return (
            f"routing_table: {top_k} experts a token, but the worker runs --routing lut, which routes each token "
            f"to the model's {model_top_k} (`colibri router-gen --top-k {model_top_k}`)"
        )
    if not planner.table.complete:
        return (
            "routing_table: some tokens have no prediction at some layers (NO_EXPERT entries, `router-gen "
            "--min-share`), but the worker runs --routing lut, which routes each token to the experts the plan names "
            "(build the table without --min-share)"
        )
    return None
