"""The router's planner on a gated table (router-gen --min-share, NO_EXPERT entries): a step's tokens grouped by
expert with the entries that predict nothing left out, and a worker on --routing lut refused such a table."""

from __future__ import annotations

import numpy as np

from common.routing_plan import NO_EXPERT
from common.routing_table import RoutingTable
from router_service.routing import RoutingPlanner, lut_plan_problem, step_token_ids
from router_service.scheduled import Chunk, ScheduledStep

L, V, E, K = 3, 40, 6, 2


def gated_table(seed: int) -> RoutingTable:
    rng = np.random.default_rng(seed)
    table = np.argsort(rng.random((L, V, E)), axis=2)[:, :, :K].astype(np.uint16)
    table[np.arange(K)[None, None, :] >= rng.integers(0, K + 1, (L, V))[:, :, None]] = NO_EXPERT
    return RoutingTable(table, E, [1, 3, 5])


def step(rng) -> ScheduledStep:
    chunks = tuple(
        Chunk(rid, tuple(int(t) for t in rng.integers(0, V, int(rng.integers(1, 9)))), True, True)
        for rid in range(int(rng.integers(0, 3)))
    )
    decodes = tuple(range(10, 10 + int(rng.integers(0, 4))))
    scheduled = {**{c.request_id: len(c.token_ids) for c in chunks}, **dict.fromkeys(decodes, 1)}
    tokens = tuple(int(t) for t in rng.integers(0, V, len(decodes)))
    return ScheduledStep(scheduled, chunks, decodes, tokens, frozenset())


def test_each_expert_lists_the_step_tokens_that_predict_it_and_no_expert_lists_nothing():
    """Against a slow reference: per layer, expert e's tokens are those whose row names e, ascending; the row's
    length is the step's tokens x k, its entries past the real ones -1."""
    rng = np.random.default_rng(0)
    table = gated_table(1)
    planner = RoutingPlanner(table, model_top_k=K)
    for _ in range(30):
        scheduled = step(rng)
        ids = step_token_ids(scheduled)
        plan = planner.routing_plan(scheduled)
        assert plan.layers == (1, 3, 5)
        for l, (_, offsets, indices) in enumerate(plan.csr()):
            lists = [[t for t, token in enumerate(ids) if e in table.table[l, token].tolist()] for e in range(E)]
            assert offsets.tolist() == np.cumsum([0] + [len(x) for x in lists]).tolist()
            real = offsets[-1]
            assert indices.tolist() == [t for x in lists for t in x] + [-1] * (len(ids) * K - real)
            assert real == int((table.table[l, ids] != NO_EXPERT).sum())


def test_a_worker_on_lut_refuses_a_gated_table():
    """routing=lut routes each token to the experts its plan names: a token with fewer than k has no routing."""
    complete = RoutingTable(np.tile(np.arange(K, dtype=np.uint16), (L, V, 1)), E, [1, 3, 5])
    assert lut_plan_problem("lut", RoutingPlanner(complete, model_top_k=K)) is None
    problem = lut_plan_problem("lut", RoutingPlanner(gated_table(2), model_top_k=K))
    assert problem is not None and "NO_EXPERT" in problem and "--min-share" in problem and "\n" not in problem
    assert lut_plan_problem("exact", RoutingPlanner(gated_table(2), model_top_k=K)) is None  # a prediction: fine
    assert "experts a token" in (lut_plan_problem("lut", RoutingPlanner(gated_table(2), model_top_k=3)) or "")
