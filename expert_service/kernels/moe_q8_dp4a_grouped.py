"""Small steps (2 to moe_ffn.GROUPED_MAX_TOKENS tokens) of a layer whose experts are int8 with per-channel scales,
on int8 activations: moe_q8_dp4a's arithmetic (module docstring there: per-row int8 rounding, dp4a sums, NaN for
a non-finite row) grouped by expert, as moe_q8's grouped launches, so each expert's weights stream once per
TOK_TILE of its tokens (once for all of them up to TOK_TILE; a mixtral b=16 step routes about 4 an expert). Where
moe_q8 spends a prmt and a subtraction per weight value plus an FMA per value and token, a 16-byte chunk here costs
four dp4a per token: the arithmetic per weight byte stays below the HBM rate up to a few tokens an expert, the
decode batches of few-expert models (mixtral-like: 16 sequences, 4 tokens an expert).

Three launches, graph-capturable, no host reads (order / offsets from expert_grouping):
  quantize: grid (T,): token row t of x [T, D] -> xq [T, D] int8 and x_scale [T] (max|row| / 127);
  gate_up:  grid (E, row blocks): expert e over its grouped positions p in [offsets[e], offsets[e+1]), TOK_TILE a
            pass, input row order[p] // K: h[p, f] as moe_q8_dp4a's, and the largest |h[p]| of the block's rows
            to part_max[p, block];
  down:     grid (E, row blocks): each pass reduces part_max[p, :] per position, quantizes h[p] as it reads it,
            y[p, d] = sh sd[d] (q(h[p]) . down[e, d]).
A partial tile repeats its last position (never written). Experts without positions, or of another encoding,
return at once.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.expert_quant import CODE_INT8, SCALE_CHANNEL
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.moe_q8 import buffer_args, check_layer
from expert_service.kernels.moe_q8_dp4a import (
    CHUNK,
    FLOAT_MAX,
    ROWS_DOWN,
    ROWS_GATED,
    THREADS,
    WARPS,
    block_max,
    gate_up_parts,
    magnitude,
    quantize4,
    row_blocks,
    row_scale,
    weight_rows_fn,
)
from expert_service.kernels.numeric import SIMULATOR, WARP, check_array, silu, warp_sum
from expert_service.kernels.ptx import dp4a, ld_stream_v4, ld_v4

TOK_TILE = 2 if SIMULATOR else 4  # positions a pass: each weight chunk feeds this many dp4a quads
BLOCKS_PER_SM = 3  # launch bounds: token tiles hold 4x the sums and activation words of moe_q8_dp4a's decode


def _quantize_tokens_kernel(x, n_in, xq, x_scale):
    """x [T * D] float32 -> xq [T * D / 4] uint32 (int8 codes), x_scale [T] float32; grid (T,), THREADS."""
    t = cuda.blockIdx.x
    partial = cuda.shared.array(WARPS, np.float32)
    m = np.float32(0.0)
    for j in range(4 * cuda.threadIdx.x, n_in, 4 * THREADS):
        v0, v1, v2, v3 = ld_v4(x, t * n_in + j)
        m = max(m, max(magnitude(v0), magnitude(v1)), max(magnitude(v2), magnitude(v3)))
    s, inv = row_scale(block_max(m, partial))
    for j in range(4 * cuda.threadIdx.x, n_in, 4 * THREADS):
        v0, v1, v2, v3 = ld_v4(x, t * n_in + j)
        xq[(t * n_in + j) // 4] = quantize4(v0, v1, v2, v3, inv)
    if cuda.threadIdx.x == 0:
        x_scale[t] = s


_quantize_tokens = cached_jit(_quantize_tokens_kernel)


@functools.cache
def _kernel(gated: bool):
    """(python kernel, jitted kernel): gate/up (gated) or down."""
    rows = ROWS_GATED if gated else ROWS_DOWN
    nw = 2 * rows if gated else rows
    tokens = TOK_TILE
    weight_rows = weight_rows_fn(gated, rows)

    @cuda.jit(device=True, inline=True)
    def chunk_step(h, xq, src_row, inv, n_in, words, roff, c, end, checked, raw, act, acc):
        """Chunk c of the warp's nw rows against the pass's `tokens` rows into acc [nw, tokens]; checked (a
        constant at each call site): a chunk at or past `end` counts as zeros."""
        ok = not checked or c < end
        for i in range(nw):
            if ok:
                raw[i, 0], raw[i, 1], raw[i, 2], raw[i, 3] = ld_stream_v4(words, roff[i] + c * 4)
            else:
                for w in range(4):
                    raw[i, w] = np.uint32(0)
        for t in range(tokens):
            if not ok:
                for q in range(4):
                    act[t, q] = np.uint32(0)
            elif gated:  # the quantize launch's int8 rows
                act[t, 0], act[t, 1], act[t, 2], act[t, 3] = ld_v4(xq, (src_row[t] * n_in) // 4 + c * 4)
            else:  # h rounded here, as moe_q8_dp4a's down
                for q in range(4):
                    v0, v1, v2, v3 = ld_v4(h, src_row[t] * n_in + c * CHUNK + 4 * q)
                    act[t, q] = quantize4(v0, v1, v2, v3, inv[t])
        for i in range(nw):
            for t in range(tokens):
                s = acc[i, t]
                for q in range(4):
                    s = dp4a(raw[i, q], act[t, q], s)
                acc[i, t] = s

    def kernel(h, xq, x_scale, part_max, order, offsets, words, scales, meta, stride, n_rows, n_in, top_k, out):
        """gate_up: xq [T * D / 4] uint32 and x_scale [T] (the quantize launch's), part_max [n, G] written, h
        unused; down: h [n * F] float32 flat, part_max [n, G] read, xq / x_scale unused. order [n] / offsets [E+1]
        int32 (expert_grouping); words / scales: the layer's expert buffer [E, stride] as flat uint32 / float32;
        meta [E, META_WIDTH] int32; stride: bytes per expert; n_rows / n_in: output rows and input values (F, D for
        gate_up; D, F for down); top_k: K; out [n, n_rows] float32 in grouped order. Grid (E, row blocks)."""
        e = cuda.blockIdx.x
        start, end = offsets[e], offsets[e + 1]
        if start >= end or meta[e, 0] != CODE_INT8 or meta[e, 1] != SCALE_CHANNEL:
            return  # uniform over the block: it leaves before any barrier
        tid = cuda.threadIdx.x
        lane, warp = tid % WARP, tid // WARP
        partial = cuda.shared.array(WARPS, np.float32)
        base = e * stride
        roff = cuda.local.array(nw, np.int64)
        sidx = cuda.local.array(nw, np.int64)
        raw = cuda.local.array((nw, 4), np.uint32)
        act = cuda.local.array((tokens, 4), np.uint32)
        acc = cuda.local.array((nw, tokens), np.int32)
        src_row = cuda.local.array(tokens, np.int64)
        scale = cuda.local.array(tokens, np.float32)
        inv = cuda.local.array(tokens, np.float32)
        row0 = (cuda.blockIdx.y * WARPS + warp) * rows
        weight_rows(meta, e, base, row0, n_rows, n_in, roff, sidx)
        n_chunks = n_in // CHUNK
        full = n_chunks // WARP * WARP
        for p0 in range(start, end, tokens):
            ntok = min(tokens, end - p0)
            for t in range(tokens):
                p = p0 + min(t, ntok - 1)
                if gated:
                    src_row[t] = order[p] // top_k
                    scale[t] = x_scale[src_row[t]]
                else:  # the row's max from the gate/up blocks' parts (every thread of the block joins)
                    src_row[t] = p
                    m = np.float32(0.0)
                    for j in range(tid, part_max.shape[1], THREADS):
                        m = max(m, part_max[p, j])
                    scale[t], inv[t] = row_scale(block_max(m, partial))
                for i in range(nw):
                    acc[i, t] = np.int32(0)
            for c in range(lane, full, WARP):
                chunk_step(h, xq, src_row, inv, n_in, words, roff, c, n_chunks, False, raw, act, acc)
            if full < n_chunks:
                chunk_step(h, xq, src_row, inv, n_in, words, roff, full + lane, n_chunks, True, raw, act, acc)
            for t in range(tokens):
                s = scale[t]
                top = np.float32(0.0)
                for r in range(rows):
                    a = warp_sum(np.float32(acc[r, t])) * s * scales[sidx[r]]
                    if gated:
                        b = warp_sum(np.float32(acc[rows + r, t])) * s * scales[sidx[rows + r]]
                        a = silu(a) * b
                    if not s <= FLOAT_MAX:
                        a = np.float32(np.nan)
                    row = row0 + r
                    if lane == 0 and row < n_rows and t < ntok:
                        out[p0 + t, row] = a
                        top = max(top, magnitude(a))
                if gated:
                    top = block_max(top, partial)
                    if tid == 0 and t < ntok:
                        part_max[p0 + t, cuda.blockIdx.y] = top

    return kernel, cached_jit(kernel, launch_bounds=(THREADS, BLOCKS_PER_SM))


def _grouping(order, offsets, meta, n: int) -> None:
    check_array("offsets", offsets, (meta.shape[0] + 1,), np.int32)
    if order is not None:
        check_array("order", order, (n,), np.int32)


def _launch(gated, h, xq, x_scale, part_max, order, offsets, experts, meta, n_rows, n_in, top_k, out, stream):
    buffer = buffer_args(experts, meta)
    dummy_f, dummy_i = part_max.reshape(part_max.size)[:1], offsets[:1]
    grid = (meta.shape[0], row_blocks(n_rows, gated))
    args = (
        h.reshape(h.size) if h is not None else dummy_f,
        xq.reshape(xq.size).view(np.uint32) if xq is not None else buffer[0][:1],
        x_scale if x_scale is not None else dummy_f,
        part_max,
        order if order is not None else dummy_i,
        offsets,
        *buffer,
        n_rows,
        n_in,
        top_k,
        out,
    )
    _kernel(gated)[1][grid, THREADS, stream](*args)


def launch_dp4a_quantize_tokens(x, xq, x_scale, stream=0) -> None:
    """x [T, D] float32 -> xq [T, D] uint8 (int8 codes) and x_scale [T] float32, one block a row; D % 16 == 0."""
    if x.ndim != 2 or x.shape[1] % CHUNK or x.shape[0] < 1:  # before unpacking: a 1-d x would fail unnamed
        raise ValueError(f"x must be [T >= 1, D] with D a multiple of {CHUNK}, got {list(x.shape)}")
    T, D = x.shape
    check_array("x", x, (T, D), np.float32)
    check_array("xq", xq, (T, D), np.uint8)
    check_array("x_scale", x_scale, (T,), np.float32)
    _quantize_tokens[T, THREADS, stream](x.reshape(x.size), D, xq.reshape(xq.size).view(np.uint32), x_scale)


def launch_dp4a_grouped_gate_up(
    xq, x_scale, order, offsets, top_k: int, experts, meta, F: int, D: int, h, part_max, stream=0
) -> None:
    """xq [T, D] uint8 / x_scale [T] float32 (launch_dp4a_quantize_tokens); order [n] / offsets [E+1] int32
    (expert_grouping, n = T * top_k); experts uint8 [E, stride]; meta [E, META_WIDTH] int32; h [n, F] float32 and
    part_max [n, gate_up_parts(F)] float32 out, in grouped order."""
    check_layer(experts, meta, F, D)
    T = xq.shape[0] if xq.ndim == 2 else 0
    check_array("xq", xq, (T, D), np.uint8)  # first: a flat xq's length is no token count to blame order for
    n = order.shape[0]
    if top_k < 1 or n != T * top_k:
        raise ValueError(f"order length {n} is not T={T} tokens x top_k={top_k} (xq must hold the step's rows only)")
    check_array("x_scale", x_scale, (T,), np.float32)
    _grouping(order, offsets, meta, n)
    check_array("h", h, (n, F), np.float32)
    check_array("part_max", part_max, (n, gate_up_parts(F)), np.float32)
    _launch(True, None, xq, x_scale, part_max, order, offsets, experts, meta, F, D, top_k, h, stream)


def launch_dp4a_grouped_down(h, part_max, offsets, experts, meta, F: int, D: int, y, stream=0) -> None:
    """h [n, F] float32 and part_max [n, gate_up_parts(F)] float32 (the gate/up launch's) -> y [n, D] float32 =
    h[p] @ down[e]^T for the positions p of each expert e, h[p] through int8, in grouped order."""
    check_layer(experts, meta, F, D)
    n = h.shape[0]
    _grouping(None, offsets, meta, n)
    check_array("h", h, (n, F), np.float32)
    check_array("part_max", part_max, (n, gate_up_parts(F)), np.float32)
    check_array("y", y, (n, D), np.float32)
    _launch(False, h, None, None, part_max, None, offsets, experts, meta, D, F, 1, y, stream)


def sm90_signatures():
    """(python function, numba signature, compile options) of the three kernels for the sm_90 compile check."""
    f1, f2, u1, i1, i64 = types.float32[::1], types.float32[:, ::1], types.uint32[::1], types.int32[::1], types.int64
    sig = (f1, u1, f1, f2, i1, i1, u1, f1, types.int32[:, ::1], i64, i64, i64, i64, f2)
    bounds = {"launch_bounds": (THREADS, BLOCKS_PER_SM)}
    return [(_quantize_tokens_kernel, (f1, i64, u1, f1), {})] + [
        (_kernel(gated)[0], sig, bounds) for gated in (True, False)
    ]
