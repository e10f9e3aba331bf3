"""The 8-bit expert kernels as they were before the register-only rewrite (moe_q8: one kernel for every dtype,
per-thread arrays at runtime indices, 266 ld.local in its gate/up PTX; dequant_experts: a thread per 4 values
with 64-bit divisions), kept only so bench/q8_kernels.py times old and new in one run on the same GPU. Not used
by the engine; delete once the H200 figures are recorded in docs/kernels.md. No argument checks: the bench
passes what the current launchers accept.
"""
# ruff: noqa

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

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
from expert_service.kernels.numeric import SIMULATOR, WARP, f16_to_f32, silu, storer, u32_as_f32, warp_sum
from expert_service.kernels.ptx import ld_stream_v4

WARPS = 1 if SIMULATOR else 4  # warps per block, each owning ROWS rows
ROWS = 2  # output rows per warp (x reuse across rows)
TOK_TILE = 2 if SIMULATOR else 4  # tokens per pass over an expert's rows (more tokens: more passes)
ROWS_PER_BLOCK = WARPS * ROWS
MIN_DIM = 16  # D and F are multiples of this: whole 16-byte chunks of 8-bit rows


@functools.cache
def _q8_kernel(gated: bool):
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


def launch_q8(src, order, offsets, ids, experts, meta, n_rows, n_in, top_k, gated, out, stream, slot_of=None) -> None:
    by_slot = ids is not None
    slots = ids.size if by_slot else offsets.shape[0] - 1
    flat = experts.reshape(experts.size)
    dummy = meta.reshape(meta.size)[:1]
    grid = (slots, -(-n_rows // ROWS_PER_BLOCK))
    _q8_kernel(gated)[1][grid, WARPS * WARP, stream](
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


DQ_THREADS = 32 if SIMULATOR else 256
DQ_VALUES = 4  # values per thread (one 8-bit word); F and D are multiples of 16, so a row holds whole groups
_DTYPES = (np.uint16, np.float16, np.float32)  # the scratch's dense dtype (uint16 = bfloat16 bits)


@functools.cache
def _dequant_kernel(dtype):
    store = storer(dtype)

    def kernel(words, scales, meta, stride, offsets, first, F, D, out):
        """words / scales: the layer's expert buffer [E, stride] as flat uint32 / float32; meta [E, META_WIDTH]
        int32; stride: bytes per expert; offsets [E+1] int32 (the step's grouping); first: index of the group's
        first active expert; out [G, 3*F*D] dense dtype (gate, up, down back to back). Grid (G, value blocks),
        THREADS threads; slots past the last active expert are left untouched."""
        j = cuda.blockIdx.y  # the expert (the grid's x holds the many chunks: y and z stop at 65535)
        E = offsets.shape[0] - 1
        e = -1
        seen = 0
        for k in range(E):  # the (first + j)-th expert with tokens
            if offsets[k + 1] > offsets[k]:
                if seen == first + j:
                    e = k
                    break
                seen += 1
        if e < 0:
            return
        i = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * DQ_VALUES
        fd = F * D
        if i >= 3 * fd:
            return
        m = i // fd
        n_in = D if m < 2 else F
        local = i - m * fd
        r = local // n_in
        c = local - r * n_in
        code = meta[e, 0]
        scheme = meta[e, 1]
        base = e * stride
        factor = np.float32(1.0)
        if scheme == SCALE_CHANNEL:
            factor = scales[(base + meta[e, 5 + m]) // 4 + r]
        elif scheme == SCALE_BLOCK:
            n_cb = (n_in + SCALE_BLOCK_SIZE - 1) // SCALE_BLOCK_SIZE
            factor = scales[(base + meta[e, 5 + m]) // 4 + (r // SCALE_BLOCK_SIZE) * n_cb + c // SCALE_BLOCK_SIZE]
        o = j * 3 * fd + i
        if code == CODE_F32:
            w0 = (base + meta[e, 2 + m] + local * 4) // 4
            for q in range(DQ_VALUES):
                store(out, o + q, u32_as_f32(words[w0 + q]))
        elif code == CODE_BF16 or code == CODE_F16:
            w0 = (base + meta[e, 2 + m] + local * 2) // 4
            for q in range(2):
                w = words[w0 + q]
                if code == CODE_BF16:
                    lo = u32_as_f32(w << np.uint32(16))
                    hi = u32_as_f32(w & np.uint32(0xFFFF0000))
                else:
                    lo = f16_to_f32(w & np.uint32(0xFFFF))
                    hi = f16_to_f32(w >> np.uint32(16))
                store(out, o + 2 * q, lo)
                store(out, o + 2 * q + 1, hi)
        else:
            w = words[(base + meta[e, 2 + m] + local) // 4]
            for b in range(DQ_VALUES):
                store(out, o + b, byte_at(w, b, code) * factor)

    return kernel, cached_jit(kernel)


def launch_dequant_experts(experts, meta, offsets, first: int, F: int, D: int, out, stream=0) -> None:
    """experts uint8 [E, stride]; meta [E, META_WIDTH] int32; offsets [E+1] int32 (device); out [G, 3*F*D]
    uint16 (bf16) / float16 / float32: out[j] = the (first + j)-th active expert, dequantised."""
    E = experts.shape[0]
    if experts.ndim != 2 or np.dtype(experts.dtype) != np.uint8 or experts.shape[1] % 4:
        raise ValueError(f"experts must be uint8 [E, stride], got {experts.dtype} {list(experts.shape)}")
    if meta.shape != (E, META_WIDTH) or offsets.shape != (E + 1,) or F % 16 or D % 16:
        raise ValueError(f"meta {list(meta.shape)} / offsets {list(offsets.shape)} for {E} experts, F={F}, D={D}")
    if out.ndim != 2 or out.shape[1] != 3 * F * D or np.dtype(out.dtype) not in [np.dtype(d) for d in _DTYPES]:
        raise ValueError(f"out must be [G, {3 * F * D}] bfloat16/float16/float32, got {out.dtype} {list(out.shape)}")
    flat = experts.reshape(experts.size)
    grid = (-(-3 * F * D // (DQ_VALUES * DQ_THREADS)), out.shape[0])
    _dequant_kernel(np.dtype(out.dtype).type)[1][grid, DQ_THREADS, stream](
        flat.view(np.uint32),
        flat.view(np.float32),
        meta,
        experts.shape[1],
        offsets,
        first,
        F,
        D,
        out.reshape(out.size),
    )
