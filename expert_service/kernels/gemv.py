"""One-token (T == 1) GEMV for decode: y [1, N] = x [1, K] @ W[N, K]^T (+ bias, optionally += into y), the
fused SwiGLU h = silu(x @ Wg^T) * (x @ Wu^T), and the same two for the K experts one token is routed to,
read straight from the layer's expert array (expert id read on the device: graph-capturable).
References: ``x @ W.T (+ b)``, ``expert_service.cpu.layers.moe.swiglu_mlp``.

At T == 1 every weight byte is used once, so the kernels are pure HBM streams; the design keeps as many
16-byte loads in flight as the memory system needs and does nothing else in the main loop.
- Loads: weights through ``ptx.ld_stream_v4`` (``ld.global.nc.L1::no_allocate.v4.u32``: 8 bf16/f16 or 4 f32
  values per lane per load, not kept in L1); x through ``ptx.ld_v4`` (L1-cached: every warp of the SM
  re-reads the same x, so it costs L1 bandwidth, not HBM). No shared-memory staging, hence no barrier in
  the main loop.
- Work split: a warp owns ROWS output rows (gated: ROWS gate rows and the same ROWS up rows, so the SwiGLU
  epilogue has both), lanes stride along K in 16-byte chunks. Each lane issues LOADS_IN_FLIGHT independent
  16-byte weight loads (UNROLL chunks x weight rows, 128 B) before its first FMA; x is loaded after them.
  Every x value feeds ROWS rows from registers.
- Small N: ROWS drops (4 -> 2 -> 1) and SPLIT warps of a block share a row group, each taking a contiguous
  K range, until about TARGET_WARPS warps exist (132 SMs x 16): N = 8 routers still get 16 warps per row and
  one round trip of loads. Partial sums meet in shared memory once, after the loop (one barrier in total).
- Reduction: fp32 FMAs per lane, warp shuffles (``numeric.warp_sum``), then the SPLIT partials are summed
  and the epilogue (bias, residual add, silu * up) is applied by one thread per row.
- Experts: grid (row blocks, K slots); slot k reads ids[k] on the device and offsets into experts [E, stride].
- Fallback: when a row is not 16-byte aligned (K % 8 for 16-bit, K % 4 for f32, or an unaligned pointer) the
  same kernel is built with one element per chunk (scalar loads: correct, slower).
More than one token goes to cuBLAS or ``moe_ffn`` (the decoder): reusing a weight for many tokens needs token
tiles, not this.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda, types
from numba.np import numpy_support

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import SIMULATOR, WARP, f16_to_f32, silu, u32_as_f32, warp_sum, widener
from expert_service.kernels.ptx import ld_stream_v4

# The simulator runs one Python thread per CUDA thread: fewer loads per lane so tiny K still reaches the
# unrolled main loop (the code path is the same).
LOADS_IN_FLIGHT = 2 if SIMULATOR else 8   # 16-byte weight loads per lane before the FMAs
BLOCK_WARPS = 4           # warps per block when K is not split (small blocks: even load over 132 SMs)
MAX_SPLIT = 16            # warps sharing one row group (block of up to 512 threads)
TARGET_WARPS = 2048       # ~16 warps per H200 SM: enough 16-byte loads in flight to saturate HBM
MIN_ROW_WARPS = 1024      # use the most rows per warp (x reuse) that still gives this many warps
MODE_STORE, MODE_ACCUMULATE, MODE_SWIGLU = 0, 1, 2
_DTYPES = (np.uint16, np.float16, np.float32)   # uint16 = bfloat16 bits
_MAX_ROWS = 4             # weight rows per warp (dense ROWS <= 4, gated 2 * ROWS <= 4)
_RED_SHAPE = (MAX_SPLIT * BLOCK_WARPS, _MAX_ROWS)   # per-warp partial sums (up to 64 warps)


class LaunchShape(NamedTuple):
    """rows: output rows per warp; split: warps per row group (K ranges); groups: row groups per block."""
    rows: int
    split: int
    groups: int


def launch_shape_for(n_rows: int, n_chunks: int, slots: int, gated: bool) -> LaunchShape:
    """Launch shape for n_rows outputs per slot, n_chunks 16-byte chunks per weight row, slots (1 or K)."""
    def warps(r):
        return -(-n_rows // r) * slots
    choices = (2, 1) if gated else (4, 2, 1)
    rows = next((r for r in choices if warps(r) >= MIN_ROW_WARPS), 1)
    split = 1
    # each warp keeps >= 32 chunks (one per lane): splitting thinner only adds reduction work
    while split < MAX_SPLIT and warps(rows) * split < TARGET_WARPS and n_chunks >= 2 * split * WARP:
        split *= 2
    return LaunchShape(rows, split, max(1, BLOCK_WARPS // split))


def _chunk_ops(dtype, wide: bool, mode: int):
    """Device fns for one 16-byte chunk (wide) or one element (narrow) of a weight row:
    fetch(w, off, raw, i) loads it into raw[i, :]; load_x(x, off, xv, u) puts the matching x values in
    xv[u, :] (coherently in a waiting variant, kernels/programmatic.py); dot(raw, i, xv, u) -> float32 sum of
    their products. Also raw's dtype and width, and x values per chunk."""
    dt = np.dtype(dtype)
    ld_x = programmatic.activation_load(mode)
    per = (8 if dt.itemsize == 2 else 4) if wide else 1     # x values per chunk
    if not wide:
        widen = widener(dt)

        @cuda.jit(device=True, inline=True)
        def fetch(w, off, raw, i):
            raw[i, 0] = widen(w[off])

        @cuda.jit(device=True, inline=True)
        def load_x(x, off, xv, u):
            xv[u, 0] = x[off]

        @cuda.jit(device=True, inline=True)
        def dot(raw, i, xv, u):
            return raw[i, 0] * xv[u, 0]
        return fetch, load_x, dot, np.float32, 1, per

    @cuda.jit(device=True, inline=True)  # type: ignore[no-redef]  # the narrow branch returned its own above
    def fetch(w, off, raw, i):
        a, b, c, d = ld_stream_v4(w, off)
        raw[i, 0] = a
        raw[i, 1] = b
        raw[i, 2] = c
        raw[i, 3] = d

    @cuda.jit(device=True, inline=True)  # type: ignore[no-redef]  # the narrow branch returned its own above
    def load_x(x, off, xv, u):
        for q in range(per // 4):
            a, b, c, d = ld_x(x, off + 4 * q)
            xv[u, 4 * q] = a
            xv[u, 4 * q + 1] = b
            xv[u, 4 * q + 2] = c
            xv[u, 4 * q + 3] = d

    if dt == np.float32:
        @cuda.jit(device=True, inline=True)
        def dot(raw, i, xv, u):
            s = np.float32(0.0)
            for j in range(4):
                s += u32_as_f32(raw[i, j]) * xv[u, j]
            return s
    else:
        # bf16 widening is a shift into the high half (exact); f16 goes through the exact bit conversion
        is_bf16 = dt == np.uint16

        @cuda.jit(device=True, inline=True)
        def dot(raw, i, xv, u):
            s = np.float32(0.0)
            for j in range(4):
                v = raw[i, j]
                if is_bf16:
                    lo = u32_as_f32(v << np.uint32(16))
                    hi = u32_as_f32(v & np.uint32(0xFFFF0000))
                else:
                    lo = f16_to_f32(v & np.uint32(0xFFFF))
                    hi = f16_to_f32(v >> np.uint32(16))
                s += lo * xv[u, 2 * j] + hi * xv[u, 2 * j + 1]
            return s
    return fetch, load_x, dot, np.uint32, 4, per


@functools.cache
def _build(dtype, wide: bool, rows: int, gated: bool, launch_mode: int = 0):
    """(python kernel, jitted kernel) for weight storage dtype, 16-byte (wide) or scalar chunks, ROWS, gated;
    launch_mode: the programmatic-launch variant (kernels/programmatic.py; PREFETCH: dense launches only, their
    first step's weight loads issued before the wait)."""
    fetch, load_x, dot, raw_dtype, raw_width, per = _chunk_ops(dtype, wide, launch_mode)
    prologue, late_wait = programmatic.prologue(launch_mode), programmatic.late_wait(launch_mode)
    prefetch = launch_mode == programmatic.PREFETCH
    widen = widener(dtype)
    wpc = 4 if wide else 1                    # w array units (u32 words or elements) per chunk
    nw = rows * (2 if gated else 1)           # weight rows streamed by one warp
    unroll = max(1, LOADS_IN_FLIGHT // nw)    # chunks per row in flight per lane
    step = WARP * unroll
    raw_shape, xv_shape = (nw * unroll, raw_width), (unroll, per)   # local shapes must be closure constants

    @cuda.jit(device=True, inline=True)
    def fetch_step(wa, wb, roff, c0, end, checked, raw):
        """The weight loads of chunks c0 + 32u (u < UNROLL) of every weight row into raw: independent, in flight
        together. checked (constant at each call site): chunks at or past `end` are zeros, only in the last
        partial step, so the main loop has no branches."""
        for u in range(unroll):
            c = c0 + u * WARP
            ok = not checked or c < end
            for r in range(rows):
                if ok:
                    fetch(wa, roff[r] + c * wpc, raw, r * unroll + u)
                    if gated:
                        fetch(wb, roff[rows + r] + c * wpc, raw, (rows + r) * unroll + u)
                else:
                    for j in range(raw_width):
                        raw[r * unroll + u, j] = 0
                        raw[(nw - rows + r) * unroll + u, j] = 0

    @cuda.jit(device=True, inline=True)
    def use_step(x, xoff, c0, end, checked, raw, xv, acc):
        """x for the chunks fetch_step loaded, and their FMAs into acc."""
        for u in range(unroll):
            c = c0 + u * WARP
            if not checked or c < end:
                load_x(x, xoff + c * per, xv, u)
            else:
                for j in range(per):
                    xv[u, j] = np.float32(0.0)
            for r in range(nw):
                acc[r] += dot(raw, r * unroll + u, xv, u)

    @cuda.jit(device=True, inline=True)
    def chunk_step(x, xoff, wa, wb, roff, c0, end, checked, raw, xv, acc):
        """Chunks c0 + 32u (u < UNROLL) of every weight row into acc: all weight loads first, then x and the
        FMAs."""
        fetch_step(wa, wb, roff, c0, end, checked, raw)
        use_step(x, xoff, c0, end, checked, raw, xv, acc)

    def gemv_kernel(x, x_stride, ids, use_ids, wa, wb, stride, first, second, row_len, n_rows, n_chunks,
                    split, bias, has_bias, mode, out):
        """x: activations, flat float32; slot k reads n_chunks*per values from k * x_stride.
        ids: [slots] int32 expert per slot (read when use_ids != 0, else expert 0).
        wa, wb: flat weights, uint32 words (wide) or elements; row r of gate / plain weight starts at
        e * stride + first + r * row_len, row r of up (gated) at e * stride + second + r * row_len (w units).
        n_rows: output rows; n_chunks: chunks per row; split: warps per row group (blockDim = 32 * groups *
        split). bias: [n_rows] weight dtype, read when has_bias != 0. mode: MODE_STORE / MODE_ACCUMULATE /
        MODE_SWIGLU (gated kernels). out: [slots, n_rows] float32. Grid (row blocks, slots)."""
        prologue()
        raw = cuda.local.array(raw_shape, raw_dtype)
        xv = cuda.local.array(xv_shape, np.float32)
        acc = cuda.local.array(nw, np.float32)
        roff = cuda.local.array(nw, np.int64)
        red = cuda.shared.array(_RED_SHAPE, np.float32)
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        groups = cuda.blockDim.x // (WARP * split)
        g = warp // split
        s = warp - g * split
        slot = cuda.blockIdx.y
        row0 = (cuda.blockIdx.x * groups + g) * rows
        if prefetch:
            e = 0  # dense launches only: the rows' addresses need nothing an earlier kernel wrote
        else:
            e = ids[slot] if use_ids != 0 else 0
        base = e * stride
        for r in range(rows):
            row = min(row0 + r, n_rows - 1)   # rows past the end re-read the last row and are never written
            roff[r] = base + first + row * row_len
            if gated:
                roff[rows + r] = base + second + row * row_len
        for r in range(nw):
            acc[r] = np.float32(0.0)
        xoff = slot * x_stride
        # this warp's contiguous K range, whole warp-widths so every warp's loads start 512 B-aligned
        span = (n_chunks + split * WARP - 1) // (split * WARP) * WARP
        begin = min(s * span, n_chunks)    # short K: trailing warps get an empty range
        end = min(begin + span, n_chunks)
        full = begin + (end - begin) // step * step
        c_first = begin + lane
        tail = full < end
        if prefetch:  # the first step's weights in flight while the predecessor drains, then the wait
            whole = full > begin
            if whole:
                fetch_step(wa, wb, roff, c_first, end, False, raw)
            elif tail:
                fetch_step(wa, wb, roff, c_first, end, True, raw)
            late_wait()
            if whole:
                use_step(x, xoff, c_first, end, False, raw, xv, acc)
                c_first += step
            elif tail:
                use_step(x, xoff, c_first, end, True, raw, xv, acc)
                tail = False
        for c0 in range(c_first, full, step):
            chunk_step(x, xoff, wa, wb, roff, c0, end, False, raw, xv, acc)
        if tail:
            chunk_step(x, xoff, wa, wb, roff, full + lane, end, True, raw, xv, acc)
        for r in range(nw):
            total = warp_sum(acc[r])
            if lane == 0:
                red[warp, r] = total
        cuda.syncthreads()
        t = cuda.threadIdx.x
        if t < groups * rows:
            gt = t // rows
            r = t - gt * rows
            row = (cuda.blockIdx.x * groups + gt) * rows + r
            if row < n_rows:
                a = np.float32(0.0)
                b = np.float32(0.0)
                for q in range(split):
                    a += red[gt * split + q, r]
                    if gated:
                        b += red[gt * split + q, rows + r]
                if gated:
                    out[slot, row] = silu(a) * b
                else:
                    if has_bias != 0:
                        a += widen(bias[row])
                    if mode == MODE_ACCUMULATE:
                        out[slot, row] += a
                    else:
                        out[slot, row] = a

    return gemv_kernel, programmatic.compiled(gemv_kernel, launch_mode)


def _aligned(a) -> bool:
    return SIMULATOR or a.__cuda_array_interface__["data"][0] % 16 == 0


def _check(name, a, shape, dtypes):
    if a.shape != tuple(shape) or np.dtype(a.dtype) not in [np.dtype(d) for d in dtypes] \
            or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name} must be C-contiguous {list(shape)} of {[np.dtype(d).name for d in dtypes]}, "
                         f"got {a.dtype} {list(a.shape)}")


