"""Router softmax + top-k (+ optional renormalisation) on the device; reference: ``expert_service.cpu.layers.moe.route``.

One warp per token (block = 32 threads, grid = T). Each lane holds up to MAX_E / 32 logits in registers, so any
E <= 256 works (E = 8, 60, 128, ...). Selection repeats K times: every lane posts its best candidate to shared
memory and all lanes pick the largest probability, ties to the lower expert index (like the stable argsort of
the reference); the owner lane retires it. (A shared-memory scan of 32 posts costs about what two shuffle
reductions would, and takes one barrier instead of four in the simulator.)
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import WARP, warp_max, warp_sum

MAX_E = 256                 # experts per token row a lane set can hold
PER_LANE = MAX_E // WARP    # logits held by each lane (registers: indices are compile-time after unrolling)
MAX_K = 8
_RETIRED = np.float32(-2.0)   # below every probability and below the -1 of padding slots


@cached_jit
def _gate_topk_kernel(logits, ids, weights, normalize):
    """logits [T, E] f32 -> ids [T, K] int32 (descending probability), weights [T, K] f32; normalize: int32 0/1."""
    t = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    n_exp = logits.shape[1]
    top_k = ids.shape[1]
    probs = cuda.local.array(PER_LANE, np.float32)
    m = np.float32(-math.inf)
    for i in range(PER_LANE):
        e = lane + i * WARP
        v = logits[t, e] if e < n_exp else np.float32(-math.inf)
        probs[i] = v
        m = max(m, v)
    m = warp_max(m)
    s = np.float32(0.0)
    for i in range(PER_LANE):
        p = math.exp(probs[i] - m) if lane + i * WARP < n_exp else np.float32(0.0)
        probs[i] = p
        s += p
    s = warp_sum(s)
    for i in range(PER_LANE):
        # padding slots get -1 so they can never win (K <= E is checked by the launcher)
        probs[i] = probs[i] / s if lane + i * WARP < n_exp else np.float32(-1.0)

    # Arg-max per round through shared memory (one barrier per round, double-buffered by round parity):
    # each lane posts its best (probability, index); every lane scans the 32 posts, ties to the lower index.
    post_p = cuda.shared.array((2, WARP), np.float32)
    post_i = cuda.shared.array((2, WARP), np.int32)
    total = np.float32(0.0)
    mine = np.float32(0.0)  # lane k keeps round k's probability: the weights are written once, never read back
    for k in range(top_k):
        best = np.float32(-1.5)
        best_idx = MAX_E
        for i in range(PER_LANE):      # ascending index within the lane, strict > keeps the lower one
            if probs[i] > best:
                best = probs[i]
                best_idx = lane + i * WARP
        buf = k % 2
        post_p[buf, lane] = best
        post_i[buf, lane] = best_idx
        cuda.syncthreads()
        top = post_p[buf, 0]
        winner = post_i[buf, 0]
        for j in range(1, WARP):
            pj = post_p[buf, j]
            ij = post_i[buf, j]
            if pj > top or (pj == top and ij < winner):
                top = pj
                winner = ij
        if winner >= n_exp:
            # a non-finite row (NaN/inf logits): every comparison fails and padding slots win. Still hand out
            # valid distinct ids (the expert kernels index weights with them) with NaN weights
            winner = k
            top = np.float32(math.nan)
        for i in range(PER_LANE):
            if lane + i * WARP == winner:
                probs[i] = _RETIRED
        total += top
        if lane == k:
            ids[t, k] = winner
            mine = top
    if lane < top_k:
        weights[t, lane] = mine / total if normalize != 0 else mine


def launch_gate_topk(logits, ids, weights, normalize: bool, stream=0) -> None:
    """logits [T, E] f32 (device), ids [T, K] int32 and weights [T, K] f32 (device, written)."""
    n_tok, n_exp = logits.shape
    top_k = ids.shape[1]
    if not 1 <= n_exp <= MAX_E or not 1 <= top_k <= min(MAX_K, n_exp):
        raise ValueError(f"gate_topk supports E <= {MAX_E} and 1 <= K <= min({MAX_K}, E), got E={n_exp} K={top_k}")
    if ids.shape != (n_tok, top_k) or weights.shape != (n_tok, top_k):
        raise ValueError(f"ids/weights must be [{n_tok}, {top_k}], got {ids.shape} and {weights.shape}")
    for name, a, dt in (("logits", logits, np.float32), ("ids", ids, np.int32), ("weights", weights, np.float32)):
        if a.dtype != dt or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous {np.dtype(dt).name}, got {a.dtype}")
    if n_tok:
        _gate_topk_kernel[n_tok, WARP, stream](logits, ids, weights, np.int32(1 if normalize else 0))


def sm90_signatures():
    """(python function, numba signature) of every kernel variant, for the sm_90 compile check."""
    return [(_gate_topk_kernel.py_func,
             (types.float32[:, ::1], types.int32[:, ::1], types.float32[:, ::1], types.int32))]
