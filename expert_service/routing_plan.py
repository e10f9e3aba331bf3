"""Routing plans on the worker (docs/routing.md): the router's per-layer CSR prediction of which experts each of the
step's tokens goes to. With `routing=lut` the plan is the routing (combine weights = softmax of the gate
logits of just the planned experts); with `routing=exact` it is a prediction whose recall is measured.
"""
from __future__ import annotations

import numpy as np

from common.errors import InvalidRequestError
from common.tensors import from_pb



def plan_from_pb(routing_plan, moe_layers: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A `RoutingPlan` message -> {layer: (offsets [E+1], token_indices [T*k])} (checked by `plan_ids`)."""
    layers = [int(layer) for layer in routing_plan.layers]
    if not layers:
        return {}
    if layers != list(moe_layers):
        raise InvalidRequestError("routing_plan.layers", f"must be the MoE layers {moe_layers}, got {layers}")
    offsets = from_pb(routing_plan.offsets, "routing_plan.offsets", "int32")
    tokens = from_pb(routing_plan.token_indices, "routing_plan.token_indices", "int32")
    if offsets.ndim != 2 or tokens.ndim != 2 or offsets.shape[0] != len(layers) or tokens.shape[0] != len(layers):
        raise InvalidRequestError("routing_plan", f"offsets {list(offsets.shape)} and token_indices "
                                                  f"{list(tokens.shape)} need one row per layer ({len(layers)})")
    return {layer: (offsets[i], tokens[i]) for i, layer in enumerate(layers)}


def plan_ids(plan: dict[int, tuple[np.ndarray, np.ndarray]], num_experts: int,
             num_tokens: int) -> dict[int, np.ndarray]:
    """{layer: CSR} -> {layer: expert ids [T, k]}."""
    return {layer: csr_to_ids(offsets, tokens, num_experts, num_tokens) for layer, (offsets, tokens) in plan.items()}


def csr_to_ids(offsets: np.ndarray, token_indices: np.ndarray, num_experts: int, num_tokens: int) -> np.ndarray:
    """CSR (tokens of expert e = token_indices[offsets[e]:offsets[e+1]]) -> expert ids [T, k], each token's
    experts in ascending expert order."""
    if offsets.shape != (num_experts + 1,) or offsets[0] != 0 or np.any(np.diff(offsets) < 0) \
            or offsets[-1] != token_indices.size:
        raise InvalidRequestError("routing_plan.offsets", f"must be [{num_experts + 1}] non-decreasing from 0 "
                                                                 f"to {token_indices.size}")
    if token_indices.size % max(num_tokens, 1) or (token_indices.size and (token_indices.min() < 0
                                                                          or token_indices.max() >= num_tokens)):
        raise InvalidRequestError("routing_plan.token_indices",
                                  f"must index the step's {num_tokens} tokens, the same number of times each")
    per_token = np.bincount(token_indices, minlength=num_tokens)
    k = token_indices.size // max(num_tokens, 1)
    if np.any(per_token != k):
        raise InvalidRequestError("routing_plan.token_indices", f"every token needs {k} experts")
    experts = np.repeat(np.arange(num_experts, dtype=np.int64), np.diff(offsets))
    order = np.argsort(token_indices, kind="stable")
    return experts[order].reshape(num_tokens, k)


def plan_recall(plan: dict[int, np.ndarray], exact: dict[int, np.ndarray]) -> float | None:
    """Share of the exact (token, expert) assignments the plan predicted, over all planned MoE layers."""
    hits = total = 0
    for layer, exact_ids in exact.items():
        predicted = plan.get(layer)
        if predicted is None:
            continue
        hits += int((exact_ids[:, :, None] == predicted[:, None, :]).any(axis=-1).sum())
        total += exact_ids.size
    return hits / total if total else None


def warmup_plan(moe_layers: list[int], num_experts: int, top_k: int, num_tokens: int):
    """A plan sending every token to experts 0..top_k-1 (the worker's own warm-up step under routing=lut)."""
    counts = np.zeros(num_experts, dtype=np.int32)
    counts[:top_k] = num_tokens
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tokens = np.tile(np.arange(num_tokens, dtype=np.int32), top_k)
    return {layer: (offsets, tokens) for layer in moe_layers}