def _launch(x, x_stride, ids, wa, wb, stride, first, second, row_len, n_rows, slots, gated, bias, mode, out,
            stream, shape, wide):
    """Offsets in elements of the weights' dtype; converts them to u32 words for the 16-byte path."""
    dtype = np.dtype(wa.dtype)
    flat_a, flat_b = wa.reshape(wa.size), wb.reshape(wb.size)
    dummy = flat_a[:1]                       # stands in for bias/ids when unused (never read)
    if wide:
        unit = 4 // dtype.itemsize           # elements per u32 word
        flat_a, flat_b = flat_a.view(np.uint32), flat_b.view(np.uint32)
        stride, first, second, row_len = stride // unit, first // unit, second // unit, row_len // unit
        n_chunks = row_len // 4
    else:
        n_chunks = row_len
    shape = shape or launch_shape_for(n_rows, n_chunks, slots, gated)
    if shape.rows * (2 if gated else 1) > _MAX_ROWS or shape.groups * shape.split > _RED_SHAPE[0]:
        raise ValueError(f"shape {shape} exceeds {_MAX_ROWS} weight rows per warp or {_RED_SHAPE[0]} warps")
    # dense launches may load their first weights before the wait; expert launches read the router's ids first
    kernel = _build(dtype.type, wide, shape.rows, gated, programmatic.mode(prefetches=ids is None))[1]
    grid = (-(-n_rows // (shape.rows * shape.groups)), slots)
    block = WARP * shape.groups * shape.split
    use_ids = int(ids is not None)
    ids = ids.reshape(ids.size) if ids is not None else x.reshape(x.size).view(np.int32)
    kernel[grid, block, stream](x.reshape(x.size), x_stride, ids, use_ids, flat_a, flat_b, stride, first,
                                second, row_len, n_rows, n_chunks, shape.split,
                                bias if bias is not None else dummy, int(bias is not None), mode, out)


def launch_gemv(x, weight, out, bias=None, accumulate=False, stream=0, shape=None) -> None:
    """x: [1, K] float32; weight: [N, K] uint16 (bfloat16 bits) / float16 / float32; out: [1, N] float32,
    written (out = x @ W^T + bias) or, with accumulate=True, added to (fused residual: out += x @ W^T + bias).
    bias: optional [N] of weight's dtype. shape: launch shape override (default launch_shape_for)."""
    n, k = weight.shape
    _check("x", x, (1, k), (np.float32,))
    _check("weight", weight, (n, k), _DTYPES)
    _check("out", out, (1, n), (np.float32,))
    if bias is not None:
        _check("bias", bias, (n,), (weight.dtype,))
    if n == 0:
        return
    wide = k * weight.dtype.itemsize % 16 == 0 and _aligned(weight) and _aligned(x)
    _launch(x, 0, None, weight, weight, 0, 0, 0, k, n, 1, False, bias,
            MODE_ACCUMULATE if accumulate else MODE_STORE, out, stream, shape, wide)


def launch_gemv_swiglu(x, gate, up, out, stream=0, shape=None) -> None:
    """x: [1, K] float32; gate, up: [F, K] weights of one dtype (or up=None and gate = [2F, K]: gate rows then
    up rows); out: [1, F] float32 = silu(x @ gate^T) * (x @ up^T)."""
    rows, k = gate.shape
    f = rows // 2 if up is None else rows
    _check("x", x, (1, k), (np.float32,))
    _check("gate", gate, (2 * f if up is None else f, k), _DTYPES)
    if up is not None:
        _check("up", up, (f, k), (gate.dtype,))
    _check("out", out, (1, f), (np.float32,))
    if f == 0:
        return
    wide = (k * gate.dtype.itemsize % 16 == 0 and _aligned(gate) and _aligned(x)
            and (up is None or _aligned(up)))
    _launch(x, 0, None, gate, gate if up is None else up, 0, 0, f * k if up is None else 0, k, f, 1, True,
            None, MODE_SWIGLU, out, stream, shape, wide)


def _expert_wide(experts, row_elems, src) -> bool:
    item = experts.dtype.itemsize
    return (row_elems * item % 16 == 0 and experts.shape[1] * item % 16 == 0 and _aligned(experts)
            and _aligned(src))


def _check_experts(experts, F, D, ids):
    if experts.ndim != 2 or experts.shape[1] < 3 * F * D:
        raise ValueError(f"experts must be [E, stride >= 3*F*D = {3 * F * D}], got {list(experts.shape)}")
    _check("experts", experts, experts.shape, _DTYPES)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.dtype != np.int32:
        raise ValueError(f"ids must be int32 [1, K], got {ids.dtype} {list(ids.shape)}")
    return ids.shape[1]


def launch_expert_gate_up(x, ids, experts, F: int, D: int, h, stream=0, shape=None) -> None:
    """One token through the gate/up of its K experts: x [1, D] float32; ids [1, K] int32 (device; repeats
    allowed, each id in [0, E)); experts [E, stride] uint16/float16/float32, expert e = gate [F, D], up [F, D],
    down [D, F] back to back (moe_ffn layout); h [K, F] float32: h[k] = silu(x . gate[ids[k]]^T) *
    (x . up[ids[k]]^T)."""
    top_k = _check_experts(experts, F, D, ids)
    _check("x", x, (1, D), (np.float32,))
    _check("h", h, (top_k, F), (np.float32,))
    if top_k == 0 or F == 0:
        return
    _launch(x, 0, ids, experts, experts, experts.shape[1], 0, F * D, D, F, top_k, True, None, MODE_SWIGLU, h,
            stream, shape, _expert_wide(experts, D, x))


def launch_expert_down(h, ids, experts, F: int, D: int, y, stream=0, shape=None) -> None:
    """h [K, F] float32 (launch_expert_gate_up's output, slot order); ids [1, K] int32 (device); experts as in
    launch_expert_gate_up; y [K, D] float32: y[k] = h[k] @ down[ids[k]]^T (not yet weighted by the router)."""
    top_k = _check_experts(experts, F, D, ids)
    _check("h", h, (top_k, F), (np.float32,))
    _check("y", y, (top_k, D), (np.float32,))
    if top_k == 0 or D == 0:
        return
    _launch(h, F, ids, experts, experts, experts.shape[1], 2 * F * D, 2 * F * D, F, D, top_k, False, None,
            MODE_STORE, y, stream, shape, _expert_wide(experts, F, h))


def sm90_signatures():
    """(python function, numba signature) of every (weight dtype, wide, rows, gated) variant, and bf16's wide ones
    in every programmatic-launch mode."""
    i64, f1 = types.int64, types.float32[::1]
    out = []
    for dt in _DTYPES:
        nb = numpy_support.from_dtype(np.dtype(dt))
        for wide in (True, False):
            w = types.uint32[::1] if wide else nb[::1]
            for gated, choices in ((False, (4, 2, 1)), (True, (2, 1))):
                for rows in choices:
                    for mode in programmatic.MODES if wide and dt is np.uint16 else (programmatic.PLAIN,):
                        out.append((_build(dt, wide, rows, gated, mode)[0],
                                    (f1, i64, types.int32[::1], i64, w, w, i64, i64, i64, i64, i64, i64, i64,
                                     nb[::1], i64, i64, types.float32[:, ::1])))
    return out
