"""Grouped MoE GEMM on Hopper warpgroup MMA (wgmma, sm_90a): the same contract as `moe_gemm_mma` (tokens sorted
by expert and padded to BM by `moe_align`, gathered to bf16 rows by `moe_gather_bf16`; gate|up with the SwiGLU
epilogue, down with the store one (y in assignment order); graph-capturable, no host synchronisation) at 2.5-3.5x its
throughput on large tiles (`bench/wgmma_gemm.py`, docs/kernels.md).

Kernel design (one block = BM padded rows of one expert x BN weight rows; WGM x WGN warpgroups of 128 threads):
- Warpgroup (wm, wn) computes rows 64 wm .. 64 wm + 63 of the tile against the block's B rows NW wn .. NW wn +
  NW - 1 with `wgmma.mma_async` m64 n<NW> k16 (`kernels.wgmma`), fp32 accumulators in registers. gate|up: those
  NW rows are NW / 2 gate rows and the same NW / 2 up rows (F columns n0 + wn NW / 2 + i), so each thread holds
  matching gate and up accumulators and SwiGLU is the epilogue.
- Main loop over the input dim in steps of 64: A [BM, 64] and B [BN, 64] tiles in STAGES shared-memory stages,
  each row 128 bytes with its 16-byte chunk c stored at c ^ (row % 8) (the 128-byte swizzle the wgmma
  descriptors name; without it the same kernel ran at 0.2x cuBLAS), filled by 16-byte `cp.async` (8 threads a
  row: coalesced 128-byte reads, conflict-free shared writes). STAGES - 2 steps of copies in flight; each step
  waits for its stage, passes one barrier, refills the stage two steps back (every warpgroup finished reading
  it: each waits for all but its newest wgmma group before the barrier), then issues its 4 wgmma's and commits.
- Epilogue: a warp's accumulators are a 16-row m-tile of NW / 8 n-tiles in `mma.sync`'s C layout, so
  `moe_gemm_mma`'s epilogues write them unchanged.
Needs bf16 weights with D, F multiples of 64 (every real model's) and 16-byte aligned buffers; the launchers
refuse anything else (`applies`). GPU only: the simulator cannot run wgmma, so tests run on the H200.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.mma import rcp_approx
from expert_service.kernels.moe_gemm_mma import (
    _MODE_STORE,
    _MODE_SWIGLU,
    _check_weights,
    _epilogue,
    _flat,
    _float_dummy,
    _launch,
)
from expert_service.kernels.numeric import WARP, aligned_to, check_array
from expert_service.kernels.ptx import cp_async16, cp_async_commit, cp_async_wait_fn
from expert_service.kernels.wgmma import (
    fence_proxy_async,
    smem_desc_sw128,
    wgmma_bf16_fn,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait_fn,
)

BK = 64             # input features a step: one 128-byte shared row of bf16
ROW_BYTES = 128
ATOM_BYTES = 1024   # 8 swizzled rows: the descriptors' stride between row groups
WARPGROUP = 128


@cuda.jit(device=True, inline=True)
def silu_approx(v):
    """v * sigmoid(v) with the reciprocal approximated (1 ulp; h is rounded to bf16 next): no division call."""
    return v * rcp_approx(np.float32(1.0) + math.exp(-v))


class Config(NamedTuple):
    """WGM x WGN warpgroups, each 64 rows x NW weight rows; STAGES shared-memory stages."""
    wgm: int
    wgn: int
    nw: int
    stages: int = 4

    @property
    def block_m(self) -> int:
        return 64 * self.wgm

    @property
    def block_n(self) -> int:
        return self.nw * self.wgn

    @property
    def threads(self) -> int:
        return WARPGROUP * self.wgm * self.wgn

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * ROW_BYTES


# w128: what the MoE strategy runs (it takes these kernels from 96 rows an expert, cuda/moe_grouped_mma.py); w64:
# timed beside it by bench/moe_gemm.py (slower at 128 rows an expert; below 96 mma.sync's smaller tiles win).
CONFIGS = {
    "w128": Config(2, 2, 128, stages=4),    # 128 x 256, four warpgroups of 64 accumulators
    "w64": Config(1, 2, 128, stages=4),     # 64 x 256
}


def choose_config(n_assignments: int, n_experts: int) -> Config:
    """The tile of every step the MoE strategy sends here (96+ rows an expert; H200: bench/moe_gemm.py)."""
    return CONFIGS["w128"]


def applies(F: int, D: int, stride: int) -> bool:
    """Whether the kernels can run these experts: every row a whole number of 64-feature steps (16-byte aligned)."""
    return D % BK == 0 and F % BK == 0 and stride % 8 == 0


@functools.cache
def weight_row_fn(nw: int, gated: bool):
    """Device function `row(r, n0) -> (column, matrix)`: the weight row that row r of a block's B tile holds, for
    warpgroups of nw rows. gated: warpgroup r // nw's rows are nw / 2 gate rows (matrix 0), then the same F columns'
    up rows (matrix 1), so each thread's accumulators pair gate with up; else column n0 + r of matrix 0."""

    @cuda.jit(device=True, inline=True)
    def row(r, n0):
        if gated:
            within = r % nw
            return n0 + (r // nw) * (nw // 2) + within % (nw // 2), 1 if within >= nw // 2 else 0
        return n0 + r, 0

    return row


@functools.cache
def step_mma_fn(nw: int):
    """Device function `step(acc, smem, a_base, b_base)`: wgmma.fence, then the four m64 n<nw> k16 wgmma's of a
    64-feature step on the swizzled A and B tiles starting at uint32 words a_base and b_base of smem, committed as
    one group (the caller waits for it)."""
    mma = wgmma_bf16_fn(nw)

    @cuda.jit(device=True, inline=True)
    def step(acc, smem, a_base, b_base):
        wgmma_fence()
        for kk in range(BK // 16):
            mma(acc, 0, smem_desc_sw128(smem, a_base + kk * 8, 16, ATOM_BYTES),
                smem_desc_sw128(smem, b_base + kk * 8, 16, ATOM_BYTES), 1)
        wgmma_commit()

    return step


@functools.cache
def _build(cfg: Config, mode: int):
    """Kernel for one block shape and epilogue mode (SwiGLU -> bf16 h; store fp32 rows in assignment order).
    Returns (python function, jitted kernel). No division by a run-time value anywhere (a grid in two dimensions,
    no atomic epilogue's t = assignment // K, silu without IEEE division): ptxas serialises the wgmma's of a kernel
    that calls a subroutine, which those become."""
    WGN, NW, S = cfg.wgn, cfg.nw, cfg.stages
    THREADS, BM, BN = cfg.threads, cfg.block_m, cfg.block_n
    if S < 3:
        raise ValueError("the pipeline needs at least 3 stages (one in flight, one computing, one retiring)")
    gated = mode == _MODE_SWIGLU
    NT = NW // 8
    A_WORDS, B_WORDS = BM * ROW_BYTES // 4, BN * ROW_BYTES // 4   # uint32 words of a stage's A / B tile
    STAGE_WORDS = A_WORDS + B_WORDS
    A_ITERS, B_ITERS = BM * 8 // THREADS, BN * 8 // THREADS     # 16-byte chunks a thread copies per stage
    PRIMED = S - 2
    weight_row, step_mma = weight_row_fn(NW, gated), step_mma_fn(NW)
    wait_copies = cp_async_wait_fn(PRIMED - 1)
    wait_older = wgmma_wait_fn(1)
    wait_all = wgmma_wait_fn(0)
    epilogue = _epilogue(mode, True, 1, NT, silu_approx)

    @cuda.jit(device=True, inline=True)
    def fill(smem, stage, a, w, a_start, b_start, b_valid, k_words, step):
        """This thread's chunks of step `step`'s A and B tiles into `stage` (chunk q: row q // 8, chunk q % 8)."""
        base = stage * STAGE_WORDS
        for it in range(A_ITERS):
            q = cuda.threadIdx.x + it * THREADS
            r, c = q // 8, q % 8
            cp_async16(smem, base + (r * ROW_BYTES + ((c ^ (r % 8)) * 16)) // 4, a,
                       a_start[it] + step * (BK // 2), True)
        for it in range(B_ITERS):
            q = cuda.threadIdx.x + it * THREADS
            r, c = q // 8, q % 8
            ok = b_valid[it] != 0
            cp_async16(smem, base + A_WORDS + (r * ROW_BYTES + ((c ^ (r % 8)) * 16)) // 4, w,
                       (b_start[it] + step * (BK // 2)) if ok else 0, ok)

    def moe_gemm_wgmma_kernel(a, w, tile_expert, num_tiles, sorted_ids, route_w, stride, n_out, k_dim, w_off,
                              up_off, n_tiles_n, top_k, out):
        """a: A rows [rows * k_dim / 2] uint32 (bf16 pairs), w: W flattened likewise; tile_expert [tiles],
        num_tiles [1], sorted_ids [rows] int32; route_w: unused (moe_gemm_mma's signature); stride: elements per
        expert; n_out, k_dim: output columns and input dim (a multiple of 64); w_off: element offset of the matrix
        in an expert (gate or down), up_off: of up; n_tiles_n: unused; top_k: 1; out: h [rows * F / 2] uint32 |
        y [T*K * D] f32. Grid (max_tiles, N tiles): consecutive blocks are an expert's M tiles against one weight
        tile, which stays in L2 for them; block (THREADS,)."""
        m_tile = cuda.blockIdx.x
        n_tile = cuda.blockIdx.y
        if m_tile >= num_tiles[0]:
            return
        expert = tile_expert[m_tile]
        if expert < 0:                          # not this launch's (the expert cache's waves: tile_slots.py)
            return
        wbase = np.int64(expert) * stride
        row0 = np.int64(m_tile) * BM
        n0 = n_tile * (BN // 2 if gated else BN)
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        wgm, wgn = wg // WGN, wg % WGN
        k_words = k_dim // 2

        # S stages of [A tile | B tile], 128-byte swizzled rows, in dynamic shared memory (cfg.shared_bytes)
        smem = cuda.shared.array(0, np.uint32, alignment=ATOM_BYTES)
        acc = cuda.local.array((1, NT, 4), np.float32)
        for j in range(NT):
            for v in range(4):
                acc[0, j, v] = np.float32(0.0)
        # this thread's chunks: uint32 word of row r's chunk c at step 0, and (B) whether its row exists
        a_start = cuda.local.array(A_ITERS, np.int64)
        b_start = cuda.local.array(B_ITERS, np.int64)
        b_valid = cuda.local.array(B_ITERS, np.int32)
        for it in range(A_ITERS):
            q = tid + it * THREADS
            a_start[it] = ((row0 + q // 8) * k_dim + (q % 8) * 8) // 2
        for it in range(B_ITERS):
            q = tid + it * THREADS
            col, mat = weight_row(q // 8, n0)
            off = up_off if mat else w_off
            b_start[it] = (wbase + off + np.int64(col) * k_dim + (q % 8) * 8) // 2
            b_valid[it] = 1 if col < n_out else 0

        n_steps = k_dim // BK
        for s in range(PRIMED):
            if s < n_steps:
                fill(smem, s, a, w, a_start, b_start, b_valid, k_words, s)
            cp_async_commit()
        a_row = wgm * 64 * ROW_BYTES // 4
        b_row = A_WORDS + wgn * NW * ROW_BYTES // 4
        for step in range(n_steps):
            wait_copies()
            fence_proxy_async()
            cuda.syncthreads()
            nxt = step + PRIMED
            if nxt < n_steps:
                fill(smem, nxt % S, a, w, a_start, b_start, b_valid, k_words, nxt)
            cp_async_commit()
            base = (step % S) * STAGE_WORDS
            step_mma(acc, smem, base + a_row, base + b_row)
            wait_older()
        wait_all()

        lane = tid % WARP
        warp_in_group = (tid // WARP) % 4
        epilogue(acc, out, sorted_ids, route_w, row0 + wgm * 64 + warp_in_group * 16, n0, n_out, top_k, wgn,
                 lane // 4, lane % 4)

    # one block an SM: ptxas fits the registers to THREADS (512 threads: 128 each)
    return moe_gemm_wgmma_kernel, cached_jit(moe_gemm_wgmma_kernel, launch_bounds=(THREADS, 1))


# ---- launchers ---------------------------------------------------------------------------------------------
def _require(F: int, D: int, W, *arrays) -> None:
    _check_weights(W, F, D)
    if not applies(F, D, W.shape[1]) or not aligned_to(16, W, *arrays):
        raise ValueError(f"moe_gemm_wgmma needs D and F multiples of {BK} and 16-byte aligned buffers, got D={D} F={F} "
                         f"expert stride {W.shape[1]}")


def launch_wgmma_gate_up(xs, tile_expert, num_tiles, W, F: int, D: int, h, config: Config, stream=0) -> None:
    """xs [rows, D] uint16 (bf16, from launch_moe_gather_bf16), tile_expert [tiles] / num_tiles [1] int32
    (launch_moe_align with block_m = config.block_m; rows = tiles * BM), W [E, stride] uint16
    -> h [rows, F] uint16 (bf16 of silu(xs gate^T) * (xs up^T)) in every used row (padding rows: zeros)."""
    tiles = tile_expert.shape[0]
    rows = tiles * config.block_m
    check_array("xs", xs, (rows, D), np.uint16)
    check_array("h", h, (rows, F), np.uint16)
    check_array("tile_expert", tile_expert, (tiles,), np.int32)
    check_array("num_tiles", num_tiles, (1,), np.int32)
    _require(F, D, W, xs, h)
    if tiles == 0:
        return
    n_tiles_n = -(-F // (config.block_n // 2))
    _launch(_build(config, _MODE_SWIGLU)[1], (tiles, n_tiles_n), config, stream, (
        _flat(xs, True), _flat(W, True), tile_expert, num_tiles, tile_expert, _float_dummy(num_tiles),
        np.int64(W.shape[1]), np.int64(F), np.int64(D), np.int64(0), np.int64(F * D), np.int64(n_tiles_n),
        np.int64(1), _flat(h, True)))


def launch_wgmma_down(h, tile_expert, num_tiles, sorted_ids, W, F: int, D: int, out, config: Config,
                      stream=0) -> None:
    """h [rows, F] uint16 (bf16, from launch_wgmma_gate_up), tile_expert / num_tiles / sorted_ids from
    launch_moe_align, W [E, stride] uint16 -> out [T*K, D] f32 = y in assignment order (every routed row
    written; launch_moe_combine adds them up), as moe_gemm_mma's "store" combine."""
    tiles = tile_expert.shape[0]
    rows = tiles * config.block_m
    check_array("h", h, (rows, F), np.uint16)
    check_array("sorted_ids", sorted_ids, (rows,), np.int32)
    check_array("tile_expert", tile_expert, (tiles,), np.int32)
    check_array("num_tiles", num_tiles, (1,), np.int32)
    if out.ndim != 2:
        raise ValueError("launch_wgmma_down needs out [T*K, D]")
    check_array("out", out, (out.shape[0], D), np.float32)
    _require(F, D, W, h)
    if tiles == 0 or out.shape[0] == 0:
        return
    n_tiles_n = -(-D // config.block_n)
    _launch(_build(config, _MODE_STORE)[1], (tiles, n_tiles_n), config, stream, (
        _flat(h, True), _flat(W, True), tile_expert, num_tiles, sorted_ids, _float_dummy(num_tiles),
        np.int64(W.shape[1]), np.int64(D), np.int64(F), np.int64(2 * F * D), np.int64(0), np.int64(n_tiles_n),
        np.int64(1), out.reshape(out.size)))


def sm90_signatures():
    """(python function, numba signature, compile options): both epilogues at each config, for sm_90a."""
    i1, i64, f1, u1 = types.int32[::1], types.int64, types.float32[::1], types.uint32[::1]
    out = []
    for cfg in CONFIGS.values():
        for mode in (_MODE_SWIGLU, _MODE_STORE):
            dst = u1 if mode == _MODE_SWIGLU else f1
            out.append((_build(cfg, mode)[0], (u1, u1, i1, i1, i1, f1, i64, i64, i64, i64, i64, i64, i64, dst),
                        {"cc": (9, 0, "a"), "launch_bounds": (cfg.threads, 1)}))
    return out
