"""The routing plan: for every MoE layer, which of a step's tokens each expert gets, in CSR form.

The router builds it from the static routing table (`RoutingTable.routing_plan`) and sends it with the step;
the worker reads it back and uses it as the routing (`--routing lut`) or as a
prediction to prefetch experts and measure recall (`--routing exact`). Token indices count the step's tokens
in the worker's order: prompt chunks first, then one token per decoding sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import InvalidRequestError


@dataclass(frozen=True)
class RoutingPlan:
    """Row l is MoE layer layers[l]; the tokens of expert e there are
    token_indices[l, offsets[l, e]:offsets[l, e+1]], ascending (none when the two offsets are equal)."""

    layers: tuple[int, ...]
    offsets: np.ndarray  # int32 [L, E+1]
    token_indices: np.ndarray  # int32 [L, T*k]

    @classmethod
    def from_expert_ids(cls, layers: Sequence[int], expert_ids: np.ndarray, num_experts: int) -> RoutingPlan:
        """expert_ids [L, T, k] (row l: MoE layer layers[l]; distinct experts per token) -> the plan."""
        L, T, k = expert_ids.shape
        n = T * k
        flat = expert_ids.reshape(L, n)
        # A stable sort of uint16 keys (the routing table's) is numpy's radix sort: O(n) per layer, and it
        # leaves each expert's tokens ascending (the flattening is token-major).
        order = np.argsort(flat, axis=1, kind="stable")  # [L, n]
        keys = flat.astype(np.int32) + (np.arange(L, dtype=np.int32) * num_experts)[:, None]
        counts = np.bincount(keys.ravel(), minlength=L * num_experts).reshape(L, num_experts)
        offsets = np.zeros((L, num_experts + 1), dtype=np.int32)
        np.cumsum(counts, axis=1, out=offsets[:, 1:])
        return cls(tuple(int(layer) for layer in layers), offsets, (order // k).astype(np.int32))

    def csr(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(MoE layer, offsets [E+1], token_indices [T*k]) for each layer of the plan."""
        return zip(self.layers, self.offsets, self.token_indices)

    def keep_rows(self, lengths: Sequence[int], kept: Sequence[bool], num_experts: int) -> RoutingPlan:
        """The plan of the step's rows (as sent: prompt chunks, then decodes; `lengths` tokens each) that are `kept`,
        its token indices renumbered: the router's plan counts the tokens of rows that then fail alone (unknown,
        foreign, draining), which compute nothing. Checked against all the sent tokens, as `expert_ids` checks it."""
        if all(kept):
            return self
        if np.ndim(self.token_indices) != 2 or len(self.token_indices) != len(self.layers):
            raise InvalidRequestError("routing_plan.token_indices", f"needs one row per layer ({len(self.layers)})")
        tokens = np.repeat(np.asarray(kept, bool), np.asarray(lengths, np.int64))
        ids = layers_csr_to_ids(self.offsets, self.token_indices, num_experts, len(tokens))
        return RoutingPlan.from_expert_ids(self.layers, ids[:, tokens], num_experts)

    def keep_chunk_rows(
        self, chunks: Sequence[Any], kept_chunks: Iterable[Any], decodes_kept: Sequence[bool], num_experts: int
    ) -> RoutingPlan:
        """keep_rows for a step sent as `chunks` (each with its token_ids), then one token per decode: the chunks in
        `kept_chunks` (the same objects) and the decodes `decodes_kept` says run."""
        kept = {id(chunk) for chunk in kept_chunks}
        return self.keep_rows(
            [len(chunk.token_ids) for chunk in chunks] + [1] * len(decodes_kept),
            [id(chunk) in kept for chunk in chunks] + list(decodes_kept),
            num_experts,
        )

    def expert_ids(
        self, num_experts: int, num_tokens: int, top_k: int | None = None, moe_layers: Sequence[int] | None = None
    ) -> dict[int, np.ndarray]:
        """{MoE layer: expert ids [T, k]}, checked against the step's `num_tokens`, the model's `top_k` and its
        `moe_layers` (see `csr_to_ids`; every layer at once: this runs on the worker's host for every planned step)."""
        if moe_layers is not None and list(self.layers) != list(moe_layers):
            # a layer the plan misses would take the exact routing under routing=lut, silently
            raise InvalidRequestError("routing_plan.layers", f"must be the MoE layers {list(moe_layers)}")
        if np.ndim(self.token_indices) != 2 or len(self.token_indices) != len(self.layers):
            raise InvalidRequestError("routing_plan.token_indices", f"needs one row per layer ({len(self.layers)})")
        ids = layers_csr_to_ids(self.offsets, self.token_indices, num_experts, num_tokens, top_k)
        return dict(zip(self.layers, ids))


def csr_to_ids(
    offsets: np.ndarray, token_indices: np.ndarray, num_experts: int, num_tokens: int, top_k: int | None = None
) -> np.ndarray:
    """CSR (tokens of expert e = token_indices[offsets[e]:offsets[e+1]]) -> expert ids [T, k], each token's
    experts in ascending expert order. With `top_k`, every token needs exactly that many distinct experts."""
    return layers_csr_to_ids(offsets[None], token_indices[None], num_experts, num_tokens, top_k)[0]


def layers_csr_to_ids(
    offsets: np.ndarray, token_indices: np.ndarray, num_experts: int, num_tokens: int, top_k: int | None = None
) -> np.ndarray:
    """`csr_to_ids` of L layers at once: offsets [L, E+1], token_indices [L, n] -> expert ids [L, T, k]."""
    L, n = token_indices.shape
    if L == 0:
        return np.zeros((0, num_tokens, n // max(num_tokens, 1)), np.int64)
    if (
        offsets.shape != (L, num_experts + 1)
        or not np.issubdtype(offsets.dtype, np.integer)
        # in range first: a difference of out-of-range int32 offsets can wrap around and pass as non-negative
        or np.any(offsets < 0)
        or np.any(offsets > n)
        or np.any(offsets[:, 0] != 0)
        or np.any(np.diff(offsets, axis=1) < 0)
        or np.any(offsets[:, -1] != n)
    ):
        raise InvalidRequestError("routing_plan.offsets", f"must be [{num_experts + 1}] non-decreasing from 0 to {n}")
    if n % max(num_tokens, 1) or (n and (token_indices.min() < 0 or token_indices.max() >= num_tokens)):
        raise InvalidRequestError(
            "routing_plan.token_indices", f"must index the step's {num_tokens} tokens, the same number of times each"
        )
    k = n // max(num_tokens, 1)
    keys = token_indices.astype(np.int64) + (np.arange(L, dtype=np.int64) * num_tokens)[:, None]
    per_token = np.bincount(keys.ravel(), minlength=L * num_tokens)
    if np.any(per_token != k) or (top_k is not None and num_tokens and k != top_k):
        raise InvalidRequestError("routing_plan.token_indices", f"every token needs {top_k or k} experts")
    experts = np.repeat(np.tile(np.arange(num_experts, dtype=np.int64), L), np.diff(offsets, axis=1).ravel())
    order = np.argsort(token_indices, axis=1, kind="stable")
    ids = np.take_along_axis(experts.reshape(L, n), order, axis=1).reshape(L, num_tokens, k)
    if k > 1 and np.any(ids[:, :, 1:] == ids[:, :, :-1]):  # ascending per token: a repeat sits next to itself
        raise InvalidRequestError("routing_plan.token_indices", "a token is routed to the same expert twice")
    return ids
