"""The routing plan: for every MoE layer, which of a step's tokens each expert gets, in CSR form.

The router builds it from the static routing table (`RoutingTable.routing_plan`) and sends it with the step;
the worker reads it back and uses it as the routing (`--routing lut`) or as a
prediction to prefetch experts and measure recall (`--routing exact`). Token indices count the step's tokens
in the worker's order: prompt chunks first, then one token per decoding sequence.

A prediction may name fewer experts for some tokens than for others (a table's NO_EXPERT entries,
common/routing_table.py): each row keeps the width T*k of k predictions a token, its real entries
token_indices[l, :offsets[l, E]] and padding (-1) after them. A routing (`--routing lut`) has none: every token
names exactly the model's top-k.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import InvalidRequestError

NO_EXPERT = 0xFFFF  # a routing table entry that predicts nothing (defined here: common/routing_table.py imports this)


@dataclass(frozen=True)
class RoutingPlan:
    """Row l is MoE layer layers[l]; the tokens of expert e there are
    token_indices[l, offsets[l, e]:offsets[l, e+1]], ascending (none when the two offsets are equal); entries past
    offsets[l, E] are padding (module docstring)."""

    layers: tuple[int, ...]
    offsets: np.ndarray  # int32 [L, E+1]
    token_indices: np.ndarray  # int32 [L, T*k]

    @classmethod
    def from_expert_ids(cls, layers: Sequence[int], expert_ids: np.ndarray, num_experts: int) -> RoutingPlan:
        """expert_ids [L, T, k] (row l: MoE layer layers[l]; distinct experts per token; NO_EXPERT, or < 0 in the
        worker's int ids, predicts nothing) -> the plan."""
        L, T, k = expert_ids.shape
        n = T * k
        flat = expert_ids.reshape(L, n)
        if flat.dtype != np.uint16:  # the worker's ids (-1: nothing): as the table's, none sorting last
            flat = np.where(flat < 0, NO_EXPERT, flat).astype(np.uint16)
        # A stable sort of uint16 keys (the routing table's) is numpy's radix sort: O(n) per layer, and it
        # leaves each expert's tokens ascending (the flattening is token-major); NO_EXPERT entries sort last.
        order = np.argsort(flat, axis=1, kind="stable")  # [L, n]
        width = num_experts + 1  # bucket num_experts: the entries that predict nothing, counted to be left out
        keys = np.minimum(flat, num_experts).astype(np.int32) + (np.arange(L, dtype=np.int32) * width)[:, None]
        counts = np.bincount(keys.ravel(), minlength=L * width).reshape(L, width)[:, :num_experts]
        offsets = np.zeros((L, num_experts + 1), dtype=np.int32)
        np.cumsum(counts, axis=1, out=offsets[:, 1:])
        token_indices = (order // k).astype(np.int32)
        if L and int(offsets[:, -1].min()) < n:  # padding after each row's predictions
            token_indices[np.arange(n)[None, :] >= offsets[:, -1:]] = -1
        return cls(tuple(int(layer) for layer in layers), offsets, token_indices)

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
    experts in ascending expert order, -1 after them where a prediction names fewer than k (k: the row's width
    over num_tokens). With `top_k` (a routing), every token needs exactly that many distinct experts."""
    return layers_csr_to_ids(offsets[None], token_indices[None], num_experts, num_tokens, top_k)[0]


def layers_csr_to_ids(
    offsets: np.ndarray, token_indices: np.ndarray, num_experts: int, num_tokens: int, top_k: int | None = None
) -> np.ndarray:
    """`csr_to_ids` of L layers at once: offsets [L, E+1], token_indices [L, n] -> expert ids [L, T, k]."""
    L, n = token_indices.shape
    T = num_tokens
    if L == 0:
        return np.zeros((0, T, n // max(T, 1)), np.int64)
    if (
        offsets.shape != (L, num_experts + 1)
        or not np.issubdtype(offsets.dtype, np.integer)
        # in range first: a difference of out-of-range int32 offsets can wrap around and pass as non-negative
        or np.any(offsets < 0)
        or np.any(offsets > n)
        or np.any(offsets[:, 0] != 0)
        or np.any(np.diff(offsets, axis=1) < 0)
    ):
        raise InvalidRequestError(
            "routing_plan.offsets", f"must be [{num_experts + 1}] non-decreasing from 0 to at most {n}"
        )
    listed = offsets[:, -1].astype(np.int64)  # each row's real entries; padding after them
    full = bool(np.all(listed == n))  # no padding (every plan of a complete table): the plain inverse, faster
    real = token_indices if full else token_indices[np.arange(n)[None, :] < listed[:, None]]  # row-major
    if n % max(T, 1) or (n and not T) or (real.size and (real.min() < 0 or real.max() >= T)):
        raise InvalidRequestError(
            "routing_plan.token_indices", f"must index the step's {T} tokens, at most the same number of times each"
        )
    k = n // max(T, 1)
    keys = real.astype(np.int64) + np.repeat(np.arange(L, dtype=np.int64) * T, listed).reshape(real.shape)
    per_token = np.bincount(keys.ravel(), minlength=L * T)
    # a routing (top_k) names exactly k experts a token: then every row is full, no padding
    if np.any(per_token > k) or (top_k is not None and (np.any(per_token != k) or (T and k != top_k))):
        raise InvalidRequestError("routing_plan.token_indices", f"every token needs {top_k or k} experts")
    experts = np.repeat(np.tile(np.arange(num_experts, dtype=np.int64), L), np.diff(offsets, axis=1).ravel())
    if full:  # every token k times (the sum is L*T*k and none has more): sort each row by token
        order = np.argsort(token_indices, axis=1, kind="stable")
        ids = np.take_along_axis(experts.reshape(L, n), order, axis=1).reshape(L, T, k)
    else:
        order = np.argsort(keys, kind="stable")  # by (layer, token); a token's experts stay ascending (CSR order)
        by_token = keys[order]
        rank = np.arange(keys.size) - (np.cumsum(per_token) - per_token)[by_token]  # the entry's place in its token
        ids = np.full((L * T, k), -1, np.int64)
        ids[by_token, rank] = experts[order]
        ids = ids.reshape(L, T, k)
    if k > 1 and np.any((ids[:, :, 1:] == ids[:, :, :-1]) & (ids[:, :, 1:] >= 0)):  # a repeat sits next to itself
        raise InvalidRequestError("routing_plan.token_indices", "a token is routed to the same expert twice")
    return ids
