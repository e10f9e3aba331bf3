"""Routed experts on 8-bit (or mixed-dtype) weights, dequantised in registers: the SwiGLU gate/up and the down
projection for a layer whose experts are int8 / fp8 e4m3 with float32 scales, bf16 or fp16, one dtype per
expert (expert_quant: the block layout, `meta` and the numpy reference `expert_quant.expert_ffn`).

Two launches per layer, two ways to find an expert's tokens (both graph-capturable, no host reads):
  by slot (decode, one token): grid.x = K slots, slot k runs expert ids[k] on the token (row 0 of x); out row k.
  grouped: grid.x = E, expert e runs the grouped positions p in [offsets[e], offsets[e+1]) (expert_grouping), the
           input row of p being order[p] // K (gate/up) or p (down); out row p. Experts without tokens return.
  through slots (the expert cache, either way): slot_of [E] int32 names the block of the slot buffer [S, stride]
           that holds expert e (its meta row is still meta[e]); experts with slot_of[e] < 0 return at once.
  gate_up: h[p, f] = silu(x . gate[e, f]) * (x . up[e, f])       h [n, F] float32
  down:    y[p, d] = h[p] . down[e, d]                           y [n, D] float32

At decode every weight byte is used once, so the kernel is an HBM stream of 8-bit words: a warp owns ROWS output
rows (gated: ROWS gate and ROWS up rows), each lane reads 16-byte chunks of its rows (16 int8/fp8, 8 bf16/fp16 or 4 float32
values) with the streaming load, widens them to float32 in registers (int8 and e4m3 by bit arithmetic, no
table) and multiplies by up to TOK_TILE tokens' x values (L1-cached: every warp of the expert reads the same x).
Scales: a per-channel scale multiplies the row's sum once; a 128x128 block scale multiplies each chunk (a chunk
never straddles a block). Sums are float32, reduced over the warp with shuffles.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.expert_quant import (
    CHUNK_BYTES,
    CODE_BF16,
    CODE_F16,
    CODE_F32,
    META_WIDTH,
    SCALE_BLOCK,
    SCALE_BLOCK_SIZE,
    SCALE_CHANNEL,
    byte_at,
)
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR, WARP, f16_to_f32, silu, u32_as_f32, warp_sum
from expert_service.kernels.ptx import ld_stream_v4

WARPS = 1 if SIMULATOR else 4  # warps per block, each owning ROWS rows
ROWS = 2  # output rows per warp (x reuse across rows)
TOK_TILE = 2 if SIMULATOR else 4  # tokens per pass over an expert's rows (more tokens: more passes)
ROWS_PER_BLOCK = WARPS * ROWS
MIN_DIM = 16  # D and F are multiples of this: whole 16-byte chunks of 8-bit rows


@functools.cache
def _kernel(gated: bool):
    nw = 2 * ROWS if gated else ROWS  # weight rows one warp streams

    @cuda.jit(device=True, inline=True)
    def decode_chunk(words, off, code, factor, wv, i):
        """The 16-byte chunk at word `off` into wv[i, :16 or :8] as float32 times `factor`."""
        a, b, c, d = ld_stream_v4(words, off)
        if code == CODE_F32:
            wv[i, 0] = u32_as_f32(a) * factor
            wv[i, 1] = u32_as_f32(b) * factor
            wv[i, 2] = u32_as_f32(c) * factor
            wv[i, 3] = u32_as_f32(d) * factor
        elif code == CODE_BF16 or code == CODE_F16:
            for q in range(4):
                w = a if q == 0 else (b if q == 1 else (c if q == 2 else d))
                if code == CODE_BF16:
                    lo = u32_as_f32(w << np.uint32(16))
                    hi = u32_as_f32(w & np.uint32(0xFFFF0000))
                else:
                    lo = f16_to_f32(w & np.uint32(0xFFFF))
                    hi = f16_to_f32(w >> np.uint32(16))
                wv[i, 2 * q] = lo * factor
                wv[i, 2 * q + 1] = hi * factor
        else:
            for q in range(4):
                w = a if q == 0 else (b if q == 1 else (c if q == 2 else d))
                for j in range(4):
                    wv[i, 4 * q + j] = byte_at(w, j, code) * factor

    def make_pass(ntok):
        @cuda.jit(device=True, inline=True)
        def tile_pass(src, xrow, words, scales, roff, soff, rows_of, code, scheme, n_in, lane, acc):
            """Adds this lane's chunks of the warp's nw rows times ntok tokens' x into acc [nw, TOK_TILE]."""
            wv = cuda.local.array((nw, 16), np.float32)
            s = cuda.local.array(nw, np.float32)
            vals = 4 if code == CODE_F32 else (8 if code == CODE_BF16 or code == CODE_F16 else 16)
            n_chunks = n_in // vals
            n_cb = (n_in + SCALE_BLOCK_SIZE - 1) // SCALE_BLOCK_SIZE
            for c in range(lane, n_chunks, WARP):
                i0 = c * vals
                for i in range(nw):
                    factor = np.float32(1.0)
                    if scheme == SCALE_BLOCK:
                        factor = scales[soff[i] + (rows_of[i] // SCALE_BLOCK_SIZE) * n_cb + i0 // SCALE_BLOCK_SIZE]
                    decode_chunk(words, roff[i] + c * (CHUNK_BYTES // 4), code, factor, wv, i)
                for t in range(ntok):
                    r = xrow[t]
                    for i in range(nw):
                        s[i] = np.float32(0.0)
                    for v in range(16):
                        if v < vals:
                            xv = src[r, i0 + v]
                            for i in range(nw):
                                s[i] += wv[i, v] * xv
                    for i in range(nw):
                        acc[i, t] += s[i]

        return tile_pass

    pass_one, pass_tile = make_pass(1), make_pass(TOK_TILE)

    def kernel(
        src, order, offsets, ids, by_slot, words, scales, meta, stride, n_rows, n_in, top_k, slot_of, use_slots, out
    ):
        """src: x [T, D] (gate_up) or h [n, F] (down) float32; order [n] int32 and offsets [E+1] int32 (grouped;
        unused by slot); ids [K] int32 (by slot; unused grouped); by_slot: 1 = by slot, 0 = grouped.
        words: the layer's expert buffer [E, stride] as flat uint32; scales: the same bytes as flat float32;
        meta [E, META_WIDTH] int32; stride: bytes per expert; n_rows / n_in: output rows and input values of the
        matrix (F, D for gate_up; D, F for down); slot_of [E] int32, read when use_slots != 0: expert e's
        block is block slot_of[e] of the buffer (the expert cache's slots; < 0: not computed, its rows
        untouched), its meta still meta[e]; else block e. out [n, n_rows] float32. Grid (slots or E, row blocks),
        WARPS * 32 threads."""
        s_id = cuda.blockIdx.x
        if by_slot != 0:
            e = ids[s_id]
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
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        code = meta[e, 0]
        scheme = meta[e, 1]
        base = block * stride
        roff = cuda.local.array(nw, np.int64)  # word offset of each weight row
        soff = cuda.local.array(nw, np.int64)  # float offset of each row's scale tensor
        rows_of = cuda.local.array(nw, np.int64)
        acc = cuda.local.array((nw, TOK_TILE), np.float32)
        xrow = cuda.local.array(TOK_TILE, np.int64)
        nb = 4 if code == CODE_F32 else (2 if code == CODE_BF16 or code == CODE_F16 else 1)
        row0 = (cuda.blockIdx.y * WARPS + warp) * ROWS
        for i in range(nw):
            m = (0 if i < ROWS else 1) if gated else 2  # gate, up, down
            row = min(row0 + i % ROWS, n_rows - 1)  # rows past the end re-read the last row, never written
            rows_of[i] = row
            roff[i] = (base + meta[e, 2 + m] + row * n_in * nb) // 4
            soff[i] = (base + meta[e, 5 + m]) // 4
        for p0 in range(start, end, TOK_TILE):
            ntok = min(TOK_TILE, end - p0)
            for t in range(TOK_TILE):
                p = p0 + min(t, ntok - 1)
                if by_slot != 0:
                    xrow[t] = 0 if gated else p
                else:
                    xrow[t] = order[p] // top_k if gated else p
                for i in range(nw):
                    acc[i, t] = np.float32(0.0)
            if ntok == 1:
                pass_one(src, xrow, words, scales, roff, soff, rows_of, code, scheme, n_in, lane, acc)
            else:
                pass_tile(src, xrow, words, scales, roff, soff, rows_of, code, scheme, n_in, lane, acc)
            for t in range(TOK_TILE):
                for i in range(nw):
                    acc[i, t] = warp_sum(acc[i, t])
            if lane == 0:
                for r in range(ROWS):
                    row = row0 + r
                    for t in range(TOK_TILE):
                        if t < ntok and row < n_rows:
                            a = acc[r, t]
                            if scheme == SCALE_CHANNEL:
                                a *= scales[soff[r] + row]
                            if gated:
                                b = acc[ROWS + r, t]
                                if scheme == SCALE_CHANNEL:
                                    b *= scales[soff[ROWS + r] + row]
                                out[p0 + t, row] = silu(a) * b
                            else:
                                out[p0 + t, row] = a

    return kernel, cached_jit(kernel)


def _check(name, a, shape, dtype):
    if a.shape != tuple(shape) or np.dtype(a.dtype) != np.dtype(dtype) or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(
            f"{name} must be C-contiguous {np.dtype(dtype).name} {list(shape)}, got {a.dtype} {list(a.shape)}"
        )


def _check_layer(experts, meta, F: int, D: int, slot_of=None) -> None:
    if experts.ndim != 2 or np.dtype(experts.dtype) != np.uint8 or experts.shape[1] % 16:
        raise ValueError(
            f"experts must be uint8 [E, stride] with stride % 16 == 0, got {experts.dtype} {experts.shape}"
        )
    _check("experts", experts, experts.shape, np.uint8)
    E = experts.shape[0] if slot_of is None else slot_of.shape[0]  # with slots, experts holds [S, stride]
    _check("meta", meta, (E, META_WIDTH), np.int32)
    if slot_of is not None:
        _check("slot_of", slot_of, (E,), np.int32)
    if F % MIN_DIM or D % MIN_DIM or F <= 0 or D <= 0:
        raise ValueError(f"F={F} and D={D} must be positive multiples of {MIN_DIM} for 8-bit experts")


def _launch(src, order, offsets, ids, experts, meta, n_rows, n_in, top_k, gated, out, stream, slot_of=None) -> None:
    by_slot = ids is not None
    slots = ids.size if by_slot else offsets.shape[0] - 1
    flat = experts.reshape(experts.size)
    dummy = meta.reshape(meta.size)[:1]
    grid = (slots, -(-n_rows // ROWS_PER_BLOCK))
    _kernel(gated)[1][grid, WARPS * WARP, stream](
        src,
        order if order is not None else dummy,
        offsets if offsets is not None else dummy,
        ids.reshape(ids.size) if by_slot else dummy,
        int(by_slot),
        flat.view(np.uint32),
        flat.view(np.float32),
        meta,
        experts.shape[1],
        n_rows,
        n_in,
        top_k,
        slot_of if slot_of is not None else dummy,
        int(slot_of is not None),
        out,
    )


def launch_q8_gate_up(
    x, experts, meta, F: int, D: int, h, ids=None, order=None, offsets=None, stream=0, slot_of=None
) -> None:
    """x [T, D] float32; experts uint8 [E, stride] (the layer's blocks); meta [E, META_WIDTH] int32 (device);
    h [n, F] float32. By slot: ids [1, K] int32 (T == 1, n == K). Grouped: order [n] int32 and offsets [E+1]
    int32 from expert_grouping (n == T*K). slot_of [E] int32 (device; the expert cache): experts is then the
    slot buffer uint8 [S, stride], expert e reads slot slot_of[e] with its meta row meta[e], and experts with
    slot_of[e] < 0 are skipped (their rows of h untouched: another wave computes them)."""
    _check_layer(experts, meta, F, D, slot_of)
    E = meta.shape[0]
    T = x.shape[0]
    _check("x", x, (T, D), np.float32)
    if ids is not None:
        if T != 1:
            raise ValueError(f"by-slot launches take one token, got x {list(x.shape)}")
        _check("ids", ids, (1, ids.shape[1] if ids.ndim == 2 else 0), np.int32)
        n, top_k = ids.size, ids.size
    else:
        n = order.shape[0]
        _check("order", order, (n,), np.int32)
        _check("offsets", offsets, (E + 1,), np.int32)
        if n % T:
            raise ValueError(f"order length {n} is not a multiple of T={T}")
        top_k = n // T
    _check("h", h, (n, F), np.float32)
    _launch(x, order, offsets, ids, experts, meta, F, D, top_k, True, h, stream, slot_of)


def launch_q8_down(h, experts, meta, F: int, D: int, y, ids=None, offsets=None, stream=0, slot_of=None) -> None:
    """h [n, F] float32 (launch_q8_gate_up's output) -> y [n, D] float32 = h[p] @ down[e]^T, not yet weighted by
    the router. ids (by slot) or offsets (grouped), and slot_of, as in launch_q8_gate_up."""
    _check_layer(experts, meta, F, D, slot_of)
    n = h.shape[0]
    _check("h", h, (n, F), np.float32)
    _check("y", y, (n, D), np.float32)
    if ids is not None:
        _check("ids", ids, (1, n), np.int32)
    else:
        _check("offsets", offsets, (meta.shape[0] + 1,), np.int32)
    _launch(h, None, offsets, ids, experts, meta, D, F, 1, False, y, stream, slot_of)


def sm90_signatures():
    """(python function, numba signature) of both kernels, for the sm_90 compile check."""
    f2, i1, i64 = types.float32[:, ::1], types.int32[::1], types.int64
    sig = (
        f2,
        i1,
        i1,
        i1,
        i64,
        types.uint32[::1],
        types.float32[::1],
        types.int32[:, ::1],
        i64,
        i64,
        i64,
        i64,
        i1,
        i64,
        f2,
    )
    return [(_kernel(gated)[0], sig) for gated in (True, False)]
