"""Exact routing and the grouped expert FFN (each active expert once over all of its tokens)."""
from __future__ import annotations

import numpy as np

from expert_service.moe_grouping import ExpertGroups, combine, group_by_expert


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


def grouped_experts(x: np.ndarray, groups: ExpertGroups, weights: np.ndarray, expert_weights) -> np.ndarray:
    """x [T, D]; expert_weights(e) -> (gate, up, down). Returns the weighted sum over each token's experts."""
    grouped = np.zeros((groups.order.size, x.shape[1]), dtype=np.float32)
    for e in groups.active_experts():
        lo, hi = groups.offsets[e], groups.offsets[e + 1]
        grouped[lo:hi] = swiglu_mlp(x[groups.tokens_of(e)], *expert_weights(int(e)))
    return combine(grouped, groups, weights)


def sparse_moe(x: np.ndarray, router: np.ndarray, top_k: int, normalize: bool,
               expert_weights) -> tuple[np.ndarray, np.ndarray]:
    """x [T, D], router [E, D] -> (output [T, D], chosen expert ids [T, K])."""
    ids, weights = route(x @ router.T, top_k, normalize)
    groups = group_by_expert(ids, router.shape[0])
    return grouped_experts(x, groups, weights, expert_weights), ids
