"""One-token steps (decode) of a layer whose experts are int8 with per-channel scales, on int8 activations: the
token's x and each expert's SwiGLU row are quantized to int8 per row as the kernels read them, and the dot products
run on dp4a (four int8 products in one 32-bit integer instruction). moe_q8 widens every weight byte to float32
instead (a prmt, a subtraction and an FMA per value), three times bf16's arithmetic per byte, which held its int8
decode below bf16's fraction of the HBM roofline; here a 16-byte chunk of a weight row costs four dp4a, and the
quantization of the activations is shared by the warp's weight rows.

Two launches by slot (grid.x = K: slot k runs expert ids[k] on the token, out row k; graph-capturable, no host
reads), THREADS threads a block, each warp ROWS_GATED gate rows and as many up rows (gate/up) or ROWS_DOWN rows:
  gate_up: each block takes m = max|x| over the token's row (L1-resident after an SM's first block), then
           h[k, f] = silu(sx sg[f] (q(x) . gate[e, f])) * (sx su[f] (q(x) . up[e, f]))       h [K, F] float32
           and writes the largest |h| of its rows to part_max[k, block] (a non-finite h counts as +inf);
  down:    each block reduces part_max[k, :] to m = max|h[k]|, then
           y[k, d] = sh sd[d] (q(h[k]) . down[e, d])                                         y [K, D] float32
with s = m / 127 (1 for an all-zero row, as common.quant; at least 2**-126) and q(v) = v * (1 / s) rounded to the
nearest integer, ties to even, from the exact product (one fma with 1.5 * 2**23: the low byte of its bits is the
int8 code, since |v| <= m keeps |q| <= 127). A row with a non-finite value gives NaN outputs (never silently
finite). Weight bytes stream as in moe_q8 (16-byte loads past L1, UNROLL chunks a row in flight before the first
dp4a). Sums are exact int32 per lane, float32 across the warp's lanes. Experts of another encoding are not computed
(meta is read on the device; the engine takes this path only for layers wholly int8 per channel). Through slots (the
expert cache's one-token steps), slot_of [E] names the block of the slot buffer [S, stride] holding expert e, its
meta row still meta[e]: the same arithmetic on the same bytes, so a cached step equals the resident one bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.expert_quant import CODE_INT8, SCALE_CHANNEL, dequantize
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.moe_q8 import buffer_args, check_layer
from expert_service.kernels.numeric import SIMULATOR, WARP, check_array, f32_as_u32, silu, warp_max, warp_sum
from expert_service.kernels.ptx import dp4a, ld_stream_v4, ld_v4, prmt_fn

WARPS = 1 if SIMULATOR else 4  # warps per block
THREADS = WARPS * WARP
ROWS_GATED = 2  # gate rows (and as many up rows) per warp: 4 weight rows streamed
ROWS_DOWN = 2 if SIMULATOR else 4  # down rows per warp
UNROLL = 1 if SIMULATOR else 2  # 16-byte chunks per row in flight per lane
BLOCKS_PER_SM = 4  # launch bounds, as moe_q8's decode: 16 warps of loads in flight an SM
CHUNK = 16  # int8 values per 16-byte chunk
INT8_MAX = np.float32(127.0)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it rounds |v| < 2**22 to an integer in the low mantissa bits
FLOAT_MAX = np.float32(np.finfo(np.float32).max)
SMALLEST_NORMAL = np.float32(np.finfo(np.float32).tiny)  # 2**-126: the smallest row scale (1 / it is finite)
_pair = prmt_fn(0x0040)  # [a.byte0, b.byte0, -, -]
_quad = prmt_fn(0x5410)  # [a.byte0, a.byte1, b.byte0, b.byte1]

if SIMULATOR:

    @cuda.jit(device=True)
    def _code_bits(v, inv):
        # the fma's single rounding of the exact product (float64 holds it exactly; rint rounds it to even once,
        # after which adding the magic number is exact)
        return f32_as_u32(np.float32(np.rint(float(v) * float(inv)) + float(_MAGIC)))

else:

    @cuda.jit(device=True, inline=True)
    def _code_bits(v, inv):
        return f32_as_u32(cuda.fma(v, inv, _MAGIC))


@cuda.jit(device=True, inline=True)
def quantize4(v0, v1, v2, v3, inv):
    """Four float32 values times inv -> their int8 codes packed in one word (v0 in byte 0)."""
    low = _pair(_code_bits(v0, inv), _code_bits(v1, inv))
    high = _pair(_code_bits(v2, inv), _code_bits(v3, inv))
    return _quad(low, high)


@cuda.jit(device=True, inline=True)
def magnitude(v):
    """|v|, +inf for NaN and infinities (max() drops NaN; this keeps a bad row visible)."""
    a = abs(v)
    return a if a <= FLOAT_MAX else np.float32(np.inf)


@cuda.jit(device=True, inline=True)
def block_max(value, partial):
    """The max of `value` over the block (every thread calls); partial: shared float32 [WARPS]."""
    m = warp_max(value)
    if cuda.threadIdx.x % WARP == 0:
        partial[cuda.threadIdx.x // WARP] = m
    cuda.syncthreads()
    m = partial[0]
    for w in range(1, WARPS):
        m = max(m, partial[w])
    cuda.syncthreads()  # partial is written again by the next call
    return m


@cuda.jit(device=True, inline=True)
def row_scale(m):
    """(s, 1 / s) of a row whose largest magnitude is m; s at least the smallest normal float32, so 1 / s stays
    finite (a row of subnormals keeps its values to that resolution instead of codes from an infinite 1 / s)."""
    s = max(m / INT8_MAX, SMALLEST_NORMAL) if m > 0 else np.float32(1.0)
    return s, np.float32(1.0) / s


@functools.cache
def weight_rows_fn(gated: bool, rows: int):
    """Device fn (meta, e, base, row0, n_rows, n_in, roff, sidx): the word offset of each of a warp's weight rows
    of expert e (block at byte `base`; gated: `rows` gate rows then as many up rows from row0, else `rows` down
    rows) into roff, the float index of its channel scale into sidx."""
    nw = 2 * rows if gated else rows

    @cuda.jit(device=True, inline=True)
    def weight_rows(meta, e, base, row0, n_rows, n_in, roff, sidx):
        for i in range(nw):
            which = (0 if i < rows else 1) if gated else 2  # gate, up, down
            row = min(row0 + i % rows, n_rows - 1)  # rows past the end re-read the last row, never written
            roff[i] = (base + meta[e, 2 + which] + row * n_in) // 4
            sidx[i] = (base + meta[e, 5 + which]) // 4 + row

    return weight_rows


@functools.cache
def _kernel(gated: bool):
    """(python kernel, jitted kernel): gate/up (gated) or down."""
    rows = ROWS_GATED if gated else ROWS_DOWN
    nw = 2 * rows if gated else rows  # weight rows a warp streams
    n_raw = nw * UNROLL  # a constant for the local array's shape
    weight_rows = weight_rows_fn(gated, rows)

    @cuda.jit(device=True, inline=True)
    def chunk_step(src, src0, inv, words, roff, c0, end, checked, raw, act, acc):
        """Chunks c0 + 32u (u < UNROLL) of the warp's nw rows against the quantized source chunks into acc [nw].
        Every weight load is issued before the first dp4a; checked (constant at each call site): chunks at or
        past `end` count as zeros, only in the last partial step."""
        for u in range(UNROLL):
            c = c0 + u * WARP
            for i in range(nw):
                j = i * UNROLL + u
                if not checked or c < end:
                    raw[j, 0], raw[j, 1], raw[j, 2], raw[j, 3] = ld_stream_v4(words, roff[i] + c * 4)
                else:
                    for w in range(4):
                        raw[j, w] = np.uint32(0)
        for u in range(UNROLL):
            c = c0 + u * WARP
            for q in range(4):
                if not checked or c < end:
                    v0, v1, v2, v3 = ld_v4(src, src0 + c * CHUNK + 4 * q)
                    act[u, q] = quantize4(v0, v1, v2, v3, inv)
                else:
                    act[u, q] = np.uint32(0)
            for i in range(nw):
                s = acc[i]
                for q in range(4):
                    s = dp4a(raw[i * UNROLL + u, q], act[u, q], s)
                acc[i] = s

    def kernel(src, part_max, ids, words, scales, meta, stride, n_rows, n_in, slot_of, use_slots, out):
        """src: x [1, D] (gate_up) or h [K, F] (down) as flat float32; part_max [K, G] float32, written (gate_up,
        G = its grid.y) or read (down); ids [K] int32; words / scales: the layer's expert buffer [E, stride] as
        flat uint32 / float32; meta [E, META_WIDTH] int32; stride: bytes per expert; n_rows / n_in: output rows
        and input values (F, D for gate_up; D, F for down); slot_of [E] int32, read when use_slots != 0: expert
        e's block is block slot_of[e] of the buffer (the expert cache's slots; < 0: not computed), its meta still
        meta[e]; out [K, n_rows] float32. Grid (K, row blocks)."""
        k = cuda.blockIdx.x
        e = ids[k]
        block = slot_of[e] if use_slots != 0 else e
        if block < 0 or meta[e, 0] != CODE_INT8 or meta[e, 1] != SCALE_CHANNEL:
            return  # uniform over the block: it leaves before any barrier
        tid = cuda.threadIdx.x
        lane, warp = tid % WARP, tid // WARP
        partial = cuda.shared.array(WARPS, np.float32)
        m = np.float32(0.0)
        if gated:  # max |x| over the token's row
            for j in range(4 * tid, n_in, 4 * THREADS):
                v0, v1, v2, v3 = ld_v4(src, j)
                m = max(m, magnitude(v0), magnitude(v1), magnitude(v2), magnitude(v3))
        else:  # max |h[k]| from the gate/up blocks' parts
            for j in range(tid, part_max.shape[1], THREADS):
                m = max(m, part_max[k, j])
        s, inv = row_scale(block_max(m, partial))
        src0 = 0 if gated else k * n_in
        base = block * stride
        roff = cuda.local.array(nw, np.int64)  # word offset of each weight row
        sidx = cuda.local.array(nw, np.int64)  # float index of its channel scale
        raw = cuda.local.array((n_raw, 4), np.uint32)
        act = cuda.local.array((UNROLL, 4), np.uint32)
        acc = cuda.local.array(nw, np.int32)
        row0 = (cuda.blockIdx.y * WARPS + warp) * rows
        weight_rows(meta, e, base, row0, n_rows, n_in, roff, sidx)
        for i in range(nw):
            acc[i] = np.int32(0)
        n_chunks = n_in // CHUNK
        step = WARP * UNROLL
        full = n_chunks // step * step
        for c0 in range(lane, full, step):
            chunk_step(src, src0, inv, words, roff, c0, n_chunks, False, raw, act, acc)
        if full < n_chunks:
            chunk_step(src, src0, inv, words, roff, full + lane, n_chunks, True, raw, act, acc)
        finite = s <= FLOAT_MAX
        top = np.float32(0.0)
        for r in range(rows):
            a = warp_sum(np.float32(acc[r])) * s * scales[sidx[r]]
            if gated:
                b = warp_sum(np.float32(acc[rows + r])) * s * scales[sidx[rows + r]]
                a = silu(a) * b
            if not finite:
                a = np.float32(np.nan)
            row = row0 + r
            if lane == 0 and row < n_rows:
                out[k, row] = a
                top = max(top, magnitude(a))
        if gated:
            top = block_max(top, partial)
            if tid == 0:
                part_max[k, cuda.blockIdx.y] = top

    return kernel, cached_jit(kernel, launch_bounds=(THREADS, BLOCKS_PER_SM))


def row_blocks(n_rows: int, gated: bool) -> int:
    """Blocks of a launch's grid.y here and in moe_q8_dp4a_grouped: each covers WARPS warps of their rows."""
    return -(-n_rows // (WARPS * (ROWS_GATED if gated else ROWS_DOWN)))


def gate_up_parts(F: int) -> int:
    """Row blocks of a gate/up launch: the width of its part_max rows."""
    return row_blocks(F, True)


def _check_slots(ids, experts, meta, F: int, D: int, slot_of) -> int:
    """moe_q8.check_layer and the slot ids; returns K."""
    check_layer(experts, meta, F, D, slot_of)
    K = ids.shape[1] if ids.ndim == 2 else 0
    check_array("ids", ids, (1, K), np.int32)
    if K < 1:  # an empty grid is a launch error on the device
        raise ValueError("ids must hold at least one expert id, got [1, 0]")
    return K


def _launch(gated, src, part_max, ids, experts, meta, n_rows, n_in, out, stream, slot_of):
    grid = (ids.size, row_blocks(n_rows, gated))
    slots = slot_of if slot_of is not None else ids.reshape(ids.size)  # unread without slots
    args = (src.reshape(src.size), part_max, ids.reshape(ids.size), *buffer_args(experts, meta), n_rows, n_in)
    _kernel(gated)[1][grid, THREADS, stream](*args, slots, int(slot_of is not None), out)


def launch_dp4a_gate_up(x, ids, experts, meta, F: int, D: int, h, part_max, stream=0, slot_of=None) -> None:
    """x [1, D] float32 (the token); ids [1, K] int32 (device); experts uint8 [E, stride] (the layer's blocks);
    meta [E, META_WIDTH] int32 (device); h [K, F] float32 out; part_max [K, gate_up_parts(F)] float32 out (the
    down launch's input scales). slot_of [E] int32 (device; the expert cache): experts is then the slot buffer
    uint8 [S, stride], expert e reads slot slot_of[e] with its meta row meta[e]; slot k of an expert with
    slot_of[e] < 0 is skipped (its rows of h and part_max untouched)."""
    K = _check_slots(ids, experts, meta, F, D, slot_of)
    check_array("x", x, (1, D), np.float32)
    check_array("h", h, (K, F), np.float32)
    check_array("part_max", part_max, (K, gate_up_parts(F)), np.float32)
    _launch(True, x, part_max, ids, experts, meta, F, D, h, stream, slot_of)


def launch_dp4a_down(h, part_max, ids, experts, meta, F: int, D: int, y, stream=0, slot_of=None) -> None:
    """h [K, F] float32 and part_max [K, gate_up_parts(F)] float32 (launch_dp4a_gate_up's outputs) -> y [K, D]
    float32 = h[k] @ down[ids[k]]^T with h[k] through int8, not yet weighted by the router. slot_of as in
    launch_dp4a_gate_up (the same map: rows it skipped are skipped here too)."""
    K = _check_slots(ids, experts, meta, F, D, slot_of)
    check_array("h", h, (K, F), np.float32)
    check_array("part_max", part_max, (K, gate_up_parts(F)), np.float32)
    check_array("y", y, (K, D), np.float32)
    _launch(False, h, part_max, ids, experts, meta, D, F, y, stream, slot_of)


def quantize_row_reference(v: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """A finite float32 row -> (int8 codes, scale) as the kernels quantize it (module docstring)."""
    v = np.asarray(v, np.float32)
    m = np.abs(v).max(initial=np.float32(0.0))
    s = np.float32(max(np.float32(m / INT8_MAX), SMALLEST_NORMAL)) if m > 0 else np.float32(1.0)
    inv = np.float32(np.float32(1.0) / s)
    return np.rint(v.astype(np.float64) * np.float64(inv)).astype(np.int8), s


def through_int8(rows: np.ndarray) -> np.ndarray:
    """rows [n, width] float32 -> float64 [n, width]: each row quantized as the kernels quantize it, then decoded."""
    out = []
    for row in np.asarray(rows, np.float32):
        codes, s = quantize_row_reference(row)
        out.append(codes.astype(np.float64) * np.float64(s))
    return np.stack(out)


def dp4a_swiglu_reference(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """One expert's SwiGLU MLP with these kernels' roundings (the cpu backend's swiglu_mlp otherwise): each row
    of x [n, D] through int8, h = silu(x gate^T) * (x up^T) through int8, then h down^T -> float32 [n, D]."""
    xs = through_int8(x)
    g = xs @ np.asarray(gate, np.float64).T
    h = (g / (1.0 + np.exp(-g)) * (xs @ np.asarray(up, np.float64).T)).astype(np.float32)
    return (through_int8(h) @ np.asarray(down, np.float64).T).astype(np.float32)


def dp4a_reference(x, ids, blocks, meta, F: int, D: int, h=None) -> tuple[np.ndarray, np.ndarray]:
    """x [1, D] float32, ids [K], blocks / meta as the launchers' (host) -> (h [K, F], y [K, D]) in float64, the
    weights exactly q x scale; y from `h` (the kernel's own, isolating the down launch) when given, else from the
    reference's h."""
    xs = through_int8(x[:1])[0]
    hs, ys = [], []
    for k, e in enumerate(np.asarray(ids).reshape(-1)):
        gate, up, down = (w.astype(np.float64) for w in dequantize(blocks[e], meta[e], F, D))
        g = gate @ xs
        h_ref = g / (1.0 + np.exp(-g)) * (up @ xs)
        hs.append(h_ref)
        ys.append(down @ through_int8((h[k] if h is not None else h_ref)[None])[0])
    return np.stack(hs), np.stack(ys)


def sm90_signatures():
    """(python function, numba signature, compile options) of both kernels for the sm_90 compile check."""
    f1, f2, i1, i64 = types.float32[::1], types.float32[:, ::1], types.int32[::1], types.int64
    sig = (f1, f2, i1, types.uint32[::1], f1, types.int32[:, ::1], i64, i64, i64, i1, i64, f2)
    return [(_kernel(gated)[0], sig, {"launch_bounds": (THREADS, BLOCKS_PER_SM)}) for gated in (True, False)]
