"""Router in one launch for decode: logits = x @ Wr^T (gate GEMV over the E router rows), softmax, top-k and the
optional renormalisation; the same results as `gemv` + `gate_topk` (reference:
``expert_service.cpu.layers.moe.route(x @ Wr.T, K, normalize)``), including gate_topk's handling of
non-finite rows (valid distinct ids 0..K-1 with NaN weights, so expert kernels never index out of range).

Grid (G, T): G blocks of THREADS threads for each of the T tokens (one launch; graph-capturable):
- GEMV: block (g, t) computes ROWS = WARPS / SPLIT router rows of token t, SPLIT warps per row, lanes striding
  along D in 16-byte chunks of bf16 weights (`ptx.ld_stream_v4`, x via `ld_v4`, UNROLL chunks in flight) when
  D % 8 == 0, else one element at a time (fp16 / fp32 / odd D). SPLIT grows with D and for small E so that
  G = ceil(E / ROWS) blocks spread the matrix over many SMs (one SM streams only a few tens of GB/s, so a
  single block per token is latency-bound; docs/kernels.md has the figure). Partial sums meet in shared memory
  (fixed order: deterministic); the logits go to `logits` [T, E] (global).
- Selection: each block fences its logits and takes a ticket on counter[t]; the last of the G blocks resets
  the counter to 0 (the buffer must be zero before the first launch; it is again after every launch) and runs
  the softmax and K rounds of a (probability, lowest index) arg-max (warp shuffles; every warp computes the
  same, thread 0 keeps each round's pick in shared memory and K lanes write the weights at the end). Fences:
  every writer and every thread of the last block runs `cuda.threadfence()` (`fence.sc.gpu`: each writer / reader
  pair ordered in the fence-SC order). Two `fence.acq_rel.gpu` a block, run by the ticket's thread only, measured
  the same on the H200 (docs/kernels.md).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types
from numba.np import numpy_support

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import SIMULATOR, WARP, u32_as_f32, warp_max, warp_sum, widener
from expert_service.kernels.ptx import ld_stream_v4

THREADS = 64 if SIMULATOR else 256
WARPS = THREADS // WARP
MAX_E = 256
PER_LANE = MAX_E // WARP
MAX_K = 8
MAX_TOKENS = 65535  # tokens a launch: the grid's y dimension
UNROLL = 2 if SIMULATOR else 8      # 16-byte chunks per lane in flight per row (D = 2048 bf16: one round trip)
MIN_WARPS = 2 if SIMULATOR else 64  # warps streaming the router matrix of one token, at least
_RETIRED = np.float32(-2.0)
_DTYPES = (np.uint16, np.float16, np.float32)


def split_for(n_exp: int, dim: int, wide: bool) -> int:
    """Warps per router row (a power of two <= WARPS): about UNROLL chunks per lane, and at least MIN_WARPS warps
    over the E rows of a token."""
    chunks = dim // 8 if wide else dim // 2
    split = 1
    while split < WARPS and (chunks > split * WARP * UNROLL or n_exp * split < MIN_WARPS):
        split *= 2
    return split


def blocks_per_token(n_exp: int, split: int) -> int:
    return -(-n_exp // (WARPS // split))


@functools.cache
def _build(dtype, wide: bool, mode: int = 0):
    """mode: the programmatic-launch variant (kernels/programmatic.py)."""
    widen = widener(dtype)
    prologue = programmatic.prologue(mode)
    ld_x = programmatic.activation_load(mode)

    if wide:
        @cuda.jit(device=True, inline=True)
        def row_dot(x, xbase, dim, w, row, lo, hi, lane):
            """Sum over the 8-value chunks c in [lo, hi) of row `row` (uint32 view: 4 words per chunk) times
            x[xbase + 8c ...] (flat f32)."""
            acc = np.float32(0.0)
            base = np.int64(row) * (dim // 2)       # uint32 words per weight row: D / 2
            ws = cuda.local.array((UNROLL, 4), np.uint32)
            for c0 in range(lo + lane, hi, WARP * UNROLL):
                for u in range(UNROLL):
                    c = c0 + u * WARP
                    if c < hi:
                        ws[u, 0], ws[u, 1], ws[u, 2], ws[u, 3] = ld_stream_v4(w, base + 4 * c)
                for u in range(UNROLL):
                    c = c0 + u * WARP
                    if c < hi:
                        for q in range(2):
                            x0, x1, x2, x3 = ld_x(x, xbase + 8 * c + 4 * q)
                            v0 = ws[u, 2 * q]
                            v1 = ws[u, 2 * q + 1]
                            acc += (u32_as_f32(v0 << np.uint32(16)) * x0
                                    + u32_as_f32(v0 & np.uint32(0xFFFF0000)) * x1
                                    + u32_as_f32(v1 << np.uint32(16)) * x2
                                    + u32_as_f32(v1 & np.uint32(0xFFFF0000)) * x3)
            return acc
    else:
        @cuda.jit(device=True, inline=True)
        def row_dot(x, xbase, dim, w, row, lo, hi, lane):
            """Sum over the elements [lo, hi) of row `row` of W [E * D] (any dtype), one per lane per step."""
            acc = np.float32(0.0)
            base = np.int64(row) * dim
            for c in range(lo + lane, hi, WARP):
                acc += widen(w[base + c]) * x[xbase + c]
            return acc

    def gate_fused_kernel(x, dim, w, n_exp, split_shift, ids, weights, normalize, counter, logits):
        """x [T * D] f32 (rows flattened), dim: D; w: router rows [E * D] flattened (uint32 view when wide,
        else the storage dtype); n_exp: E; split_shift: log2 of the warps per row; ids [T, K] int32, weights
        [T, K] f32; normalize: int32 0/1; counter [>= T] int32 (zero on entry, zero again on exit); logits [T, E]
        f32 (written). Grid (G, T) with G = blocks_per_token(E, split), block (THREADS,)."""
        prologue()
        # the grid's two dimensions and the power-of-two split: no 64-bit division before the first load
        split = np.int32(1) << split_shift
        rows_per_block = np.int32(WARPS) >> split_shift
        n_blocks = cuda.gridDim.x
        t = cuda.blockIdx.y
        blk = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        top_k = ids.shape[1]
        parts = cuda.shared.array((WARPS, 1), np.float32)
        last = cuda.shared.array(1, np.int32)
        n_units = dim // 8 if wide else dim        # chunks (wide) or elements per row
        per_part = (n_units + split - 1) >> split_shift
        part = warp & (split - 1)
        lo = min(part * per_part, n_units)
        hi = min(lo + per_part, n_units)
        row = blk * rows_per_block + (warp >> split_shift)
        s = warp_sum(row_dot(x, np.int64(t) * dim, dim, w, row, lo, hi, lane) if row < n_exp
                     else np.float32(0.0))
        if lane == 0:
            parts[warp, 0] = s
        cuda.syncthreads()
        if tid < rows_per_block:
            r = blk * rows_per_block + tid
            if r < n_exp:
                v = parts[tid * split, 0]
                for p in range(1, split):
                    v += parts[tid * split + p, 0]
                logits[t, r] = v
            cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            ticket = cuda.atomic.add(counter, t, 1)
            last[0] = 1 if ticket == n_blocks - 1 else 0
            if ticket == n_blocks - 1:
                counter[t] = 0
        cuda.syncthreads()
        if last[0] == 0:
            return
        cuda.threadfence()

        probs = cuda.local.array(PER_LANE, np.float32)
        m = np.float32(-math.inf)
        for i in range(PER_LANE):
            e = lane + i * WARP
            v = logits[t, e] if e < n_exp else np.float32(-math.inf)
            probs[i] = v
            m = max(m, v)
        m = warp_max(m)
        total = np.float32(0.0)
        for i in range(PER_LANE):
            p = math.exp(probs[i] - m) if lane + i * WARP < n_exp else np.float32(0.0)
            probs[i] = p
            total += p
        total = warp_sum(total)
        for i in range(PER_LANE):
            probs[i] = probs[i] / total if lane + i * WARP < n_exp else np.float32(-1.0)
        picked = cuda.shared.array(MAX_K, np.float32)
        chosen = np.float32(0.0)
        for k in range(top_k):
            best = np.float32(-1.5)
            best_idx = MAX_E
            for i in range(PER_LANE):             # ascending index within the lane: strict > keeps the lower one
                if probs[i] > best:
                    best = probs[i]
                    best_idx = lane + i * WARP
            top = warp_max(best)
            # lowest index among the lanes holding the maximum (indices < 256 are exact in float32)
            cand = np.float32(best_idx) if best == top else np.float32(MAX_E)
            winner = np.int32(-warp_max(-cand))
            if winner >= n_exp:                   # non-finite row: NaN probabilities never compare
                winner = np.int32(k)
                top = np.float32(math.nan)
            for i in range(PER_LANE):
                if lane + i * WARP == winner:
                    probs[i] = _RETIRED
            chosen += top
            if tid == 0:
                ids[t, k] = winner
                picked[k] = top
        # the weights from shared memory, one lane each: no read-back of global stores on the critical path
        cuda.syncthreads()  # every thread of the last block runs the rounds
        if tid < top_k:
            weights[t, tid] = picked[tid] / chosen if normalize != 0 else picked[tid]

    return gate_fused_kernel, programmatic.compiled(gate_fused_kernel, mode)


def _wide(weight, D):
    return np.dtype(weight.dtype) == np.uint16 and D % 8 == 0


def launch_gate_fused(x, weight, ids, weights, normalize: bool, logits, counter, stream=0) -> None:
    """x [T, D] f32; weight [E, D] uint16 (bf16) / float16 / float32; ids [T, K] int32, weights [T, K] f32
    (written); logits [T, E] f32 (written: the router logits); counter [>= T] int32, zero before the first
    launch (a workspace buffer zeroed once: every launch leaves it zero)."""
    n_tok, D = x.shape
    n_exp = weight.shape[0]
    top_k = ids.shape[1]
    if not 1 <= n_exp <= MAX_E or not 1 <= top_k <= min(MAX_K, n_exp):
        raise ValueError(f"gate_fused supports E <= {MAX_E} and 1 <= K <= min({MAX_K}, E), got E={n_exp} K={top_k}")
    if weight.shape != (n_exp, D) or np.dtype(weight.dtype) not in [np.dtype(d) for d in _DTYPES]:
        raise ValueError(f"weight must be [E, {D}] uint16/float16/float32, got {weight.dtype} {weight.shape}")
    if ids.shape != (n_tok, top_k) or weights.shape != (n_tok, top_k) or logits.shape != (n_tok, n_exp):
        raise ValueError(f"ids/weights must be [{n_tok}, {top_k}] and logits [{n_tok}, {n_exp}], got {ids.shape}, "
                         f"{weights.shape} and {logits.shape}")
    if counter.ndim != 1 or counter.shape[0] < n_tok:
        raise ValueError(f"counter must be int32 [>= {n_tok}], got {counter.shape}")
    for name, a, dt in (("x", x, np.float32), ("ids", ids, np.int32), ("weights", weights, np.float32),
                        ("weight", weight, weight.dtype), ("logits", logits, np.float32),
                        ("counter", counter, np.int32)):
        if a.dtype != dt or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous {np.dtype(dt).name}, got {a.dtype}")
    if n_tok > MAX_TOKENS:
        raise ValueError(f"gate_fused takes at most {MAX_TOKENS} tokens a launch (the grid's y dimension), got {n_tok}")
    if n_tok == 0:
        return
    wide = _wide(weight, D)
    split = split_for(n_exp, D, wide)
    flat = weight.reshape(weight.size)
    kernel = _build(np.dtype(weight.dtype).type, wide, programmatic.mode())[1]
    kernel[(blocks_per_token(n_exp, split), n_tok), THREADS, stream](
        x.reshape(n_tok * D), np.int64(D), flat.view(np.uint32) if wide else flat, np.int32(n_exp),
        np.int32(split.bit_length() - 1),
        ids, weights, np.int32(1 if normalize else 0), counter, logits)


def sm90_signatures():
    """(python function, numba signature) of each weight dtype (bf16 wide and narrow), for the sm_90 check."""
    f2, i32 = types.float32[:, ::1], types.int32

    def signature(wt):
        return (types.float32[::1], types.int64, wt, i32, i32, types.int32[:, ::1], f2, i32, types.int32[::1], f2)

    out = []
    for dtype in _DTYPES:
        for wide in ((True, False) if dtype is np.uint16 else (False,)):
            wt = types.uint32[::1] if wide else types.Array(numpy_support.from_dtype(np.dtype(dtype)), 1, "C")
            out.append((_build(dtype, wide)[0], signature(wt)))
    out.append((_build(np.uint16, True, programmatic.WAIT)[0], signature(types.uint32[::1])))
    return out
