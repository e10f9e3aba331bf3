"""Batch-level expert grouping, as pure host-side logic: every active expert runs once per step over all of
its tokens. A counting sort over the flat (token, slot) assignments gives per-expert offsets and the permutation;
the same arrays become CSR routing plans and the CUDA kernels' work lists.

Shapes: T tokens, K experts per token, E experts. ``expert_ids`` [T, K] int.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    offsets: np.ndarray  # [E + 1] int64: assignments of expert e are order[offsets[e]:offsets[e+1]]
    order: np.ndarray  # [T*K] int64: flat assignment indices (t * K + k), grouped by expert, stable
    top_k: int

    @property
    def token_indices(self) -> np.ndarray:
        """[T*K] token of each grouped assignment (CSR column indices of the routing plan)."""
        return self.order // self.top_k

    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    def active_experts(self) -> np.ndarray:
        return np.flatnonzero(self.counts())

    def tokens_of(self, expert: int) -> np.ndarray:
        return self.token_indices[self.offsets[expert] : self.offsets[expert + 1]]


def group_by_expert(expert_ids: np.ndarray, num_experts: int) -> ExpertGroups:
    """Counting sort of [T, K] expert ids: offsets from a histogram, order stable within each expert."""
    flat = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts}), got {flat.min()}..{flat.max()}")
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.zeros(num_experts + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    order = np.argsort(flat, kind="stable")
    top_k = expert_ids.shape[1] if np.ndim(expert_ids) == 2 else 1
    return ExpertGroups(offsets, order.astype(np.int64), top_k)


def ungroup(grouped: np.ndarray, groups: ExpertGroups) -> np.ndarray:
    """Inverse permutation: rows in grouped order [T*K, ...] -> rows in assignment order [T*K, ...]."""
    out = np.empty_like(grouped)
    out[groups.order] = grouped
    return out


def combine(grouped_outputs: np.ndarray, groups: ExpertGroups, weights: np.ndarray) -> np.ndarray:
    """Weighted sum over each token's K experts: grouped [T*K, D] + weights [T, K] -> [T, D]."""
    per_slot = ungroup(grouped_outputs, groups).reshape(weights.shape[0], weights.shape[1], -1)
    return np.einsum("tkd,tk->td", per_slot, weights.astype(per_slot.dtype))


def experts_by_count(ids: np.ndarray) -> list[int]:
    """Distinct expert ids, most tokens first (what a prefetch with little room should bring first); a negative
    id (-1: a plan's "no prediction", as the device's hints write it) names no expert and is left out."""
    flat = np.asarray(ids).reshape(-1)
    experts, counts = np.unique(flat[flat >= 0], return_counts=True)
    return [int(e) for e in experts[np.argsort(-counts, kind="stable")]]
