"""Exact routing and the grouped expert FFN (each active expert once over all of its tokens)."""

from __future__ import annotations

import numpy as np

from expert_service.experts.grouping import ExpertGroups, combine, group_by_expert


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """x [n, D], gate/up [F, D], down [D, F] -> [n, D]."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def route(router_logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, top-k, optional renormalisation: logits [T, E] -> ids, weights [T, K]."""
    logits = router_logits.astype(np.float32)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)


def route_planned(router_logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """LUT routing: the experts are given; weights = softmax of the gate logits of just those experts.
    logits [T, E], ids [T, k] -> weights [T, k]."""
    chosen = np.take_along_axis(router_logits.astype(np.float32), ids, axis=-1)
    chosen = np.exp(chosen - chosen.max(axis=-1, keepdims=True))
    return (chosen / chosen.sum(axis=-1, keepdims=True)).astype(np.float32)


def grouped_experts(
    x: np.ndarray, groups: ExpertGroups, weights: np.ndarray, expert_weights, stream_experts=None
) -> np.ndarray:
    """x [T, D]; expert_weights(e) -> (gate, up, down). Returns the weighted sum over each token's experts.
    `stream_experts(active ids)` -> iterator of (e, (gate, up, down)) replaces the lookup when experts pass
    through a cache in waves: each expert's rows are independent, so the order never changes the result."""
    grouped = np.zeros((groups.order.size, x.shape[1]), dtype=np.float32)
    active = groups.active_experts()
    items = stream_experts(active) if stream_experts else ((e, expert_weights(int(e))) for e in active)
    for e, mats in items:
        lo, hi = groups.offsets[e], groups.offsets[e + 1]
        grouped[lo:hi] = swiglu_mlp(x[groups.tokens_of(e)], *mats)
    return combine(grouped, groups, weights)


def sparse_moe(
    x: np.ndarray,
    router: np.ndarray,
    top_k: int,
    normalize: bool,
    expert_weights,
    planned_ids: np.ndarray | None = None,
    stream_experts=None,
) -> tuple[np.ndarray, np.ndarray]:
    """x [T, D], router [E, D] -> (output [T, D], expert ids [T, K]); `planned_ids` [T, k] replaces the
    exact top-k (LUT routing); `stream_experts` as in `grouped_experts`."""
    logits = x @ router.T
    if planned_ids is None:
        ids, weights = route(logits, top_k, normalize)
    else:
        ids, weights = planned_ids, route_planned(logits, planned_ids)
    groups = group_by_expert(ids, router.shape[0])
    return grouped_experts(x, groups, weights, expert_weights, stream_experts), ids
