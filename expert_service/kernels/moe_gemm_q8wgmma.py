"""Grouped MoE GEMM for 8-bit experts (int8, fp8 e4m3; per-channel or 128x128 block scales, one dtype per expert)
on Hopper warpgroup MMA: `moe_gemm_q8mma`'s contract (and its numpy reference, `moe_reference_q8`) with
`moe_gemm_wgmma`'s tensor-core pipeline. GPU only (sm_90a).

What changes against the bf16 wgmma kernel (its docstring has the rest):
- B arrives as the expert's 8-bit rows: a step's 64 bytes a row are copied by 16-byte `cp.async` into a raw
  stage ring (S stages, as A), then widened by the block's threads into a bf16 tile in the 128-byte swizzled
  layout the wgmma descriptors read (two such tiles, used in turn), followed by `fence.proxy.async` and a
  barrier. int8 and e4m3 values are exact in bf16: with per-channel scales the tile holds q and the scale
  multiplies each fp32 sum in the epilogue; with 128x128 block scales each 16-value chunk is multiplied by its
  block's scale and rounded to bf16 (nearest even), the weights `moe_gemm_q8mma` and `dequant_experts` use.
- A step: wait for the copies of step s; barrier; widen B(s) into bf16 tile s % 2 (its last reader, step
  s - 2's wgmma, finished: every warpgroup waited for all but its newest group at the end of step s - 1);
  fence; barrier; refill the stages of step s - 2 with step s + S - 2; issue step s's wgmma's. The widening of
  step s runs on the CUDA cores while the tensor cores still work on step s - 1.
- Tiles whose block (tile_block: the expert, or its cache slot) is -1 are skipped; experts whose code is
  neither int8 nor fp8 give NaN rows (never silently wrong).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.expert_quant import (
    CODE_INT8,
    SCALE_BLOCK,
    SCALE_BLOCK_SIZE,
    fp8x4,
    int8x4,
)
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.mma import block_pack as pack
from expert_service.kernels.moe_gemm_mma import _MODE_STORE, _MODE_SWIGLU, _epilogue, _launch
from expert_service.kernels.moe_gemm_q8mma import _check_common, channel_scaler
from expert_service.kernels.moe_gemm_wgmma import (
    ATOM_BYTES,
    BK,
    CONFIGS,
    ROW_BYTES,
    WARPGROUP,
    Config,
    silu_approx,
    step_mma_fn,
    weight_row_fn,
)
from expert_service.kernels.numeric import WARP, check_array
from expert_service.kernels.ptx import cp_async16, cp_async_commit, cp_async_wait_fn, ld_shared_v4, st_shared_v4
from expert_service.kernels.wgmma import fence_proxy_async, wgmma_wait_fn

RAW_ROW = BK            # bytes of an 8-bit row a step
__all__ = ["CONFIGS", "Config", "applies", "launch_q8wgmma_down", "launch_q8wgmma_gate_up", "shared_bytes"]


def shared_bytes(cfg: Config) -> int:
    """S stages of A (BM bf16 rows) and raw B (BN 8-bit rows), then two widened bf16 B tiles."""
    return cfg.stages * (cfg.block_m * ROW_BYTES + cfg.block_n * RAW_ROW) + 2 * cfg.block_n * ROW_BYTES


def applies(F: int, D: int, stride: int) -> bool:
    """Every row a whole number of 64-feature steps, 16-byte aligned 8-bit blocks."""
    return D % BK == 0 and F % BK == 0 and stride % 16 == 0


@cuda.jit(device=True, inline=True)
def _widen4(w, is_int8, scaled, factor):
    """4 weight bytes (k order) -> 2 bf16x2 words: exact values, or times `factor` rounded to bf16 when scaled."""
    if is_int8:
        v0, v1, v2, v3 = int8x4(w)
    else:
        v0, v1, v2, v3 = fp8x4(w)
    if scaled:
        v0, v1, v2, v3 = v0 * factor, v1 * factor, v2 * factor, v3 * factor
    return pack(v0, v1), pack(v2, v3)


@functools.cache
def _build(cfg: Config, mode: int):
    """Kernel for one block shape and epilogue mode (SwiGLU -> bf16 h, or store fp32 rows). Returns (python
    function, jitted kernel)."""
    WGN, NW, S = cfg.wgn, cfg.nw, cfg.stages
    THREADS, BM, BN = cfg.threads, cfg.block_m, cfg.block_n
    if S < 3:
        raise ValueError("the pipeline needs at least 3 stages")
    gated = mode == _MODE_SWIGLU
    NT = NW // 8
    A_WORDS, RAW_WORDS, B_WORDS = BM * ROW_BYTES // 4, BN * RAW_ROW // 4, BN * ROW_BYTES // 4
    B_TILES = S * A_WORDS                         # first word of the two widened B tiles
    RAW = B_TILES + 2 * B_WORDS                   # first word of the raw B stages
    A_ITERS, B_ITERS = BM * 8 // THREADS, BN * 4 // THREADS     # 16-byte chunks a thread copies / widens a step
    PRIMED = S - 2
    GATE_OFF, SCALE_OFF = (2, 5) if gated else (4, 7)           # meta columns of the first matrix, of its scale
    weight_row, step_mma = weight_row_fn(NW, gated), step_mma_fn(NW)
    wait_copies = cp_async_wait_fn(PRIMED - 1)
    wait_older, wait_all = wgmma_wait_fn(1), wgmma_wait_fn(0)
    epilogue = _epilogue(mode, True, 1, NT, silu_approx)
    scale_sums = channel_scaler(1, NT, gated)

    @cuda.jit(device=True, inline=True)
    def fill(smem, stage, a, words, a_start, b_start, b_ok, step):
        for it in range(A_ITERS):
            q = cuda.threadIdx.x + it * THREADS
            r, c = q // 8, q % 8
            cp_async16(smem, stage * A_WORDS + (r * ROW_BYTES + ((c ^ (r % 8)) * 16)) // 4, a,
                       a_start[it] + step * (BK // 2), True)
        for it in range(B_ITERS):
            q = cuda.threadIdx.x + it * THREADS
            ok = b_ok[it] != 0
            cp_async16(smem, RAW + stage * RAW_WORDS + q * 4, words, (b_start[it] + step * (BK // 4)) if ok else 0, ok)

    @cuda.jit(device=True, inline=True)
    def widen_stage(smem, stage, tile, is_int8, block_scaled, scales, s_row, step):
        """This thread's raw chunks of `stage` (chunk q: row q // 4, 16 values at k = 16 (q % 4)) into bf16 tile
        `tile`, row r's 16-byte chunks 2 (q % 4) and 2 (q % 4) + 1 at their swizzled places."""
        kb = (step * BK) // SCALE_BLOCK_SIZE
        for it in range(B_ITERS):
            q = cuda.threadIdx.x + it * THREADS
            r, c4 = q // 4, q % 4
            w0, w1, w2, w3 = ld_shared_v4(smem, RAW + stage * RAW_WORDS + q * 4)
            factor = np.float32(1.0)
            if block_scaled and s_row[it] >= 0:
                factor = scales[s_row[it] + kb]
            p0, p1 = _widen4(w0, is_int8, block_scaled, factor)
            p2, p3 = _widen4(w1, is_int8, block_scaled, factor)
            p4, p5 = _widen4(w2, is_int8, block_scaled, factor)
            p6, p7 = _widen4(w3, is_int8, block_scaled, factor)
            row = B_TILES + tile * B_WORDS + r * (ROW_BYTES // 4)
            st_shared_v4(smem, row + ((2 * c4) ^ (r % 8)) * 4, p0, p1, p2, p3)
            st_shared_v4(smem, row + ((2 * c4 + 1) ^ (r % 8)) * 4, p4, p5, p6, p7)

    def q8wgmma_kernel(a, words, scales, meta, tile_expert, tile_block, num_tiles, sorted_ids, stride, n_out, k_dim,
                       n_tiles_n, out):
        """a: A rows [rows * k_dim / 2] uint32 (bf16 pairs); words / scales: the blocks [blocks * stride bytes] as
        uint32 / float32; meta [E, META_WIDTH] int32; tile_expert [tiles] (the tile's expert: its meta row),
        tile_block [tiles] (the block holding its weights: the expert, or its cache slot; -1: skip the tile),
        num_tiles [1], sorted_ids [rows] int32; stride: bytes per block; n_out, k_dim: output columns, input dim
        (a multiple of 64); n_tiles_n: unused; out: h [rows * F / 2] uint32 | y [T*K * D] f32.
        Grid (tiles, N tiles), THREADS."""
        m_tile = cuda.blockIdx.x
        n_tile = cuda.blockIdx.y
        if m_tile >= num_tiles[0]:
            return
        block = tile_block[m_tile]
        if block < 0:
            return
        expert = tile_expert[m_tile]
        code = meta[expert, 0]
        is_int8 = code == CODE_INT8
        block_scaled = meta[expert, 1] == SCALE_BLOCK
        base = np.int64(block) * stride
        row0 = np.int64(m_tile) * BM
        n0 = n_tile * (BN // 2 if gated else BN)
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        wgm, wgn = wg // WGN, wg % WGN

        smem = cuda.shared.array(0, np.uint32, alignment=ATOM_BYTES)
        acc = cuda.local.array((1, NT, 4), np.float32)
        for j in range(NT):
            for v in range(4):
                acc[0, j, v] = np.float32(0.0)
        a_start = cuda.local.array(A_ITERS, np.int64)
        for it in range(A_ITERS):
            q = tid + it * THREADS
            a_start[it] = ((row0 + q // 8) * k_dim + (q % 8) * 8) // 2
        # B chunk q of a stage: tile row r = q // 4 (warpgroup r // NW's rows: NW / 2 gate rows, then the same F
        # columns' up rows), bytes 16 (q % 4) of its step; s_row: the row's first block scale (float index)
        n_cb = k_dim // SCALE_BLOCK_SIZE + (1 if k_dim % SCALE_BLOCK_SIZE else 0)
        b_start = cuda.local.array(B_ITERS, np.int64)
        b_ok = cuda.local.array(B_ITERS, np.int32)
        s_row = cuda.local.array(B_ITERS, np.int64)
        for it in range(B_ITERS):
            q = tid + it * THREADS
            col, mat = weight_row(q // 4, n0)
            b_ok[it] = 1 if col < n_out else 0
            b_start[it] = 0
            s_row[it] = -1
            if col < n_out:
                b_start[it] = (base + meta[expert, GATE_OFF + mat] + np.int64(col) * k_dim + (q % 4) * 16) >> 2
                s_row[it] = (base + meta[expert, SCALE_OFF + mat]) // 4 + (col // SCALE_BLOCK_SIZE) * n_cb

        n_steps = k_dim // BK
        for s in range(PRIMED):
            if s < n_steps:
                fill(smem, s, a, words, a_start, b_start, b_ok, s)
            cp_async_commit()
        a_row = wgm * 64 * ROW_BYTES // 4
        b_row = wgn * NW * ROW_BYTES // 4
        for step in range(n_steps):
            stage = step % S
            wait_copies()
            cuda.syncthreads()
            widen_stage(smem, stage, step % 2, is_int8, block_scaled, scales, s_row, step)
            fence_proxy_async()
            cuda.syncthreads()
            nxt = step + PRIMED
            if nxt < n_steps:
                fill(smem, nxt % S, a, words, a_start, b_start, b_ok, nxt)
            cp_async_commit()
            a_base = stage * A_WORDS + a_row
            b_base = B_TILES + (step % 2) * B_WORDS + b_row
            step_mma(acc, smem, a_base, b_base)
            wait_older()
        wait_all()

        lane = tid % WARP
        t = lane % 4
        scale_sums(acc, meta, expert, base, scales, n0, n_out, wgn, t)
        epilogue(acc, out, sorted_ids, scales, row0 + wgm * 64 + ((tid // WARP) % 4) * 16, n0, n_out, 1, wgn,
                 lane // 4, t)

    # one block an SM: ptxas fits the registers to THREADS (512 threads: 128 each)
    return q8wgmma_kernel, cached_jit(q8wgmma_kernel, launch_bounds=(THREADS, 1))


# ---- launchers ---------------------------------------------------------------------------------------------
def _run(cfg: Config, mode: int, a, experts, meta, tile_expert, tile_slot, num_tiles, sorted_ids, n_out, k_dim,
         n_tiles_n, out, stream) -> None:
    if not applies(n_out if mode == _MODE_SWIGLU else k_dim, k_dim if mode == _MODE_SWIGLU else n_out,
                   experts.shape[1]):
        raise ValueError(f"moe_gemm_q8wgmma needs D and F multiples of {BK}, got output {n_out} input {k_dim}")
    flat = experts.reshape(experts.size)
    _launch(_build(cfg, mode)[1], (tile_expert.shape[0], n_tiles_n), cfg, stream, (
        a.reshape(a.size).view(np.uint32), flat.view(np.uint32), flat.view(np.float32), meta, tile_expert,
        tile_expert if tile_slot is None else tile_slot, num_tiles, sorted_ids, np.int64(experts.shape[1]),
        np.int64(n_out), np.int64(k_dim), np.int64(n_tiles_n), out), shared_bytes=shared_bytes(cfg))


def launch_q8wgmma_gate_up(xs, tile_expert, num_tiles, experts, meta, F: int, D: int, h, config: Config, stream=0,
                           tile_slot=None) -> None:
    """moe_gemm_q8mma.launch_q8mma_gate_up's contract on this kernel (config: one of moe_gemm_wgmma's)."""
    tiles = _check_common(experts, meta, tile_expert, tile_slot, num_tiles, F, D)
    rows = tiles * config.block_m
    check_array("xs", xs, (rows, D), np.uint16)
    check_array("h", h, (rows, F), np.uint16)
    if tiles == 0:
        return
    _run(config, _MODE_SWIGLU, xs, experts, meta, tile_expert, tile_slot, num_tiles, tile_expert, F, D,
         -(-F // (config.block_n // 2)), h.reshape(h.size).view(np.uint32), stream)


def launch_q8wgmma_down(h, tile_expert, num_tiles, sorted_ids, experts, meta, F: int, D: int, out, config: Config,
                        stream=0, tile_slot=None) -> None:
    """moe_gemm_q8mma.launch_q8mma_down's contract on this kernel: out [T*K, D] f32 in assignment order."""
    tiles = _check_common(experts, meta, tile_expert, tile_slot, num_tiles, F, D)
    rows = tiles * config.block_m
    check_array("h", h, (rows, F), np.uint16)
    check_array("sorted_ids", sorted_ids, (rows,), np.int32)
    if out.ndim != 2:
        raise ValueError(f"out must be [T*K, D] float32, got {list(out.shape)}")
    check_array("out", out, (out.shape[0], D), np.float32)
    if tiles == 0 or out.shape[0] == 0:
        return
    _run(config, _MODE_STORE, h, experts, meta, tile_expert, tile_slot, num_tiles, sorted_ids, D, F,
         -(-D // config.block_n), out.reshape(out.size), stream)


def sm90_signatures():
    """(python function, numba signature, compile options): both epilogues at each config, for sm_90a."""
    u32, i1, i64, f1 = types.uint32[::1], types.int32[::1], types.int64, types.float32[::1]
    out = []
    for cfg in CONFIGS.values():
        for mode in (_MODE_SWIGLU, _MODE_STORE):
            dst = u32 if mode == _MODE_SWIGLU else f1
            out.append((_build(cfg, mode)[0], (u32, u32, f1, types.int32[:, ::1], i1, i1, i1, i1, i64, i64, i64, i64,
                                               dst), {"cc": (9, 0, "a"), "launch_bounds": (cfg.threads, 1)}))
    return out
