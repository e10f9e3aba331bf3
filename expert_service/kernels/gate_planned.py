"""Routing from a given plan (`--routing lut`): each token's experts come from the router's static table, their
combine weights are the softmax of the gate logits of just those experts (numpy reference:
``expert_service.cpu.layers.moe.route_planned`` on ``x @ router.T``).

    logit[t, k] = x[t] . router[planned[t, k]]            (float32 accumulation, x in float32)
    weights[t, k] = exp(logit[t, k] - max_j logit[t, j]) / sum_j exp(logit[t, j] - max_j logit[t, j])
    ids[t, k] = planned[t, k]                              (the step's trace reads the layer's ids from here)

Only the K planned router rows are read (not all E, as the exact router does), so the gate GEMM and the top-k
selection collapse into one small launch: grid T, block K warps; warp k streams x[t] and router row
planned[t, k] (coalesced along D), reduces with shuffles and posts its logit to shared memory; after one barrier
the first K threads each compute the softmax over the K posts. A non-finite logit makes the token's weights NaN
(as the reference: NaN or inf - inf in the exponent), so the step reports non-finite logits.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import WARP, warp_sum, widener

MAX_K = 32    # one warp per planned expert, a block of at most 1024 threads


@functools.cache
def _build(weight_dtype):
    widen = widener(weight_dtype)

    def gate_planned_kernel(x, router, planned, ids, weights):
        """x: [T, D] float32. router: [E, D] W. planned: [T, K] int32 (each < E, distinct per token).
        ids: [T, K] int32 (a copy of planned). weights: [T, K] float32. Grid (T,), block (32 * K,)."""
        t = cuda.blockIdx.x
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        top_k = planned.shape[1]
        logits = cuda.shared.array(MAX_K, np.float32)
        e = planned[t, warp]
        acc = np.float32(0.0)
        for d in range(lane, x.shape[1], WARP):
            acc += x[t, d] * widen(router[e, d])
        acc = warp_sum(acc)
        if lane == 0:
            logits[warp] = acc
        cuda.syncthreads()
        k = cuda.threadIdx.x
        if k < top_k:
            m = logits[0]
            for j in range(1, top_k):
                if logits[j] > m:         # NaN never wins: its own exp(NaN) poisons the sum below
                    m = logits[j]
            s = np.float32(0.0)
            for j in range(top_k):
                s += math.exp(logits[j] - m)
            weights[t, k] = math.exp(logits[k] - m) / s
            ids[t, k] = planned[t, k]

    return gate_planned_kernel, cached_jit(gate_planned_kernel)


def launch_gate_planned(x, router, planned, ids, weights, stream=0) -> None:
    """x: [T, D] float32 (the layer's normed input); router: [E, D] float32/float16/uint16 (bfloat16 bits);
    planned: [T, K] int32 (the plan's experts of each token: < E, distinct; K <= 32); ids: [T, K] int32,
    written with planned; weights: [T, K] float32, written with the softmax over each token's planned logits."""
    num_tokens, width = x.shape
    top_k = planned.shape[1] if planned.ndim == 2 else 0
    assert router.ndim == 2 and router.shape[1] == width, (x.shape, router.shape)
    assert planned.shape == ids.shape == weights.shape == (num_tokens, top_k), (planned.shape, ids.shape)
    assert 0 < top_k <= min(MAX_K, router.shape[0]), (top_k, router.shape)
    assert x.dtype == weights.dtype == np.float32 and planned.dtype == ids.dtype == np.int32
    assert router.dtype in (np.float32, np.float16, np.uint16), router.dtype
    for a in (x, router, planned, ids, weights):
        assert a.flags["C_CONTIGUOUS"], "gate_planned needs contiguous arrays"
    if num_tokens == 0:
        return
    _build(np.dtype(router.dtype))[1][num_tokens, WARP * top_k, stream](x, router, planned, ids, weights)


def sm90_signatures():
    """(python function, numba signature) of each router dtype, for the sm_90 compile check."""
    f2, i2 = types.float32[:, ::1], types.int32[:, ::1]
    return [(_build(np.dtype(dt))[0], (f2, nb[:, ::1], i2, i2, f2))
            for dt, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16))]
