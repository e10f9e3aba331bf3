"""Grouped expert SwiGLU FFN: each active expert's weights are streamed once per step for all of its tokens.
Reference: ``expert_service.cpu.layers.moe.swiglu_mlp`` applied per expert in grouped order.

Weights: one device array per MoE layer, W [E, stride] (stride = expert_stride / itemsize elements), expert e
holding gate [F, D], up [F, D], down [D, F] back to back, row-major [out, in]; uint16 (bf16 bits), float16 or
float32. Two launches per layer:
  launch_moe_gate_up: h[p, f] = silu(x[order[p] // K] . gate[e, f]) * (x[order[p] // K] . up[e, f])   h [T*K, F]
  launch_moe_down:    y[p, d] = h[p] . down[e, d]                                                      y [T*K, D]
for every grouped position p in [offsets[e], offsets[e+1]).

Grid = (E, ceil(rows / ROWS_PER_BLOCK)) whatever the routing, so the launch is graph-capturable; blocks of
experts without tokens return at once. A block (WARPS warps) owns ROWS_PER_BLOCK output rows of one expert;
each warp streams ROWS_PER_WARP rows (both gate and up rows in launch_moe_gate_up), lanes striding along the input
dim and accumulating in f32, then a shared-memory reduction per (row, token). The expert's inputs are staged in shared
memory TOK_TILE tokens x CHUNK features at a time; experts with more tokens loop over token tiles, re-reading
the block's weight rows (L2-resident: 16 rows x D) instead of keeping one accumulator per token.

Loads: bf16 weights with the input dim a multiple of 4 read one 8-byte word (4 values) per lane per row
(wide loads stream weights faster than element loads); other cases (fp16, fp32, odd sizes) read one element
per lane.
A token tile of one (decode: 1-2 tokens per expert) takes a path that touches only that token.

Prefill is compute-bound here (f32 FMAs, every weight reused only TOK_TILE times from registers). What would
make it fast: tensor cores through inline-PTX mma.sync m16n8k16 bf16 (x rounded to bf16 or split hi+lo),
64-128 token tiles via ldmatrix from shared memory, cp.async double buffering of weight tiles, and a compact
active-expert grid (grid.x = min(E, T*K) slots mapped to active experts) instead of (E, tiles).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types
from numba.np import numpy_support

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR, WARP, bf16_to_f32, loader, silu

GROUPED_MAX_TOKENS = 64  # steps up to here run the grouped kernels; above, cuBLAS GEMMs per expert (a host break)

# The simulator runs one Python thread per CUDA thread: it gets small tiles that still exercise every loop
# (several row tiles, token tiles and input chunks on tiny shapes). The code path is identical.
WARPS = 1 if SIMULATOR else 8
THREADS = WARPS * WARP
ROWS_PER_WARP = 2               # the dot body below is written out for exactly two rows
ROW_GROUPS = 16 if SIMULATOR else 1    # row groups of WARPS*ROWS_PER_WARP rows walked by one block
ROWS_PER_BLOCK = ROW_GROUPS * WARPS * ROWS_PER_WARP
TOK_TILE = 2 if SIMULATOR else 8
CHUNK = 32 if SIMULATOR else 256    # input features staged per pass (multiple of 4): TOK_TILE*CHUNK*4 B shared
_PAIRS = ROWS_PER_WARP * TOK_TILE   # (row, token) sums per warp; shared: 8 KiB staging + 33 KiB reduction
_RED_VALUES = 2 * _PAIRS          # gate and up sums
_RED_LANES = WARP + 1              # padded: lane v reading value v walks distinct banks
WIDE = 4                        # bf16 values per 8-byte word

_DTYPES = (np.uint16, np.float16, np.float32)


@cuda.jit(device=True, inline=True)
def _get_bf16x4(a, i):
    """Word i of a uint64 view of bf16 weights -> 4 float32 values in memory order."""
    w = a[i]
    lo = np.uint32(w & np.uint64(0xFFFFFFFF))
    hi = np.uint32(w >> np.uint64(32))
    return (bf16_to_f32(np.uint16(lo & np.uint32(0xFFFF))), bf16_to_f32(np.uint16(lo >> np.uint32(16))),
            bf16_to_f32(np.uint16(hi & np.uint32(0xFFFF))), bf16_to_f32(np.uint16(hi >> np.uint32(16))))


def _getter(dtype, wide):
    if wide:
        return _get_bf16x4
    load = loader(dtype)

    @cuda.jit(device=True, inline=True)
    def get(a, i):
        return (load(a, i),)
    return get


def _make_dot(get, per_word, ntok, gated):
    """Accumulate the staged chunk into acc_g/acc_u [ROWS_PER_WARP, TOK_TILE] for tokens 0..ntok-1 (ntok fixed
    at compile time, so the loops unroll and the accumulators stay in registers)."""
    @cuda.jit(device=True, inline=True)
    def dot(wts, ga, gb, ua, ub, xs, nwords, lane, acc_g, acc_u):
        for wi in range(lane, nwords, WARP):
            wga = get(wts, ga + wi)
            wgb = get(wts, gb + wi)
            wua = get(wts, ua + wi) if gated else wga
            wub = get(wts, ub + wi) if gated else wgb
            for j in range(per_word):
                c = wi * per_word + j
                for t in range(ntok):
                    xv = xs[t, c]
                    acc_g[0, t] += wga[j] * xv
                    acc_g[1, t] += wgb[j] * xv
                    if gated:
                        acc_u[0, t] += wua[j] * xv
                        acc_u[1, t] += wub[j] * xv
    return dot


@functools.cache
def _kernel(dtype, wide: bool, gated: bool):
    """Kernel for weight storage `dtype`; wide = bf16 read as uint64 words; gated = gate_up (else down)."""
    get = _getter(dtype, wide)
    per_word = WIDE if wide else 1
    dot_one = _make_dot(get, per_word, 1, gated)
    dot_tile = _make_dot(get, per_word, TOK_TILE, gated)

    @cached_jit
    def kernel(src, order, offsets, wts, stride, n_rows, n_in, top_k, first, second, slot_of, use_slots, out):
        """src: x [T, D] (gated, gathered through order[p] // top_k) or h [T*K, F] (down, row p);
        order [T*K] int32; offsets [E+1] int32; wts: W flattened (uint64 words if wide); stride: elements per
        expert; n_rows/n_in: output rows and input features of the matrix; first/second: element offsets of
        gate and up (down: first = second = offset of down) inside an expert; slot_of [E] int32, read when
        use_slots != 0: expert e's weights are block slot_of[e] of W, and experts with slot_of[e] < 0 are
        skipped (their rows of `out` untouched: the expert cache computes a layer in waves); else block e.
        out [T*K, n_rows] f32."""
        e = cuda.blockIdx.x
        start = offsets[e]
        end = offsets[e + 1]
        block = e
        if use_slots != 0:
            block = slot_of[e]
        if start >= end or block < 0:
            return                      # whole block leaves before any barrier
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        n_groups = (n_rows + WARPS * ROWS_PER_WARP - 1) // (WARPS * ROWS_PER_WARP)
        xs = cuda.shared.array((TOK_TILE, CHUNK), np.float32)
        srow = cuda.shared.array(TOK_TILE, np.int32)
        red = cuda.shared.array((WARPS, _RED_VALUES, _RED_LANES), np.float32)
        acc_g = cuda.local.array((ROWS_PER_WARP, TOK_TILE), np.float32)
        acc_u = cuda.local.array((ROWS_PER_WARP, TOK_TILE), np.float32)
        base = block * stride
        # A block owns ROW_GROUPS groups of WARPS*ROWS_PER_WARP rows, walked one after the other.
        for group in range(cuda.blockIdx.y * ROW_GROUPS, min((cuda.blockIdx.y + 1) * ROW_GROUPS, n_groups)):
            # rows past n_rows re-read the last row (cache hit) and are never written: no divergent branches
            f0 = group * WARPS * ROWS_PER_WARP + warp * ROWS_PER_WARP
            ra = min(f0, n_rows - 1)
            rb = min(f0 + 1, n_rows - 1)
            ga = (base + first + ra * n_in) // per_word
            gb = (base + first + rb * n_in) // per_word
            ua = (base + second + ra * n_in) // per_word
            ub = (base + second + rb * n_in) // per_word
            for p0 in range(start, end, TOK_TILE):
                ntok = min(TOK_TILE, end - p0)
                for r in range(ROWS_PER_WARP):
                    for t in range(TOK_TILE):
                        acc_g[r, t] = np.float32(0.0)
                        acc_u[r, t] = np.float32(0.0)
                cuda.syncthreads()          # previous tile's readers of srow/xs are done
                if tid < ntok:
                    srow[tid] = order[p0 + tid] // top_k if gated else p0 + tid
                # one token: stage only its row; a tile: zero the unused token rows so the unrolled dot is exact
                staged = 1 if ntok == 1 else TOK_TILE
                for c0 in range(0, n_in, CHUNK):
                    width = min(CHUNK, n_in - c0)
                    cuda.syncthreads()
                    for i in range(tid, staged * CHUNK, THREADS):
                        t = i // CHUNK
                        c = i - t * CHUNK
                        xs[t, c] = src[srow[t], c0 + c] if t < ntok and c < width else np.float32(0.0)
                    cuda.syncthreads()
                    w0 = c0 // per_word
                    nwords = width // per_word
                    if ntok == 1:
                        dot_one(wts, ga + w0, gb + w0, ua + w0, ub + w0, xs, nwords, lane, acc_g, acc_u)
                    else:
                        dot_tile(wts, ga + w0, gb + w0, ua + w0, ub + w0, xs, nwords, lane, acc_g, acc_u)
                # Transposed reduction: each lane posts its partial sums, then lane v adds up value v over the 32
                # lanes (rows padded to 33 floats: conflict-free). Fewer instructions than a shuffle tree per value,
                # and one barrier (the simulator pays per barrier).
                for r in range(ROWS_PER_WARP):
                    for t in range(TOK_TILE):
                        red[warp, r * TOK_TILE + t, lane] = acc_g[r, t]
                        red[warp, _PAIRS + r * TOK_TILE + t, lane] = acc_u[r, t]
                cuda.syncthreads()
                for v in range(lane, _PAIRS, WARP):
                    r = v // TOK_TILE
                    t = v - r * TOK_TILE
                    g = np.float32(0.0)
                    u = np.float32(0.0)
                    for j in range(WARP):
                        g += red[warp, v, j]
                        if gated:
                            u += red[warp, _PAIRS + v, j]
                    if t < ntok and f0 + r < n_rows:
                        out[p0 + t, f0 + r] = silu(g) * u if gated else g
    return kernel


def _weights_view(W, wide):
    flat = W.reshape(W.shape[0] * W.shape[1])
    return flat.view(np.uint64) if wide else flat


def _check(W, F, D, offsets, slot_of, arrays):
    if W.ndim != 2 or np.dtype(W.dtype) not in [np.dtype(d) for d in _DTYPES] or not W.flags["C_CONTIGUOUS"]:
        raise ValueError(f"W must be C-contiguous [E, stride] uint16/float16/float32, got {W.dtype} {W.shape}")
    experts = offsets.shape[0] - 1
    if W.shape[1] < 3 * F * D or offsets.dtype != np.int32 or (slot_of is None and W.shape[0] != experts):
        raise ValueError(f"expert stride {W.shape[1]} < 3*F*D, or offsets {offsets.shape} not int32 [E+1] for "
                         f"W's {W.shape[0]} experts")
    if slot_of is not None:
        arrays = arrays + [("slot_of", slot_of, (experts,), np.int32)]
    for name, a, shape, dt in arrays:
        if a.shape != shape or a.dtype != dt or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous {np.dtype(dt).name} {list(shape)}, "
                             f"got {a.dtype} {list(a.shape)}")


def _wide(W, n_in):
    # 8-byte words need every row start 8-byte aligned: bf16, input dim and expert stride multiples of 4
    return np.dtype(W.dtype) == np.uint16 and n_in % WIDE == 0 and W.shape[1] % WIDE == 0


def launch_moe_gate_up(x, order, offsets, W, F: int, D: int, h, stream=0, slot_of=None) -> None:
    """x [T, D] f32, order [T*K] int32, offsets [E+1] int32, W [E, stride] -> h [T*K, F] f32 (grouped order).
    With slot_of [E] int32 (device), W is [slots, stride] and expert e reads block slot_of[e] (< 0: skipped)."""
    n_tok = x.shape[0]
    n = order.shape[0]
    if n_tok == 0 or n % n_tok:
        raise ValueError(f"order length {n} is not a multiple of T={n_tok}")
    _check(W, F, D, offsets, slot_of, [("x", x, (n_tok, D), np.float32), ("order", order, (n,), np.int32),
                                       ("h", h, (n, F), np.float32)])
    _launch(x, order, offsets, W, F, D, 0, F * D, n // n_tok, True, slot_of, h, stream)


def launch_moe_down(h, order, offsets, W, F: int, D: int, y, stream=0, slot_of=None) -> None:
    """h [T*K, F] f32 (grouped order), order [T*K] int32 (unused: h is already grouped; kept for one kernel
    signature), offsets [E+1] int32, W [E, stride] -> y [T*K, D] f32 (grouped order); slot_of as moe_gate_up."""
    n = h.shape[0]
    _check(W, F, D, offsets, slot_of, [("h", h, (n, F), np.float32), ("order", order, (n,), np.int32),
                                       ("y", y, (n, D), np.float32)])
    _launch(h, order, offsets, W, D, F, 2 * F * D, 2 * F * D, 1, False, slot_of, y, stream)


def _launch(src, order, offsets, W, n_rows, n_in, first, second, top_k, gated, slot_of, out, stream):
    wide = _wide(W, n_in)
    grid = (offsets.shape[0] - 1, (n_rows + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK)
    use_slots = np.int64(slot_of is not None)
    _kernel(np.dtype(W.dtype).type, wide, gated)[grid, THREADS, stream](
        src, order, offsets, _weights_view(W, wide), W.shape[1], n_rows, n_in, top_k, first, second,
        slot_of if slot_of is not None else offsets[:1], use_slots, out)


def sm90_signatures():
    """(python function, numba signature) of every kernel variant, for the sm_90 compile check."""
    f2, i1, i64 = types.float32[:, ::1], types.int32[::1], types.int64
    out = []
    for dtype in _DTYPES:
        for wide in ((False, True) if dtype is np.uint16 else (False,)):
            wts = types.uint64[::1] if wide else types.Array(numpy_support.from_dtype(np.dtype(dtype)), 1, "C")
            for gated in (True, False):
                out.append((_kernel(dtype, wide, gated).py_func,
                            (f2, i1, i1, wts, i64, i64, i64, i64, i64, i64, i1, i64, f2)))
    return out
