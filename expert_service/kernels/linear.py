"""Decode-regime linear layers (T <= 64 tokens, memory-bound): y [T, N] = x [T, K] @ W[N, K]^T (+ bias),
optionally accumulated into y (fused residual add of o_proj/down_proj), and the fused SwiGLU
h [T, F] = silu(x @ Wg^T) * (x @ Wu^T). Numpy references: ``x @ W.T (+ b)``, layers.moe.swiglu_mlp.

Design (each weight byte read from HBM once, coalesced, wide):
- One warp owns a pair of weight rows (linear: rows 2p, 2p+1; swiglu: gate row p and up row p, so the
  epilogue has both halves in registers). Lanes stride over the K dimension in 8-byte words (the weight
  array viewed as uint64: 4 bf16/f16 or 2 f32 values per load; 4.24 TB/s measured for uint64 views on the
  H200), UNROLL words per row in flight before any FMA -> 2*UNROLL*8 bytes per lane outstanding.
- x is staged per block in shared memory in TILE_WORDS-word K tiles, for TOKEN_TILE tokens, in a
  word-interleaved layout xs[t, j, word] so lanes reading consecutive words hit consecutive banks. Each weight
  value is reused for all TOKEN_TILE tokens and each x value for both rows of the pair (fp32 FMAs).
- Accumulators 2*TOKEN_TILE floats per lane, reduced by warp shuffles at the end; lane 0 writes.
- Grid (ceil(T / TOKEN_TILE), ceil(pairs / warps)): the token tiles of the same rows are adjacent in launch
  order, so for T > TOKEN_TILE the weight rows are re-read from L2, not HBM. TOKEN_TILE is 1 for T == 1
  (no wasted FMAs/shared reads at batch 1), else 8.
- Vector path needs K % 4 == 0 (16-bit) or K % 2 == 0 (f32) and 8-byte-aligned weight rows; otherwise
  (odd K, ...) the same kernel is built with 1 element per "word" (scalar 2-byte loads, correct, slower).
Not done (left for measurement): 16-byte inline-PTX loads (+3%), split-K for tiny N (router, N <= 128),
tensor cores for T > 16 (the fp32-FMA path is compute-bound there; cuBLAS covers prefill).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.numeric import SIMULATOR, bf16_to_f32, f16_to_f32, u32_as_f32, warp_sum, widener

WARPS = 8             # warps per block (fewer for small N, see _pick_warps)
MIN_BLOCKS = 264      # 2 blocks per H200 SM (132 SMs) before warps per block is lowered
UNROLL = 2            # words per row loaded before the FMAs
TILE_WORDS = 256      # K tile in words: x tile = TOKEN_TILE * VEC * TILE_WORDS * 4 B = 32 KB for bf16, TT=8
TOKEN_TILES = (1, 8)  # tokens per block: 1 for T == 1, else 8
MODE_STORE, MODE_ACCUMULATE, MODE_SWIGLU = 0, 1, 2
_WORD = np.uint64


def _word_loader(weight_dtype, vec):
    """Device fn load(w, row, word, buf, off): widen word `word` of row `row` into buf[off:off+vec]."""
    dt = np.dtype(weight_dtype)
    if vec == 1:
        widen = widener(dt)

        @cuda.jit(device=True, inline=True)
        def load(w, row, word, buf, off):
            buf[off] = widen(w[row, word])
    elif dt == np.float32:
        @cuda.jit(device=True, inline=True)
        def load(w, row, word, buf, off):
            v = w[row, word]
            buf[off] = u32_as_f32(v & _WORD(0xFFFFFFFF))
            buf[off + 1] = u32_as_f32(v >> _WORD(32))
    else:
        half_to_f32 = bf16_to_f32 if dt == np.uint16 else f16_to_f32

        @cuda.jit(device=True, inline=True)
        def load(w, row, word, buf, off):
            v = w[row, word]
            for j in range(4):
                buf[off + j] = half_to_f32((v >> _WORD(16 * j)) & _WORD(0xFFFF))
    return load


@functools.lru_cache(maxsize=None)
def _build(weight_dtype, vec, token_tile):
    load = _word_loader(weight_dtype, vec)
    widen = widener(weight_dtype)
    tt, num_acc, num_buf = token_tile, 2 * token_tile, 2 * UNROLL * vec

    def linear_kernel(x, wa, wb, bias, has_bias, out, mode):
        """x: [T, K] float32. wa, wb: [R, K / vec] weight rows as words (uint64 views of W, or W itself when
        vec == 1); linear: wa is wb is W [N, K]; swiglu: wa = Wg [F, K], wb = Wu [F, K].
        bias: [N] W, read when has_bias (int32) != 0 (mode != SWIGLU). out: [T, N] or [T, F] float32.
        mode: MODE_STORE (out = xW^T + b), MODE_ACCUMULATE (out += xW^T + b), MODE_SWIGLU.
        Grid (ceil(T / token_tile), ceil(pairs / warps)), block (32 * warps,)."""
        xs = cuda.shared.array((tt, vec, TILE_WORDS), dtype=np.float32)
        acc = cuda.local.array(num_acc, dtype=np.float32)
        buf = cuda.local.array(num_buf, dtype=np.float32)
        lane = cuda.threadIdx.x % 32
        pair = cuda.blockIdx.y * (cuda.blockDim.x // 32) + cuda.threadIdx.x // 32
        t0 = cuda.blockIdx.x * tt
        num_tokens = x.shape[0]
        num_rows = wa.shape[0]
        num_words = wa.shape[1]
        ra = pair if mode == MODE_SWIGLU else 2 * pair
        rb = pair if mode == MODE_SWIGLU else 2 * pair + 1
        la = min(ra, num_rows - 1)        # clamped: warps past the end still run (uniform block syncs)
        lb = min(rb, num_rows - 1)
        for i in range(num_acc):
            acc[i] = np.float32(0.0)
        for w0 in range(0, num_words, TILE_WORDS):
            nw = min(TILE_WORDS, num_words - w0)
            span = min(TILE_WORDS, (nw + 32 * UNROLL - 1) // (32 * UNROLL) * (32 * UNROLL))   # words read below
            cuda.syncthreads()
            for e in range(cuda.threadIdx.x, tt * vec * span, cuda.blockDim.x):
                t = e // (vec * span)
                r = e - t * (vec * span)
                wl = r // vec
                j = r - wl * vec
                v = np.float32(0.0)
                if t0 + t < num_tokens and wl < nw:
                    v = x[t0 + t, (w0 + wl) * vec + j]
                xs[t, j, wl] = v
            cuda.syncthreads()
            for base in range(0, nw, 32 * UNROLL):
                for u in range(UNROLL):
                    wl = base + u * 32 + lane
                    if wl < nw:
                        load(wa, la, w0 + wl, buf, u * vec)
                        load(wb, lb, w0 + wl, buf, (UNROLL + u) * vec)
                    else:                 # xs is zero there too, but stale buf could hold inf/NaN
                        for j in range(vec):
                            buf[u * vec + j] = np.float32(0.0)
                            buf[(UNROLL + u) * vec + j] = np.float32(0.0)
                for u in range(UNROLL):
                    wl = base + u * 32 + lane
                    for t in range(tt):
                        sa = np.float32(0.0)
                        sb = np.float32(0.0)
                        for j in range(vec):
                            xv = xs[t, j, wl]
                            sa += buf[u * vec + j] * xv
                            sb += buf[(UNROLL + u) * vec + j] * xv
                        acc[t] += sa
                        acc[tt + t] += sb
        for t in range(tt):
            a = warp_sum(acc[t])
            b = warp_sum(acc[tt + t])
            tok = t0 + t
            if lane == 0 and tok < num_tokens and ra < num_rows:
                if mode == MODE_SWIGLU:
                    out[tok, ra] = a / (np.float32(1.0) + math.exp(-a)) * b
                else:
                    if has_bias != 0:
                        a += widen(bias[ra])
                        if rb < num_rows:
                            b += widen(bias[rb])
                    if mode == MODE_ACCUMULATE:
                        out[tok, ra] += a
                        if rb < num_rows:
                            out[tok, rb] += b
                    else:
                        out[tok, ra] = a
                        if rb < num_rows:
                            out[tok, rb] = b

    return linear_kernel, cuda.jit(linear_kernel)


def _vec(weight):
    """Words per 8-byte load for this weight, or 1 when rows are not 8-byte aligned (odd K, offset views)."""
    vec = 8 // weight.dtype.itemsize
    aligned = SIMULATOR or weight.__cuda_array_interface__["data"][0] % 8 == 0
    return vec if weight.shape[1] % vec == 0 and aligned else 1


def _pick_warps(pairs):
    for w in (WARPS, WARPS // 2, WARPS // 4, WARPS // 8):
        if -(-pairs // w) >= MIN_BLOCKS:
            return w
    return 1


def _launch(x, wa, wb, bias, out, mode, pairs, stream, warps):
    for a in (x, wa, wb, out) + ((bias,) if bias is not None else ()):
        assert a.flags["C_CONTIGUOUS"], "linear needs contiguous arrays"
    assert x.ndim == 2 and x.dtype == out.dtype == np.float32, (x.shape, x.dtype, out.dtype)
    assert wa.dtype == wb.dtype and wa.dtype in (np.float32, np.float16, np.uint16), (wa.dtype, wb.dtype)
    assert wa.shape == wb.shape and wa.shape[1] == x.shape[1], (x.shape, wa.shape, wb.shape)
    num_tokens = x.shape[0]
    if num_tokens == 0 or pairs == 0:
        return
    vec = min(_vec(wa), _vec(wb))
    tt = TOKEN_TILES[0] if num_tokens == 1 else TOKEN_TILES[1]
    kernel = _build(np.dtype(wa.dtype), vec, tt)[1]
    dummy_bias = wa.reshape(-1)[:1]       # never read (has_bias == 0); keeps the signature fixed
    if vec > 1:
        wa, wb = wa.view(_WORD), wb.view(_WORD)
    warps = warps or _pick_warps(pairs)
    has_bias = np.int32(bias is not None)
    bias = bias if bias is not None else dummy_bias
    grid = (-(-num_tokens // tt), -(-pairs // warps))
    kernel[grid, 32 * warps, stream](x, wa, wb, bias, has_bias, out, np.int32(mode))


def launch_linear(x, weight, out, bias=None, accumulate=False, stream=0, warps=None) -> None:
    """x: [T, K] float32; weight: [N, K] float32/float16/uint16 (bfloat16 bits); out: [T, N] float32,
    written (accumulate=False) or added to (accumulate=True: fused residual, out += x @ W^T + bias);
    bias: optional [N] of weight's dtype. warps: warps per block (default: by N, see _pick_warps)."""
    assert weight.ndim == 2 and out.shape == (x.shape[0], weight.shape[0]), (x.shape, weight.shape, out.shape)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.dtype == weight.dtype, (bias.shape, bias.dtype)
    _launch(x, weight, weight, bias, out, MODE_ACCUMULATE if accumulate else MODE_STORE,
            -(-weight.shape[0] // 2), stream, warps)


def launch_swiglu(x, gate, up, out, stream=0, warps=None) -> None:
    """x: [T, K] float32; gate, up: [F, K] weights of one dtype (or up=None and gate = [2F, K], gate rows then
    up rows); out: [T, F] float32 = silu(x @ gate^T) * (x @ up^T)."""
    if up is None:
        half = gate.shape[0] // 2
        assert gate.shape[0] == 2 * half, gate.shape
        gate, up = gate[:half], gate[half:]
    assert gate.ndim == 2 and out.shape == (x.shape[0], gate.shape[0]), (x.shape, gate.shape, out.shape)
    _launch(x, gate, up, None, out, MODE_SWIGLU, gate.shape[0], stream, warps)


def sm90_signatures():
    """(python function, numba signature) of every (weight dtype, vec, token tile) variant."""
    out = []
    f2 = types.float32[:, ::1]
    for dt, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        for vec in (8 // np.dtype(dt).itemsize, 1):
            wt = types.uint64[:, ::1] if vec > 1 else nb[:, ::1]
            for tt in TOKEN_TILES:
                out.append((_build(np.dtype(dt), vec, tt)[0], (f2, wt, wt, nb[::1], types.int32, f2, types.int32)))
    return out
