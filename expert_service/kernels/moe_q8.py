"""Routed experts on 8-bit (or mixed-dtype) weights, dequantised in registers: the SwiGLU gate/up and the down
projection for a layer whose experts are int8 / fp8 e4m3 with float32 scales, bf16, fp16 or fp32, one dtype per
expert (expert_quant: the block layout, `meta` and the numpy reference `expert_quant.expert_ffn`).

Two launches per layer and dtype present, two ways to find an expert's tokens (graph-capturable, no host reads):
  by slot (decode, one token): grid.x = K slots, slot k runs expert ids[k] on the token (row 0 of x); out row k.
  grouped: grid.x = E, expert e runs the grouped positions p in [offsets[e], offsets[e+1]) (expert_grouping), the
           input row of p being order[p] // K (gate/up) or p (down); out row p. Experts without tokens return.
  through slots (the expert cache, either way): slot_of [E] int32 names the block of the slot buffer [S, stride]
           that holds expert e (its meta row is still meta[e]); experts with slot_of[e] < 0 return at once.
  gate_up: h[p, f] = silu(x . gate[e, f]) * (x . up[e, f])       h [n, F] float32
  down:    y[p, d] = h[p] . down[e, d]                           y [n, D] float32

Each kernel is compiled for one weight encoding (int8, e4m3, bf16, f16, f32: `_kernel(code, gated, tokens)`) and
returns at once for experts of another (meta[e, 0] is read on the device), so a layer launches one variant per
dtype it holds (all 8-bit: one) and a mixed layer stays one graph-capturable sequence. With the dtype a
compile-time constant, every per-thread array has constant indices once Numba's loops over constant ranges are
unrolled: the loop runs from registers, no local memory (the sm_90 compile check asserts no ld.local/st.local).

At decode every weight byte is used once, so the kernel is an HBM stream, built like gemv's (73 % of the H200's
HBM roofline on bf16): a warp owns ROWS output rows (gated: ROWS gate and ROWS up rows), each lane issues UNROLL
16-byte streaming loads per row (UNROLL x 4 rows x 16 B = 128 B in flight per lane, as gemv) before its first
FMA, then widens each word in registers (int8: one prmt and one subtraction per value; e4m3: prmt, shift, mask
and the 2**120 rescale; expert_quant.int8x4 / fp8x4) and multiplies by `tokens` tokens' x values (L1-cached
16-byte loads, one per 4 values and token, shared by the warp's rows). Decode launches tokens = 1 (no FMA spent
on absent tokens); grouped launches take TOK_TILE tokens per pass (a partial tile repeats its last token, never
written). Scales: a per-channel scale multiplies the row's sum once; a 128x128 block scale multiplies each
chunk's partial sum (a 16-byte chunk never straddles a block). Sums are float32, reduced with warp shuffles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.expert_quant import (
    CHUNK_BYTES,
    CODE_BF16,
    CODE_F16,
    CODE_F32,
    CODE_FP8,
    CODE_INT8,
    META_WIDTH,
    SCALE_BLOCK,
    SCALE_BLOCK_SIZE,
    SCALE_CHANNEL,
    SCALE_NONE,
    element_bytes,
    fp8x4,
    int8x4,
)
from expert_service.kernels.numeric import SIMULATOR, WARP, check_array, f16_to_f32, silu, u32_as_f32, warp_sum
from expert_service.kernels.ptx import ld_stream_v4

WARPS = 1 if SIMULATOR else 4  # warps per block
ROWS_GATED = 2  # gate rows (and as many up rows) per warp: 4 weight rows streamed
ROWS_DOWN = 2 if SIMULATOR else 4  # down rows per warp: 4 weight rows streamed
UNROLL = 1 if SIMULATOR else 2  # 16-byte chunks per row in flight per lane (one-token launches)
TOK_TILE = 2 if SIMULATOR else 4  # tokens per pass over an expert's rows in grouped launches
MIN_DIM = 16  # D and F are multiples of this: whole 16-byte chunks of 8-bit rows
# (dtype code, scale scheme) of every expert encoding: one compiled variant each
ALL_KINDS = (
    (CODE_INT8, SCALE_CHANNEL),
    (CODE_INT8, SCALE_BLOCK),
    (CODE_FP8, SCALE_CHANNEL),
    (CODE_FP8, SCALE_BLOCK),
    (CODE_BF16, SCALE_NONE),
    (CODE_F16, SCALE_NONE),
    (CODE_F32, SCALE_NONE),
)
# blocks per SM each variant is compiled for (ptxas caps registers at 65536 / (threads * blocks)): 4 blocks of 4
# warps keep 16 warps x 4 KB of loads in flight per SM at decode, as gemv (kernel_bounds: fewer where 128
# registers would spill); token tiles need more registers.
DECODE_BLOCKS_PER_SM, TILE_BLOCKS_PER_SM = 4, 2
WORDS = CHUNK_BYTES // 4  # 32-bit words per 16-byte chunk
BLOCK_SHIFT = SCALE_BLOCK_SIZE.bit_length() - 1  # log2 of the 128-value scale block
assert 1 << BLOCK_SHIFT == SCALE_BLOCK_SIZE


class LaunchShape(NamedTuple):
    """How a launch spreads its rows: warps a block, gate rows (and as many up rows) a warp, down rows a warp,
    16-byte chunks a row in flight a lane (one-token launches; token tiles take 1), and the warps an SM is
    compiled to hold (launch bounds: registers = 65536 / (32 x warps_per_sm)); late_scales: 1 reads per-channel
    scales after the row sums, as kernels did before they were loaded ahead of the stream (for comparisons)."""

    warps: int
    rows_gated: int
    rows_down: int
    unroll: int
    warps_per_sm: int
    late_scales: int = 0

    def rows(self, gated: bool) -> int:
        return self.rows_gated if gated else self.rows_down


DECODE_SHAPE = LaunchShape(WARPS, ROWS_GATED, ROWS_DOWN, UNROLL, WARPS * DECODE_BLOCKS_PER_SM)




def _quad_decoder(code: int):
    """Device fn (raw, i, q) -> the 4 float32 values of quad q (values 4q..4q+3) of chunk raw[i, :4]."""
    if code == CODE_INT8:

        @cuda.jit(device=True, inline=True)
        def quad(raw, i, q):
            return int8x4(raw[i, q])

    elif code == CODE_FP8:

        @cuda.jit(device=True, inline=True)
        def quad(raw, i, q):
            return fp8x4(raw[i, q])

    elif code == CODE_F32:

        @cuda.jit(device=True, inline=True)
        def quad(raw, i, q):
            return u32_as_f32(raw[i, 0]), u32_as_f32(raw[i, 1]), u32_as_f32(raw[i, 2]), u32_as_f32(raw[i, 3])

    elif code == CODE_BF16:

        @cuda.jit(device=True, inline=True)
        def quad(raw, i, q):
            a, b, top = raw[i, 2 * q], raw[i, 2 * q + 1], np.uint32(0xFFFF0000)
            return (
                u32_as_f32(a << np.uint32(16)),
                u32_as_f32(a & top),
                u32_as_f32(b << np.uint32(16)),
                u32_as_f32(b & top),
            )

    else:

        @cuda.jit(device=True, inline=True)
        def quad(raw, i, q):
            a, b, low = raw[i, 2 * q], raw[i, 2 * q + 1], np.uint32(0xFFFF)
            return (
                f16_to_f32(a & low),
                f16_to_f32(a >> np.uint32(16)),
                f16_to_f32(b & low),
                f16_to_f32(b >> np.uint32(16)),
            )

    return quad


@functools.cache
def _expert_body(
    code: int, scheme: int, gated: bool, tokens: int, shape: LaunchShape, accumulate: bool = False, mode: int = 0
):
    """Device fn computing this warp's rows of one expert whose weights are dtype `code` with scale `scheme`,
    gate/up (gated) or down, `tokens` per pass, rows spread as `shape` says (the kernel's arguments, plus the
    expert e, its block and its positions [start, end)). accumulate (down only): out += the sums instead of =.
    mode: x is loaded coherently in a waiting variant (kernels/programmatic.py)."""
    ld_x = programmatic.activation_load(mode)
    rows = shape.rows(gated)
    warps = shape.warps
    nw = 2 * rows if gated else rows  # weight rows one warp streams
    quads = 4 // element_bytes(code)  # 4-value quads per 16-byte chunk
    vals = 4 * quads  # values per chunk
    nb = element_bytes(code)
    unroll = shape.unroll if tokens == 1 else 1  # a token tile reuses each load `tokens` times: registers go to x and sums
    n_raw = nw * unroll
    quad = _quad_decoder(code)
    # channel scales loaded before the stream, in flight with the weights (read after the row sums they are one
    # more round trip, often to HBM: the scales are cold); fp8's one-token gate|up is at its 128-register bound
    # (kernel_bounds) and would spill them, so it reads them in the epilogue
    fp8_gate_up_token = code == CODE_FP8 and gated and tokens == 1
    early_scales = scheme == SCALE_CHANNEL and not shape.late_scales and not fp8_gate_up_token

    @cuda.jit(device=True, inline=True)
    def chunk_step(src, xrow, n_in, words, scales, roff, sidx, c0, end, checked, raw, factor, xq, part, acc):
        """Chunks c0 + 32u (u < unroll) of the warp's nw rows times `tokens` x rows into acc [nw, tokens]. Every
        weight load (and block scale) is issued before the first FMA; checked (constant at each call site):
        chunks at or past `end` count as zeros, only in the last partial step."""
        for u in range(unroll):
            c = c0 + u * WARP
            for i in range(nw):
                k = i * unroll + u
                if not checked or c < end:
                    raw[k, 0], raw[k, 1], raw[k, 2], raw[k, 3] = ld_stream_v4(words, roff[i] + c * WORDS)
                    f = np.float32(1.0)
                    if scheme == SCALE_BLOCK:
                        f = scales[sidx[i] + ((c * vals) >> BLOCK_SHIFT)]  # c >= 0: a shift, not floor division
                    factor[k] = f
                else:
                    for j in range(WORDS):
                        raw[k, j] = np.uint32(0)
                    factor[k] = np.float32(0.0)
        for u in range(unroll):
            c = c0 + u * WARP
            ok = not checked or c < end
            for i in range(nw):
                for t in range(tokens):
                    part[i, t] = np.float32(0.0)
            for q in range(quads):
                for t in range(tokens):
                    if ok:
                        xq[t, 0], xq[t, 1], xq[t, 2], xq[t, 3] = ld_x(src, xrow[t] * n_in + c * vals + 4 * q)
                    else:
                        for j in range(4):
                            xq[t, j] = np.float32(0.0)
                for i in range(nw):
                    w0, w1, w2, w3 = quad(raw, i * unroll + u, q)
                    for t in range(tokens):
                        part[i, t] += w0 * xq[t, 0] + w1 * xq[t, 1] + w2 * xq[t, 2] + w3 * xq[t, 3]
            for i in range(nw):
                for t in range(tokens):
                    acc[i, t] += factor[i * unroll + u] * part[i, t]

    @cuda.jit(device=True, inline=True)
    def body(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out):
        """lay: the expert's byte offsets in its block (gate/up: gate rows, up rows, gate scales, up scales; down:
        rows, 0, scales, 0)."""
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        base = block * stride
        roff = cuda.local.array(nw, np.int64)  # word offset of each weight row
        sidx = cuda.local.array(nw, np.int64)  # float index of its channel scale, or of its first block scale
        raw = cuda.local.array((n_raw, WORDS), np.uint32)
        factor = cuda.local.array(n_raw, np.float32)
        xq = cuda.local.array((tokens, 4), np.float32)
        part = cuda.local.array((nw, tokens), np.float32)
        acc = cuda.local.array((nw, tokens), np.float32)
        xrow = cuda.local.array(tokens, np.int64)
        chan = cuda.local.array(nw, np.float32)  # each row's channel scale (early_scales)
        n_cb = (n_in + SCALE_BLOCK_SIZE - 1) // SCALE_BLOCK_SIZE
        row0 = (cuda.blockIdx.y * warps + warp) * rows
        for i in range(nw):
            m = 0 if i < rows else 1  # gate (or down), up
            row = min(row0 + i % rows, n_rows - 1)  # rows past the end re-read the last row, never written
            roff[i] = (base + lay[m] + row * n_in * nb) // 4
            s0 = (base + lay[2 + m]) // 4
            sidx[i] = s0 + row if scheme == SCALE_CHANNEL else s0 + (row // SCALE_BLOCK_SIZE) * n_cb
            if early_scales:
                chan[i] = scales[sidx[i]]
        n_chunks = n_in // vals
        step = WARP * unroll
        full = n_chunks // step * step
        for p0 in range(start, end, tokens):
            ntok = min(tokens, end - p0)
            for t in range(tokens):
                p = p0 + min(t, ntok - 1)
                if by_slot != 0:
                    xrow[t] = 0 if gated else p
                else:
                    xrow[t] = order[p] // top_k if gated else p
                for i in range(nw):
                    acc[i, t] = np.float32(0.0)
            for c0 in range(lane, full, step):
                chunk_step(src, xrow, n_in, words, scales, roff, sidx, c0, n_chunks, False, raw, factor, xq, part, acc)
            if full < n_chunks:
                last = full + lane
                chunk_step(src, xrow, n_in, words, scales, roff, sidx, last, n_chunks, True, raw, factor, xq, part, acc)
            for i in range(nw):
                for t in range(tokens):
                    acc[i, t] = warp_sum(acc[i, t])
            if lane == 0:
                for r in range(rows):
                    row = row0 + r
                    for t in range(tokens):
                        if t < ntok and row < n_rows:
                            a = acc[r, t]
                            if scheme == SCALE_CHANNEL:
                                a *= chan[r] if early_scales else scales[sidx[r]]
                            if gated:
                                b = acc[rows + r, t]
                                if scheme == SCALE_CHANNEL:
                                    b *= chan[rows + r] if early_scales else scales[sidx[rows + r]]
                                out[p0 + t, row] = silu(a) * b
                            elif accumulate:
                                out[p0 + t, row] += a
                            else:
                                out[p0 + t, row] = a

    return body


@cuda.jit(device=True, inline=True)
def _absent(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out):
    return


@functools.cache
def _kernel(
    kinds: tuple[tuple[int, int], ...],
    gated: bool,
    tokens: int,
    shape: LaunchShape = DECODE_SHAPE,
    accumulate: bool = False,
    mode: int = 0,
):
    """(python kernel, jitted kernel) for a layer whose experts have the (code, scheme) pairs `kinds`, gate/up
    (gated) or down, `tokens` per pass, rows spread as `shape` says; accumulate: down adds into out (linear_q8's
    projections that end in the residual); mode: the programmatic-launch variant (kernels/programmatic.py)."""
    if accumulate and gated:
        raise ValueError("accumulate is for the down projection (gate/up writes h)")
    # one branch per encoding, in ALL_KINDS order: the layer's kinds get their body, the others an empty one
    # (a branch on values uniform over the block; registers are the largest body's)
    bodies = [_expert_body(*k, gated, tokens, shape, accumulate, mode) if k in kinds else _absent for k in ALL_KINDS]
    prologue = programmatic.prologue(mode)
    m0 = 0 if gated else 2  # the meta fields of the matrix the launch reads first: gate (then up), or down
    # a layout given at launch stands for the kernel's one encoding; a kernel of several never gets one
    given_code, given_scheme = kinds[0] if len(kinds) == 1 else (-1, -1)
    body0, body1, body2, body3, body4, body5, body6 = bodies
    (c0, s0), (c1, s1), (c2, s2), (c3, s3), (c4, s4), (c5, s5), (c6, s6) = ALL_KINDS

    def kernel(
        src, order, offsets, ids, by_slot, words, scales, meta, stride, n_rows, n_in, top_k, slot_of, use_slots, out,
        layout,
    ):
        """src: x [T, D] (gate_up) or h [n, F] (down) as flat float32; order [n] int32 and offsets [E+1] int32
        (grouped; unused by slot); ids [K] int32 (by slot; unused otherwise); by_slot: 1 = by slot (slot s runs
        expert ids[s]), 2 = slot s runs expert s (ids unread), 0 = grouped. words: the layer's expert buffer
        [E, stride] as flat uint32; scales: the same bytes as flat float32; meta [E, META_WIDTH] int32; stride:
        bytes per expert; n_rows / n_in: output rows and input values of the matrix (F, D for gate_up; D, F for
        down); slot_of [E] int32, read when use_slots != 0: expert e's block is block slot_of[e] of the buffer
        (the expert cache's slots; < 0: not computed, its rows untouched), its meta still meta[e]; else block
        e. out [n, n_rows] float32. layout: 4 int64, the byte offsets every expert of the layer shares, as
        `launch_layout` gives them (the kernel's one encoding, no meta read), or layout[0] < 0: each expert's
        meta row read on the device. Grid (slots or E, row blocks), shape.warps * 32 threads."""
        prologue()
        s_id = cuda.blockIdx.x
        if by_slot != 0:
            e = ids[s_id] if by_slot == 1 else s_id
            start = s_id
            end = s_id + 1
        else:
            e = s_id
            start = offsets[e]
            end = offsets[e + 1]
        block = e
        if use_slots != 0:
            block = slot_of[e]
        if start >= end or block < 0:
            return  # the whole block leaves before any barrier
        if layout[0] >= 0:  # known at launch: the weights' addresses wait on no load but the expert's id
            code, scheme, lay = given_code, given_scheme, layout
        else:  # the meta row's fields read together, one round trip before the weights stream
            code, scheme = meta[e, 0], meta[e, 1]
            lay = (
                np.int64(meta[e, 2 + m0]),
                np.int64(meta[e, 3]) if gated else np.int64(0),
                np.int64(meta[e, 5 + m0]),
                np.int64(meta[e, 6]) if gated else np.int64(0),
            )
        if code == c0 and scheme == s0:
            body0(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out)
        elif code == c1 and scheme == s1:
            body1(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out)
        elif code == c2 and scheme == s2:
            body2(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out)
        elif code == c3 and scheme == s3:
            body3(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out)
        elif code == c4 and scheme == s4:
            body4(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out)
        elif code == c5 and scheme == s5:
            body5(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out)
        elif code == c6 and scheme == s6:
            body6(e, block, start, end, src, order, by_slot, words, scales, lay, stride, n_rows, n_in, top_k, out)

    return kernel, programmatic.compiled(kernel, mode, launch_bounds=kernel_bounds(kinds, tokens, shape))


def check_layer(experts, meta, F: int, D: int, slot_of=None, kinds=None) -> tuple[tuple[int, int], ...]:
    """Checks the layer's arrays (also moe_q8_dp4a's launchers'); returns the (code, scheme) variants to launch
    (default every one)."""
    if experts.ndim != 2 or np.dtype(experts.dtype) != np.uint8 or experts.shape[1] % 16:
        raise ValueError(
            f"experts must be uint8 [E, stride] with stride % 16 == 0, got {experts.dtype} {experts.shape}"
        )
    check_array("experts", experts, experts.shape, np.uint8)
    E = experts.shape[0] if slot_of is None else slot_of.shape[0]  # with slots, experts holds [S, stride]
    check_array("meta", meta, (E, META_WIDTH), np.int32)
    if slot_of is not None:
        check_array("slot_of", slot_of, (E,), np.int32)
    if F % MIN_DIM or D % MIN_DIM or F <= 0 or D <= 0:
        raise ValueError(f"F={F} and D={D} must be positive multiples of {MIN_DIM} for 8-bit experts")
    if kinds is None:
        return ALL_KINDS
    wanted = tuple(sorted({(int(c), int(s)) for c, s in kinds}))
    if not wanted or any(k not in ALL_KINDS for k in wanted):
        raise ValueError(f"kinds {list(kinds)}: expected a non-empty subset of the (code, scheme) pairs {ALL_KINDS}")
    return wanted


def buffer_args(experts, meta) -> tuple:
    """A layer's expert buffer as the 8-bit kernels (here and moe_q8_dp4a's) take it: (words: flat uint32, scales:
    the same bytes as flat float32, meta, stride in bytes)."""
    flat = experts.reshape(experts.size)
    return flat.view(np.uint32), flat.view(np.float32), meta, experts.shape[1]


NO_LAYOUT = (-1, 0, 0, 0)  # the kernels' layout argument when each expert's meta row is read on the device


def launch_layout(layout: tuple[int, ...] | None, gated: bool, kinds: tuple) -> tuple[int, int, int, int]:
    """The kernels' layout argument for a launch given the layer's shared meta row (a host tuple,
    `expert_quant.shared_layout`) or None: gate/up takes the gate and up offsets and their scales', down its own.
    Refused in one line where the row is not one the launch's kernel can stand for."""
    if layout is None:
        return NO_LAYOUT
    if not isinstance(layout, tuple):
        raise TypeError(f"layout: a tuple of {META_WIDTH} ints (expert_quant.shared_layout), got {type(layout).__name__}")
    return _layout_offsets(layout, gated, tuple(kinds))


@functools.lru_cache(maxsize=1024)  # once per (row, launch kind), not on every eager launch
def _layout_offsets(layout: tuple[int, ...], gated: bool, kinds: tuple) -> tuple[int, int, int, int]:
    row = [int(v) for v in layout]
    if len(row) != META_WIDTH:
        raise ValueError(f"layout: a meta row of {META_WIDTH} values, got {len(row)}")
    if tuple(kinds) != ((row[0], row[1]),):
        raise ValueError(f"layout: its encoding {(row[0], row[1])} is not the launch's only one (kinds {list(kinds)})")
    m = 0 if gated else 2
    offsets = (row[2 + m], row[3] if gated else 0, row[5 + m], row[6] if gated else 0)
    rows_off, scales_off = offsets[:2], offsets[2:]
    if any(v < 0 for v in offsets) or any(v % CHUNK_BYTES for v in rows_off) or any(v % 4 for v in scales_off):
        raise ValueError(
            f"layout: offsets {offsets} must be >= 0, the rows' at multiples of {CHUNK_BYTES} bytes, the scales' of 4"
        )
    return offsets


def _launch(
    src, order, offsets, ids, experts, meta, n_rows, n_in, top_k, gated, out, stream, slot_of, kinds, shape,
    accumulate=False, layout=None, direct=False,
):
    """direct: one slot, running block 0 at position 0 (ids unread: a one-expert layer's single row)."""
    by_slot = ids is not None or direct
    slots = 1 if direct else ids.size if by_slot else offsets.shape[0] - 1
    dummy = meta.reshape(meta.size)[:1]
    grid = (slots, -(-n_rows // (shape.warps * shape.rows(gated))))
    args = (
        src.reshape(src.size),
        order if order is not None else dummy,
        offsets if offsets is not None else dummy,
        ids.reshape(ids.size) if ids is not None else dummy,
        2 if direct else int(by_slot),
        *buffer_args(experts, meta),
        n_rows,
        n_in,
        top_k,
        slot_of if slot_of is not None else dummy,
        int(slot_of is not None),
        out,
        launch_layout(layout, gated, kinds),
    )
    kernel = _kernel(kinds, gated, 1 if by_slot else TOK_TILE, shape, accumulate, programmatic.mode())[1]
    kernel[grid, shape.warps * WARP, stream](*args)


def launch_q8_gate_up(
    x, experts, meta, F: int, D: int, h, ids=None, order=None, offsets=None, stream=0, slot_of=None, kinds=None,
    shape: LaunchShape = DECODE_SHAPE, layout=None,
) -> None:
    """x [T, D] float32; experts uint8 [E, stride] (the layer's blocks); meta [E, META_WIDTH] int32 (device);
    h [n, F] float32. By slot: ids [1, K] int32 (T == 1, n == K). Grouped: order [n] int32 and offsets [E+1]
    int32 from expert_grouping (n == T*K). slot_of [E] int32 (device; the expert cache): experts is then the
    slot buffer uint8 [S, stride], expert e reads slot slot_of[e] with its meta row meta[e], and experts with
    slot_of[e] < 0 are skipped (their rows of h untouched: another wave computes them). kinds: the (code, scheme)
    pairs of the layer's experts (layer_kinds of the host meta, known when the model loads; one launch each);
    default every pair, right for any layer at the cost of a launch per absent one. An expert whose pair is not
    listed is not computed. shape: how the rows spread over warps and blocks (DECODE_SHAPE; other shapes are for
    bench/q8_kernels.py --q8-shapes). layout: the meta row every expert of the layer shares (host,
    `expert_quant.shared_layout`; the same values as meta's rows on the device), whose offsets then go in as launch
    arguments so the weights' addresses wait only on the expert's id; None: each expert's row read on the device."""
    kinds = check_layer(experts, meta, F, D, slot_of, kinds)
    E = meta.shape[0]
    T = x.shape[0]
    check_array("x", x, (T, D), np.float32)
    if ids is not None:
        if T != 1:
            raise ValueError(f"by-slot launches take one token, got x {list(x.shape)}")
        check_array("ids", ids, (1, ids.shape[1] if ids.ndim == 2 else 0), np.int32)
        n, top_k = ids.size, ids.size
    else:
        n = order.shape[0]
        check_array("order", order, (n,), np.int32)
        check_array("offsets", offsets, (E + 1,), np.int32)
        if n % T:
            raise ValueError(f"order length {n} is not a multiple of T={T}")
        top_k = n // T
    check_array("h", h, (n, F), np.float32)
    _launch(x, order, offsets, ids, experts, meta, F, D, top_k, True, h, stream, slot_of, kinds, shape, layout=layout)


def launch_q8_down(
    h, experts, meta, F: int, D: int, y, ids=None, offsets=None, stream=0, slot_of=None, kinds=None,
    shape: LaunchShape = DECODE_SHAPE, layout=None,
) -> None:
    """h [n, F] float32 (launch_q8_gate_up's output) -> y [n, D] float32 = h[p] @ down[e]^T, not yet weighted by
    the router. ids (by slot) or offsets (grouped), slot_of, kinds, shape and layout as in launch_q8_gate_up."""
    kinds = check_layer(experts, meta, F, D, slot_of, kinds)
    n = h.shape[0]
    check_array("h", h, (n, F), np.float32)
    check_array("y", y, (n, D), np.float32)
    if ids is not None:
        check_array("ids", ids, (1, n), np.int32)
    else:
        check_array("offsets", offsets, (meta.shape[0] + 1,), np.int32)
    _launch(h, None, offsets, ids, experts, meta, D, F, 1, False, y, stream, slot_of, kinds, shape, layout=layout)


# The kernels the sm_90 compile check builds (each path compiles in seconds): every 8-bit encoding alone at
# decode (gate/up and down), the grouped ones of the two common checkpoint encodings, and two mixed layers that
# between them hold every unquantized path (those only occur in mixed layers; all seven bodies in one kernel
# compile in ~45 s, too slow for the suite).
EIGHT_BIT_KINDS = ALL_KINDS[:4]
SM90_VARIANTS = tuple(
    [((k,), g, 1) for k in EIGHT_BIT_KINDS for g in (True, False)]
    + [((k,), g, TOK_TILE) for k in ((CODE_INT8, SCALE_CHANNEL), (CODE_FP8, SCALE_BLOCK)) for g in (True, False)]
    + [(((CODE_FP8, SCALE_CHANNEL),), False, TOK_TILE)]  # linear_q8's fp8 LM head over several rows
    + [(((CODE_INT8, SCALE_CHANNEL), (CODE_F16, SCALE_NONE)), True, 1)]
    + [(((CODE_FP8, SCALE_BLOCK), (CODE_BF16, SCALE_NONE), (CODE_F32, SCALE_NONE)), False, TOK_TILE)]
)
# linear_q8 adding into the residual (8-bit attention's o_proj), one token and a token tile: (kinds, tokens)
SM90_ACCUMULATE = tuple(
    (((code, SCALE_CHANNEL),), tokens) for code in (CODE_INT8, CODE_FP8) for tokens in (1, TOK_TILE)
)


def kernel_bounds(kinds, tokens: int, shape: LaunchShape = DECODE_SHAPE) -> tuple[int, int]:
    """Launch bounds of a layer's kernel (threads, blocks per SM): decode bodies fit 128 registers alone and
    without block scales (DECODE_SHAPE); block-scale factors, or several bodies in one kernel (their live ranges
    meet at the dispatch), spill there and get a block less; token tiles TILE_BLOCKS_PER_SM blocks of WARPS warps."""
    threads = shape.warps * WARP
    if tokens > 1:
        return threads, max(1, TILE_BLOCKS_PER_SM * WARPS // shape.warps)
    blocks = max(1, shape.warps_per_sm // shape.warps)
    alone = len(kinds) == 1 and kinds[0][1] != SCALE_BLOCK
    return threads, blocks if alone else max(1, blocks - 1)


def sm90_signature():
    """The numba signature every kernel takes."""
    f1, f2, i1, i64 = types.float32[::1], types.float32[:, ::1], types.int32[::1], types.int64
    layout = types.UniTuple(i64, 4)
    return (f1, i1, i1, i1, i64, types.uint32[::1], f1, types.int32[:, ::1], i64, i64, i64, i64, i1, i64, f2, layout)


def sm90_signatures():
    """(python function, numba signature, compile options) of the kernels for the sm_90 compile check."""
    stored = [
        (_kernel(kinds, gated, tokens)[0], sm90_signature(), {"launch_bounds": kernel_bounds(kinds, tokens)})
        for kinds, gated, tokens in SM90_VARIANTS
    ]
    added = [
        (_kernel(kinds, False, tokens, accumulate=True)[0], sm90_signature(),
         {"launch_bounds": kernel_bounds(kinds, tokens)})
        for kinds, tokens in SM90_ACCUMULATE
    ]
    # the waiting variants of one-token int8 layers (experts and 8-bit attention's o_proj)
    waiting = [
        (_kernel(kinds, gated, 1, accumulate=added, mode=programmatic.WAIT)[0], sm90_signature(),
         {"launch_bounds": kernel_bounds(kinds, 1)})
        for kinds, gated, added in ((((CODE_INT8, SCALE_CHANNEL),), True, False),
                                    (((CODE_INT8, SCALE_CHANNEL),), False, False),
                                    (((CODE_INT8, SCALE_CHANNEL),), False, True))
    ]
    return stored + added + waiting
