"""Causal GQA attention of a step's new tokens over each sequence's paged KV history."""

from __future__ import annotations

import numpy as np


def write_kv(k_pool: np.ndarray, v_pool: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """k, v [T, Hkv, Hd] into one layer's pool [num_blocks, block_size, Hkv, Hd] at flat slots [T]."""
    block_size = k_pool.shape[1]
    blocks, rows = np.divmod(slot_mapping, block_size)
    k_pool[blocks, rows] = k
    v_pool[blocks, rows] = v


def paged_attention(
    q: np.ndarray,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    seq_starts: np.ndarray,
    context_lens: np.ndarray,
    block_tables: list[np.ndarray],
    positions: np.ndarray,
    scale: float,
    sliding_window: int | None,
) -> np.ndarray:
    """q [T, H, Hd] of the step's tokens (sequence s owns rows seq_starts[s]:seq_starts[s+1]); each
    query attends to its sequence's cached keys at positions <= its own (and > pos - window)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    group = num_heads // num_kv_heads
    out = np.empty_like(q)
    for s in range(len(context_lens)):
        lo, hi, ctx = seq_starts[s], seq_starts[s + 1], int(context_lens[s])
        if hi == lo:
            continue
        table = block_tables[s][: -(-ctx // block_size)]
        keys = k_pool[table].reshape(-1, num_kv_heads, head_dim)[:ctx]  # [C, Hkv, Hd]
        values = v_pool[table].reshape(-1, num_kv_heads, head_dim)[:ctx]
        qs = q[lo:hi].reshape(hi - lo, num_kv_heads, group, head_dim)  # [n, Hkv, G, Hd]
        scores = np.einsum("nkgd,ckd->kgnc", qs, keys) * np.float32(scale)  # [Hkv, G, n, C]
        key_pos = np.arange(ctx)
        q_pos = positions[lo:hi]
        allowed = key_pos[None, :] <= q_pos[:, None]
        if sliding_window:
            allowed &= key_pos[None, :] > q_pos[:, None] - sliding_window
        scores = np.where(allowed[None, None], scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[lo:hi] = np.einsum("kgnc,ckd->nkgd", probs, values).reshape(hi - lo, num_heads, head_dim)
    return out
