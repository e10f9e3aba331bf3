"""Grouped MoE GEMM with 8-bit weights and 8-bit activations (W8A8) on Hopper warpgroup MMA (sm_90a): the experts'
int8 or fp8 e4m3 bytes and activation rows quantized per row to the same type (`quantize_rows`) multiply on the
8-bit tensor cores (`wgmma ... k32 .s32.s8.s8` / `.f32.e4m3.e4m3`, twice the bf16 rate), with no widening pass.
`moe_gemm_q8wgmma`'s contract otherwise: rows sorted by expert and padded to BM by `moe_align`, gate|up with the
SwiGLU epilogue (h in bf16), down with the store one (y in assignment order), tiles whose block is -1 skipped;
graph-capturable, no host synchronisation.

What changes against the bf16 wgmma kernel (its docstring has the rest):
- A step covers 128 input features: a 128-byte shared row holds 128 8-bit values, in the same 128-byte swizzle,
  and a k32 wgmma reads the same 32 bytes of it that a bf16 k16 one reads, so tiles, copies and descriptors are
  the bf16 kernel's.
- One 8-bit type and one scale scheme a launch (the layer's): int8 (per-channel scales) accumulates exactly in
  int32; fp8 with per-channel scales in fp32. The epilogue multiplies each sum by its row's activation scale and
  its column's weight scale.
- fp8 with block scales promotes every step: each 128-feature step's products go to a second set of accumulators,
  added in fp32 into the first with the step's block scale (a step is exactly one block along the input, and a
  warpgroup's weight rows lie in one block along the output: n0 is a multiple of 128 there; the gate's and the up's
  for gate|up). Twice the accumulator registers: these launches use the 64-row, 256-thread tile (`config_for`). A
  step's sums are added in at the next step, once that step's copies are issued, so the MMAs run across the barrier
  and the copy issue (1.08x waiting at once on the H200; a third accumulator set, so that MMAs also run across the
  addition, fits in 255 registers but measured 6-11 % slower on the H200). fp8 per channel sums all of the input in
  the MMA's fp32, as int8 does in int32: Hopper's fp8 MMA keeps only about 14 mantissa bits of its running sum
  (DeepSeek-V3's report), 4.5e-3 of the output at K = 14,336 on the H200 against 2-3e-4 promoted, far below what
  rounding the activations to e4m3 costs, and 1.31-1.41x faster. int8 and per-channel fp8 run on the 128 x 256 tile
  from moe_grouped_mma.WGMMA_MIN_ROWS rows an expert, on the 64 x 256 one below.
- An expert whose code or scheme is not the launch's gives NaN rows (never silently wrong).
The numpy reference is `moe_reference_w8a8`. GPU only: the simulator cannot run wgmma; tests run on the H200.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
from numba import cuda, types

from expert_service.kernels.expert_quant import CODE_FP8, CODE_INT8, SCALE_BLOCK, SCALE_BLOCK_SIZE, decode, dequantize
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.moe_gemm_mma import _MODE_STORE, _MODE_SWIGLU, _epilogue, _launch, bf16_round
from expert_service.kernels.moe_gemm_q8mma import _check_common, channel_scaler
from expert_service.kernels.moe_gemm_wgmma import (
    ATOM_BYTES,
    CONFIGS,
    ROW_BYTES,
    WARPGROUP,
    Config,
    silu_approx,
    weight_row_fn,
)
from expert_service.kernels.numeric import WARP, check_array
from expert_service.kernels.ptx import cp_async16, cp_async_commit, cp_async_wait_fn
from expert_service.kernels.wgmma import (
    fence_proxy_async,
    smem_desc_sw128,
    wgmma_commit,
    wgmma_fence,
    wgmma_q8_fn,
    wgmma_wait_fn,
)

BK = 128            # input features a step: one 128-byte shared row of 8-bit values, one block-scale column
KINDS = {CODE_INT8: "s8", CODE_FP8: "e4m3"}
__all__ = ["applies", "config_for", "tiles_for", "launch_w8a8_down", "launch_w8a8_gate_up", "moe_reference_w8a8"]


def config_for(block_scaled: bool, wide: bool = True) -> Config:
    """The tile a launch uses: 64 x 256 with two warpgroups for block-scaled fp8 (promoted: two sets of
    accumulators need the registers of a 256-thread block) and for steps too small for the wide tile (wide False:
    under moe_grouped_mma.WGMMA_MIN_ROWS rows an expert), else 128 x 256 with four."""
    return CONFIGS["w128" if wide and not block_scaled else "w64"]


def tiles_for(block_scaled: bool) -> tuple[Config, ...]:
    """The tiles a launch of this scale scheme may take (config_for's choices; the 8-bit type does not matter)."""
    return (CONFIGS["w64"],) if block_scaled else (CONFIGS["w128"], CONFIGS["w64"])


def applies(F: int, D: int, stride: int) -> bool:
    """Every row a whole number of 128-feature steps (block scales then never straddle one), 16-byte aligned."""
    return D % BK == 0 and F % BK == 0 and stride % 16 == 0


@functools.cache
def step_mma_fn(nw: int, kind: str):
    """Device function `step(acc, smem, a_base, b_base, accumulate)`: wgmma.fence, the four m64 n<nw> k32 wgmma's of
    a 128-feature step on the swizzled tiles at uint32 words a_base / b_base (the first adds into acc only when
    accumulate != 0), committed as one group."""
    mma = wgmma_q8_fn(nw, kind)

    @cuda.jit(device=True, inline=True)
    def step(acc, smem, a_base, b_base, accumulate):
        wgmma_fence()
        for kk in range(4):
            mma(acc, 0, smem_desc_sw128(smem, a_base + kk * 8, 16, ATOM_BYTES),
                smem_desc_sw128(smem, b_base + kk * 8, 16, ATOM_BYTES), accumulate if kk == 0 else 1)
        wgmma_commit()

    return step


@functools.cache
def _build(cfg: Config, mode: int, code: int, block_scaled: bool):
    """Kernel for one tile, epilogue mode, 8-bit code and scale scheme. Returns (python function, jitted kernel).
    No division by a run-time value (ptxas would serialise the wgmma's of a kernel that calls a subroutine)."""
    WGN, NW, S = cfg.wgn, cfg.nw, cfg.stages
    THREADS, BM, BN = cfg.threads, cfg.block_m, cfg.block_n
    if S < 3:
        raise ValueError("the pipeline needs at least 3 stages")
    gated = mode == _MODE_SWIGLU
    promoted = block_scaled  # each step's sums added into fp32 accumulators times the step's block scale
    if block_scaled and (code != CODE_FP8 or SCALE_BLOCK_SIZE % (NW // 2 if gated else NW)):
        raise ValueError("block scales: fp8 only, and a warpgroup's weight rows within one 128-row block")
    NT, NH = NW // 8, NW // 16
    A_WORDS, B_WORDS = BM * ROW_BYTES // 4, BN * ROW_BYTES // 4
    STAGE_WORDS = A_WORDS + B_WORDS
    A_ITERS, B_ITERS = BM * 8 // THREADS, BN * 8 // THREADS
    PRIMED = S - 2
    GATE_OFF, SCALE_OFF = (2, 5) if gated else (4, 7)
    acc_type = np.int32 if code == CODE_INT8 else np.float32
    acc_zero = acc_type(0)
    weight_row, step_mma = weight_row_fn(NW, gated), step_mma_fn(NW, KINDS[code])
    wait_copies = cp_async_wait_fn(PRIMED - 1)
    wait_older, wait_all = wgmma_wait_fn(1), wgmma_wait_fn(0)
    epilogue = _epilogue(mode, True, 1, NT, silu_approx)
    scale_sums = channel_scaler(1, NT, gated)

    @cuda.jit(device=True, inline=True)
    def promote(acc, part, f_gate, f_up):
        """acc += a finished step's sums x its block scale (the up's for the up half of gate|up)."""
        for j in range(NT):
            f = f_up if gated and j >= NH else f_gate
            for v in range(4):
                acc[0, j, v] += part[0, j, v] * f

    @cuda.jit(device=True, inline=True)
    def fill(smem, stage, a, words, a_start, a_rows, b_start, step):
        """This thread's 16-byte chunks of step `step`'s A and B tiles into `stage` (chunk q: row q // 8, q % 8;
        A chunk `it` is a_rows words after chunk 0; a B chunk with b_start < 0 is zero-filled)."""
        base = stage * STAGE_WORDS
        for it in range(A_ITERS):
            q = cuda.threadIdx.x + it * THREADS
            r, c = q // 8, q % 8
            cp_async16(smem, base + (r * ROW_BYTES + ((c ^ (r % 8)) * 16)) // 4, a,
                       a_start + it * a_rows + step * (BK // 4), True)
        for it in range(B_ITERS):
            q = cuda.threadIdx.x + it * THREADS
            r, c = q // 8, q % 8
            ok = b_start[it] >= 0
            cp_async16(smem, base + A_WORDS + (r * ROW_BYTES + ((c ^ (r % 8)) * 16)) // 4, words,
                       (b_start[it] + step * (BK // 4)) if ok else 0, ok)

    def w8a8_kernel(a, a_scale, words, scales, meta, tile_expert, tile_block, num_tiles, sorted_ids, stride, n_out,
                    k_dim, out):
        """a: 8-bit A rows [rows * k_dim / 4] uint32, a_scale [rows] float32 (quantize_rows); words / scales: the
        blocks [blocks * stride bytes] as uint32 / float32; meta [E, META_WIDTH] int32; tile_expert [tiles] (the
        tile's meta row), tile_block [tiles] (the block holding its weights; -1: skip), num_tiles [1], sorted_ids
        [rows] int32; stride: bytes per block; n_out, k_dim: output columns, input dim (a multiple of 128); out:
        h [rows * F / 2] uint32 | y [T*K * D] f32. Grid (tiles, N tiles), THREADS."""
        m_tile = cuda.blockIdx.x
        n_tile = cuda.blockIdx.y
        if m_tile >= num_tiles[0]:
            return
        block = tile_block[m_tile]
        if block < 0:
            return
        expert = tile_expert[m_tile]
        base = np.int64(block) * stride
        row0 = np.int64(m_tile) * BM
        n0 = n_tile * (BN // 2 if gated else BN)
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        wgm, wgn = wg // WGN, wg % WGN

        smem = cuda.shared.array(0, np.uint32, alignment=ATOM_BYTES)
        acc = cuda.local.array((1, NT, 4), acc_type)
        for j in range(NT):
            for v in range(4):
                acc[0, j, v] = acc_zero
        a_start = ((row0 + tid // 8) * k_dim + (tid % 8) * 16) // 4
        a_rows = (THREADS // 8) * k_dim // 4  # words between this thread's A chunks of consecutive `it`
        b_start = cuda.local.array(B_ITERS, np.int64)
        for it in range(B_ITERS):
            q = tid + it * THREADS
            col, mat = weight_row(q // 8, n0)
            b_start[it] = -1
            if col < n_out:
                b_start[it] = (base + meta[expert, GATE_OFF + mat] + np.int64(col) * k_dim + (q % 8) * 16) >> 2
        # block scales: this warpgroup's rows of the gate (and up) scale grids, one float per step along the input
        first_col = n0 + wgn * (NW // 2 if gated else NW)
        n_cb = k_dim // SCALE_BLOCK_SIZE
        s_gate = (base + meta[expert, SCALE_OFF]) // 4 + (first_col // SCALE_BLOCK_SIZE) * n_cb
        s_up = (base + meta[expert, SCALE_OFF + (1 if gated else 0)]) // 4 + (first_col // SCALE_BLOCK_SIZE) * n_cb
        # a wrong expert's scale offsets may point past its block: read none (its rows become NaN below)
        read_scales = first_col < n_out and meta[expert, 0] == code and meta[expert, 1] == SCALE_BLOCK
        part = cuda.local.array((1, NT, 4), np.float32)
        f_gate = f_up = np.float32(0.0)

        n_steps = k_dim // BK
        for s in range(PRIMED):
            if s < n_steps:
                fill(smem, s, a, words, a_start, a_rows, b_start, s)
            cp_async_commit()
        a_row = wgm * 64 * ROW_BYTES // 4
        b_row = A_WORDS + wgn * NW * ROW_BYTES // 4
        for step in range(n_steps):
            wait_copies()
            fence_proxy_async()
            cuda.syncthreads()
            nxt = step + PRIMED
            if nxt < n_steps:
                fill(smem, nxt % S, a, words, a_start, a_rows, b_start, nxt)
            cp_async_commit()
            stage = (step % S) * STAGE_WORDS
            if promoted:  # the previous step's sums added in once its MMAs are done (after this step's copies)
                if step > 0:
                    wait_all()
                    promote(acc, part, f_gate, f_up)
                f_gate = scales[s_gate + step] if read_scales else np.float32(0.0)
                f_up = scales[s_up + step] if gated and read_scales else f_gate
                step_mma(part, smem, stage + a_row, stage + b_row, 0)
            else:
                step_mma(acc, smem, stage + a_row, stage + b_row, 1)
                wait_older()
        wait_all()
        if promoted:
            promote(acc, part, f_gate, f_up)

        lane = tid % WARP
        g, t = lane // 4, lane % 4
        m0 = row0 + wgm * 64 + ((tid // WARP) % 4) * 16
        res = cuda.local.array((1, NT, 4), np.float32)
        for j in range(NT):
            for v in range(4):
                res[0, j, v] = np.float32(acc[0, j, v])
        scale_sums(res, meta, expert, base, scales, n0, n_out, wgn, t)
        # each row's activation scale (NaN for an expert that is not this launch's kind)
        r_lo, r_hi = a_scale[m0 + g], a_scale[m0 + g + 8]
        if meta[expert, 0] != code or (meta[expert, 1] == SCALE_BLOCK) != block_scaled:
            r_lo = r_hi = np.float32(np.nan)
        for j in range(NT):
            for v in range(4):
                res[0, j, v] *= r_lo if v < 2 else r_hi
        epilogue(res, out, sorted_ids, scales, m0, n0, n_out, 1, wgn, g, t)

    # one block an SM: ptxas fits the registers to THREADS
    return w8a8_kernel, cached_jit(w8a8_kernel, launch_bounds=(THREADS, 1))


# ---- launchers ---------------------------------------------------------------------------------------------
def _run(cfg: Config, mode: int, code: int, block_scaled: bool, a, a_scale, experts, meta, tile_expert, tile_slot,
         num_tiles, sorted_ids, n_out: int, k_dim: int, n_tiles_n: int, out, stream) -> None:
    if code not in KINDS:
        raise ValueError(f"moe_gemm_w8a8: code {code} is neither int8 ({CODE_INT8}) nor fp8 ({CODE_FP8})")
    if cfg not in tiles_for(block_scaled):
        scheme = "block" if block_scaled else "channel"
        raise ValueError(f"moe_gemm_w8a8: {scheme} scales run on {tiles_for(block_scaled)}, got {cfg}")
    if not applies(n_out if mode == _MODE_SWIGLU else k_dim, k_dim if mode == _MODE_SWIGLU else n_out,
                   experts.shape[1]):
        raise ValueError(f"moe_gemm_w8a8 needs D and F multiples of {BK}, got output {n_out} input {k_dim}")
    rows = tile_expert.shape[0] * cfg.block_m
    check_array("a", a, (rows, k_dim), np.uint8)
    check_array("a_scale", a_scale, (rows,), np.float32)
    flat = experts.reshape(experts.size)
    _launch(_build(cfg, mode, code, block_scaled)[1], (tile_expert.shape[0], n_tiles_n), cfg, stream, (
        a.reshape(a.size).view(np.uint32), a_scale, flat.view(np.uint32), flat.view(np.float32), meta, tile_expert,
        tile_expert if tile_slot is None else tile_slot, num_tiles, sorted_ids, np.int64(experts.shape[1]),
        np.int64(n_out), np.int64(k_dim), out))


def launch_w8a8_gate_up(xq, x_scale, tile_expert, num_tiles, experts, meta, code: int, block_scaled: bool, F: int,
                        D: int, h, config: Config, stream=0, tile_slot=None) -> None:
    """xq [rows, D] uint8 and x_scale [rows] float32 (launch_quantize_gathered with `code`), tile_expert [tiles] /
    num_tiles [1] int32 (launch_moe_align, block_m = config.block_m), experts [E, stride] uint8 with meta
    [E, META_WIDTH] (every expert `code`, block-scaled or per channel as `block_scaled`) -> h [rows, F] uint16
    (bf16 of silu(x gate^T) * (x up^T)) in every used row (padding rows: zeros)."""
    tiles = _check_common(experts, meta, tile_expert, tile_slot, num_tiles, F, D)
    check_array("h", h, (tiles * config.block_m, F), np.uint16)
    if tiles == 0:
        return
    _run(config, _MODE_SWIGLU, code, block_scaled, xq, x_scale, experts, meta, tile_expert, tile_slot, num_tiles,
         tile_expert, F, D, -(-F // (config.block_n // 2)), h.reshape(h.size).view(np.uint32), stream)


def launch_w8a8_down(hq, h_scale, tile_expert, num_tiles, sorted_ids, experts, meta, code: int, block_scaled: bool,
                     F: int, D: int, out, config: Config, stream=0, tile_slot=None) -> None:
    """hq [rows, F] uint8 and h_scale [rows] float32 (launch_quantize_rows of gate|up's h), sorted_ids [rows] from
    launch_moe_align -> out [T*K, D] float32 in assignment order (every routed row written)."""
    tiles = _check_common(experts, meta, tile_expert, tile_slot, num_tiles, F, D)
    check_array("sorted_ids", sorted_ids, (tiles * config.block_m,), np.int32)
    if out.ndim != 2:
        raise ValueError(f"out must be [T*K, D] float32, got {list(out.shape)}")
    check_array("out", out, (out.shape[0], D), np.float32)
    if tiles == 0 or out.shape[0] == 0:
        return
    _run(config, _MODE_STORE, code, block_scaled, hq, h_scale, experts, meta, tile_expert, tile_slot, num_tiles,
         sorted_ids, D, F, -(-D // config.block_n), out.reshape(out.size), stream)


# ---- numpy reference --------------------------------------------------------------------------------------
def _decode_rows(q: np.ndarray, scales: np.ndarray, code: int) -> np.ndarray:
    return decode(np.ascontiguousarray(q).reshape(-1), code).reshape(q.shape).astype(np.float64) * scales[:, None]


def moe_reference_w8a8(xq, x_scale, block, meta, F: int, D: int, code: int, hq=None, h_scale=None):
    """One expert's rows as the kernels compute them, in float64 (the GPU's fp8 sums: fp32 every 128 features): xq [n, D] uint8 / x_scale [n] (its quantized input
    rows) -> (h [n, F] float32, the bf16-rounded SwiGLU; with hq / h_scale, those h rows quantized, y [n, D]
    float64, else None). Weights: exactly q x scale."""
    gate, up, down = (m.astype(np.float64) for m in dequantize(block, meta, F, D))
    x = _decode_rows(xq, x_scale, code)
    gs, us = x @ gate.T, x @ up.T
    h = bf16_round((gs / (1.0 + np.exp(-gs)) * us).astype(np.float32))
    if hq is None:
        return h, None
    return h, _decode_rows(hq, h_scale, code) @ down.T


def sm90_signatures():
    """(python function, numba signature, compile options): both epilogues for int8, fp8 per channel and fp8 block
    scales, each on its tile, for sm_90a."""
    u32, i1, i64, f1 = types.uint32[::1], types.int32[::1], types.int64, types.float32[::1]
    out = []
    for code, block_scaled in ((CODE_INT8, False), (CODE_FP8, False), (CODE_FP8, True)):
        for cfg, mode in itertools.product(tiles_for(block_scaled), (_MODE_SWIGLU, _MODE_STORE)):
            dst = u32 if mode == _MODE_SWIGLU else f1
            out.append((_build(cfg, mode, code, block_scaled)[0],
                        (u32, f1, u32, f1, types.int32[:, ::1], i1, i1, i1, i1, i64, i64, i64, dst),
                        {"cc": (9, 0, "a"), "launch_bounds": (cfg.threads, 1)}))
    return out
