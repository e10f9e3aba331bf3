"""Grouped MoE GEMM on tensor cores for steps with many tokens: every expert of a layer in one launch per matrix,
tokens sorted by expert on the device (`moe_align`), inline-PTX mma.sync m16n8k16 bf16 with fp32 accumulation
(`kernels.mma`, as `attention_prefill_mma`). No host synchronisation anywhere: graph-capturable.

Per MoE layer (bf16 weights W [E, stride], expert e = gate [F, D], up [F, D], down [D, F] row-major):
  launch_moe_align(ids, E, BM, sorted_ids, tile_expert, num_tiles, position)       counting sort, padded to BM
  launch_moe_gather_bf16(x, sorted_ids, num_tiles, K, BM, xs)                      xs [rows, D] bf16
  launch_moe_gemm_gate_up(xs, tile_expert, num_tiles, W, F, D, h)                  h = silu(xs gate^T) * (xs up^T), bf16
  launch_moe_gemm_down(h, tile_expert, num_tiles, sorted_ids, W, F, D, ...)        two epilogues:
      combine="atomic": out[t] += w[t, k] * (h @ down^T) row by row (fp32 atomics into the residual [T, D])
      combine="store":  y[t*K + k] = h @ down^T (fp32, assignment order), then launch_moe_combine(y,
                        identity position, weights, residual) -- deterministic
Reference: `moe_reference` (numpy, the same bf16 roundings of x and h).

Kernel design (one block = BM padded rows of one expert x BN weight rows; 32 * WM * WN threads):
- Grid: 1-D, max_tiles(T*K, E, BM) x N tiles, sized from the upper bound on the host; a block whose M tile is
  >= num_tiles[0] (device), or whose tile_expert entry is negative (a tile the expert cache leaves for another
  wave: W is then the slot buffer and the entries are slots, tile_slots.py), exits at once. Blocks are numbered in groups of GROUP_M M tiles (Triton's grouped
  order): consecutive blocks share an expert's weight tiles and a few A tiles, so both stay in L2.
- gate|up: the block's BN weight rows are BN/2 gate rows and the same BN/2 up rows (F columns f0 .. f0+BN/2),
  and each warp holds matching gate and up accumulators, so SwiGLU is the epilogue; h is written as bf16.
- Main loop over the input dim in BK steps: A [BM, BK] and B [BN, BK] tiles in a ring of S stages in dynamic
  shared memory, as uint64 words of 4 bf16 (XOR-swizzled rows: the fragment loads are free of bank conflicts
  without padding). Aligned (D, F multiples of 8): 16-byte `cp.async` copies straight from global to shared
  (`ptx.cp_async16`), S - 1 steps in flight; each step waits for its stage, passes one barrier, refills the
  stage the previous step used, then runs its mma's. Input dims that are a multiple of BK (real models) skip
  the K-tail checks. Otherwise ("generic": any D, F) the same pipeline with checked element loads and plain
  shared stores.
- mma fragments: the k index is permuted so that one 8-byte shared load is a lane's whole pair of A (or B)
  registers: lane t's "2t, 2t+1" / "2t+8, 2t+9" k slots hold k = 16 ks + 4t .. 4t+3 (kernels/mma.py).
- Warp tile: MT m-tiles of 16 rows x NT n-tiles of 8 weight rows; fp32 accumulators in registers.
Under NUMBA_ENABLE_CUDASIM the mma and bf16 packing are emulated through shared memory (the PTX fragment
layout, exactly: `mma.block_mma`) and cp.async is a plain copy, on small tiles, so the indexing is tested in
CI; the kernels are otherwise identical.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

import numpy as np
from numba import cuda, types

from common.dtypes import bf16_to_float32, float32_to_bf16
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.mma import block_mma as mma
from expert_service.kernels.mma import block_pack as pack
from expert_service.kernels.numeric import SIMULATOR, WARP, aligned_to, check_array, f32_to_bf16, silu
from expert_service.kernels.ptx import cp_async16, cp_async_commit, cp_async_wait_fn


class Config(NamedTuple):
    """Block shape: WM x WN warps, each MT m-tiles (16 rows) x NT n-tiles (8 weight rows); BK input features
    per main-loop step (16, 32 or 64); STAGES shared-memory stages of the copy pipeline (S - 1 steps of loads
    in flight while one computes); GROUP_M M tiles per block group of the grid order."""
    wm: int
    wn: int
    mt: int
    nt: int
    bk: int = 32
    stages: int = 3
    group_m: int = 8

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * self.bk * 2

    @property
    def threads(self) -> int:
        return WARP * self.wm * self.wn

    @property
    def block_m(self) -> int:
        return 16 * self.mt * self.wm

    @property
    def block_n(self) -> int:
        return 8 * self.nt * self.wn


# Named shapes, by the rows per routed expert they suit (bench/moe_gemm.py times these and neighbours; H200
# figures in docs/kernels.md). Small tiles stream weights (memory-bound: 64 features = 128-byte row pieces per
# stage, 3-4 stages in flight); large ones reuse each weight tile over more rows (compute-bound).
# SIM: tiny tiles for the simulator (one Python thread per CUDA thread).
CONFIGS = {
    "m16": Config(1, 4, 1, 4, bk=64, stages=3),
    "m32": Config(1, 4, 2, 4, bk=64, stages=3),
    "m64": Config(2, 2, 2, 8, bk=32, stages=3),
    "m128": Config(2, 4, 4, 4, bk=32, stages=3),
}
SIM_CONFIG = Config(1, 2, 1, 2, bk=16, stages=2, group_m=2)
SIM_CONFIG_2 = Config(2, 1, 1, 4, bk=32, stages=3, group_m=1)   # two warps along M, BK 32 (swizzled rows)
COMBINE_ATOMIC, COMBINE_STORE = "atomic", "store"
# _MODE_ADD: the store's rows added to out (each element has one writer: no atomics), for a projection that ends
# in the residual (moe_gemm_q8mma's 8-bit attention o_proj)
_MODE_SWIGLU, _MODE_STORE, _MODE_ATOMIC, _MODE_ADD = 0, 1, 2, 3
_LO32 = np.uint64(0xFFFFFFFF)
_WORD = np.dtype(np.uint64)   # a dtype instance: the simulator's dynamic shared array needs its itemsize
# cp.async writes 16-byte words: the stages' base must be 16-byte aligned whatever else shares the block's
# shared memory (Numba aligns a dynamic array to its itemsize only). The simulator rejects any alignment.
_SMEM_ALIGN = None if SIMULATOR else 16


def choose_config(n_assignments: int, n_experts: int) -> Config:
    """Tile shape for a step, by the mean rows per routed expert. On the H200 (bench/moe_gemm.py): m16 at 1-4
    rows (qwen3 T = 16, 64; mixtral T = 16), m32 at 16-32 (mixtral T = 64, qwen3 T = 512), m64 at 128 (qwen3
    T = 2048, mixtral T = 512), m128 at 512 (mixtral T = 2048)."""
    if SIMULATOR:
        return SIM_CONFIG
    per_expert = n_assignments / max(1, min(n_experts, n_assignments))
    if per_expert >= 256:
        return CONFIGS["m128"]
    if per_expert >= 64:
        return CONFIGS["m64"]
    if per_expert >= 12:
        return CONFIGS["m32"]
    return CONFIGS["m16"]


@cuda.jit(device=True, inline=True)
def _u64(lo, hi):
    return np.uint64(lo) | (np.uint64(hi) << np.uint64(32))


@cuda.jit(device=True, inline=True)
def _pair16(a, i, valid0, valid1):
    """uint32 of the bf16 elements a[i] (low half) and a[i+1] (high half) of a uint16 array, zero where invalid."""
    lo = np.uint32(a[i]) if valid0 else np.uint32(0)
    hi = np.uint32(a[i + 1]) if valid1 else np.uint32(0)
    return lo | (hi << np.uint32(16))


def _swizzle(words_per_row: int):
    """Physical uint64 word of logical word w in shared row r: XOR of w's 4-word group with a function of r so
    that the rows g = 0..3 a half-warp reads land on distinct banks (rows of 32, 64 or 128 bytes)."""
    if words_per_row == 4:
        @cuda.jit(device=True, inline=True)
        def swz(r, w):
            return w
    elif words_per_row == 8:
        @cuda.jit(device=True, inline=True)
        def swz(r, w):
            return w ^ (((r >> 1) & 1) << 2)
    elif words_per_row == 16:
        @cuda.jit(device=True, inline=True)
        def swz(r, w):
            return w ^ ((r & 3) << 2)
    else:
        raise ValueError(f"BK must be 16, 32 or 64, got {4 * words_per_row}")
    return swz


def _epilogue(mode: int, aligned: bool, MT: int, NT: int, activation=silu):
    """epi(acc, out, sorted_ids, route_w, m0, n0, n_out, top_k, wn, g, t): write a warp's accumulators
    acc [MT, NT, 4] (rows m0 + 16 i + g + 8 (v // 2), n-tile j, column 2t + v % 2) to `out`; activation: the
    SwiGLU's silu (device function)."""
    NH = NT // 2
    if mode == _MODE_SWIGLU:
        # h[m, f] = silu(gate) * up: gate n-tiles are j < NH, their up partners j + NH; f = n0 + (wn NH + j) 8 + 2t
        if aligned:
            @cuda.jit(device=True, inline=True)
            def epi(acc, out, sorted_ids, route_w, m0, n0, n_out, top_k, wn, g, t):
                for i in range(MT):
                    for hv in range(2):
                        m = m0 + i * 16 + g + 8 * hv
                        for j in range(NH):
                            f = n0 + (wn * NH + j) * 8 + 2 * t
                            if f < n_out:        # n_out even: the pair lies inside the row
                                out[(m * n_out + f) >> 1] = pack(
                                    activation(acc[i, j, 2 * hv]) * acc[i, j + NH, 2 * hv],
                                    activation(acc[i, j, 2 * hv + 1]) * acc[i, j + NH, 2 * hv + 1])
        else:
            @cuda.jit(device=True, inline=True)
            def epi(acc, out, sorted_ids, route_w, m0, n0, n_out, top_k, wn, g, t):
                for i in range(MT):
                    for hv in range(2):
                        m = m0 + i * 16 + g + 8 * hv
                        for j in range(NH):
                            f = n0 + (wn * NH + j) * 8 + 2 * t
                            for e in range(2):
                                if f + e < n_out:
                                    out[m * n_out + f + e] = f32_to_bf16(
                                        activation(acc[i, j, 2 * hv + e]) * acc[i, j + NH, 2 * hv + e])
        return epi
    atomic = mode == _MODE_ATOMIC

    if atomic:
        @cuda.jit(device=True, inline=True)
        def put(out, idx, value, scale):
            cuda.atomic.add(out, idx, value * scale)
    elif mode == _MODE_ADD:
        @cuda.jit(device=True, inline=True)
        def put(out, idx, value, scale):
            out[idx] += value
    else:
        @cuda.jit(device=True, inline=True)
        def put(out, idx, value, scale):
            out[idx] = value

    @cuda.jit(device=True, inline=True)  # type: ignore[no-redef]  # the swiglu branch returned its own epi above
    def epi(acc, out, sorted_ids, route_w, m0, n0, n_out, top_k, wn, g, t):
        # row m holds assignment sorted_ids[m] (-1: padding, dropped): y row asg (store, add) or residual row
        # asg // K scaled by its routing weight (atomic)
        for i in range(MT):
            for hv in range(2):
                asg = sorted_ids[m0 + i * 16 + g + 8 * hv]
                if asg >= 0:
                    if atomic:
                        scale = route_w[asg]
                        dst = np.int64(asg // top_k) * n_out
                    else:
                        scale = np.float32(1.0)
                        dst = np.int64(asg) * n_out
                    for j in range(NT):
                        d = n0 + (wn * NT + j) * 8 + 2 * t
                        for e in range(2):
                            if d + e < n_out:
                                put(out, dst + d + e, acc[i, j, 2 * hv + e], scale)
    return epi


def _stage_copier(aligned: bool, exact_k: bool):
    """copy(dst, di, src, i, k, k_dim, valid): the 8 bf16 at element i of src, whose first is column k of its row,
    into the shared words dst[di], dst[di + 1]; columns >= k_dim (or all, when not valid) as zeros.
    Aligned: one 16-byte cp.async from a uint32 view (i, k, k_dim multiples of 8; a masked chunk reads
    nothing), completed by the pipeline's wait; exact_k: k_dim is a multiple of the step, no column check.
    Generic: 8 checked element loads from a uint16 array and two plain shared stores (synchronous)."""
    if aligned:
        @cuda.jit(device=True, inline=True)
        def copy(dst, di, src, i, k, k_dim, valid):
            ok = valid if exact_k else valid and k < k_dim
            cp_async16(dst, di, src, (i >> 1) if ok else 0, ok)
    else:
        @cuda.jit(device=True, inline=True)
        def copy(dst, di, src, i, k, k_dim, valid):
            dst[di] = _u64(_pair16(src, i, valid and k < k_dim, valid and k + 1 < k_dim),
                           _pair16(src, i + 2, valid and k + 2 < k_dim, valid and k + 3 < k_dim))
            dst[di + 1] = _u64(_pair16(src, i + 4, valid and k + 4 < k_dim, valid and k + 5 < k_dim),
                               _pair16(src, i + 6, valid and k + 6 < k_dim, valid and k + 7 < k_dim))
    return copy


def _stage_filler(copy, threads: int, a_iters: int, b_iters: int, a_chunks: int, b_chunks: int):
    """fill(smem, a_stage, b_stage, k0, a, w, k_dim, tid, a_start, a_word, a_col, b_start, b_word, b_col, b_valid):
    this thread's chunks of the A and B tiles at input column k0 into the stage whose first words are a_stage
    and b_stage (the per-chunk arrays are the kernel's: element at step 0, word in a stage, column, validity)."""
    @cuda.jit(device=True, inline=True)
    def fill(smem, a_stage, b_stage, k0, a, w, k_dim, tid, a_start, a_word, a_col, b_start, b_word, b_col, b_valid):
        for it in range(a_iters):
            if a_iters * threads == a_chunks or tid + it * threads < a_chunks:
                copy(smem, a_stage + a_word[it], a, a_start[it] + k0, k0 + a_col[it], k_dim, True)
        for it in range(b_iters):
            if b_iters * threads == b_chunks or tid + it * threads < b_chunks:
                copy(smem, b_stage + b_word[it], w, b_start[it] + k0, k0 + b_col[it], k_dim, b_valid[it] != 0)
    return fill


@functools.cache
def _build(cfg: Config, mode: int, aligned: bool, exact_k: bool = False):
    """Kernel for one block shape, epilogue mode (SwiGLU -> bf16 h; store fp32 rows; atomic weighted combine),
    load width and whether the input dim is a multiple of BK (aligned only: no tail checks). Returns (python
    function, jitted kernel)."""
    _, WN, MT, NT, BK, S, GM = cfg.wm, cfg.wn, cfg.mt, cfg.nt, cfg.bk, cfg.stages, cfg.group_m
    THREADS, BM, BN = cfg.threads, cfg.block_m, cfg.block_n
    gated = mode == _MODE_SWIGLU
    if gated and NT % 2:
        raise ValueError("gate|up needs an even number of n-tiles per warp")
    if S < 2:
        raise ValueError("the pipeline needs at least 2 stages")
    WPR = BK // 4                       # uint64 words per shared row
    CPR = BK // 8                       # 16-byte chunks per tile row
    A_WORDS, B_WORDS = BM * WPR, BN * WPR
    B_SHARED = S * A_WORDS              # first word of the B stages
    A_CHUNKS, B_CHUNKS = BM * CPR, BN * CPR
    A_ITERS = -(-A_CHUNKS // THREADS)   # chunks per thread per stage
    B_ITERS = -(-B_CHUNKS // THREADS)
    KS = BK // 16
    NH = NT // 2
    HALF_N = BN // 2                    # gated: F columns per block
    swz = _swizzle(WPR)
    fill_stage = _stage_filler(_stage_copier(aligned, aligned and exact_k), THREADS, A_ITERS, B_ITERS, A_CHUNKS,
                               B_CHUNKS)
    wait_stage = cp_async_wait_fn(S - 2)
    epilogue = _epilogue(mode, aligned, MT, NT)

    def moe_gemm_mma_kernel(a, w, tile_expert, num_tiles, sorted_ids, route_w, stride, n_out, k_dim, w_off,
                            up_off, n_tiles_n, top_k, out):
        """a: A rows [rows * k_dim] bf16 (uint32 view if aligned, else uint16), w: W flattened likewise;
        tile_expert [tiles], num_tiles [1], sorted_ids [rows] int32; route_w [T*K] f32 (atomic mode);
        stride: elements per expert; n_out, k_dim: output columns and input dim; w_off: element offset of the
        matrix in an expert (gate or down), up_off: of up; n_tiles_n: N tiles; top_k: K;
        out: h [rows * F] bf16 (uint32 view if aligned, else uint16) | y [T*K * D] f32 | residual [T * D] f32.
        Grid (max_tiles * n_tiles_n,), block (THREADS,)."""
        tiles = tile_expert.shape[0]
        b = cuda.blockIdx.x
        group = b // (GM * n_tiles_n)
        first = group * GM
        gsize = min(GM, tiles - first)
        local = b - group * GM * n_tiles_n
        m_tile = first + local % gsize
        n_tile = local // gsize
        if m_tile >= num_tiles[0]:
            return
        expert = tile_expert[m_tile]
        if expert < 0:                          # not this launch's (the expert cache's waves: tile_slots.py)
            return
        wbase = np.int64(expert) * stride
        row0 = np.int64(m_tile) * BM            # first padded row of the tile
        n0 = n_tile * (HALF_N if gated else BN)   # first output column (gated: F column)

        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        wm = warp // WN
        wn = warp % WN
        g = lane // 4
        t = lane % 4

        # S stages of A [BM, WPR] and then S stages of B [BN, WPR] uint64 words (4 bf16 each), rows XOR-swizzled,
        # in dynamic shared memory (cfg.shared_bytes; above 48 KB the launcher raises the kernel's limit)
        smem = cuda.shared.array(0, _WORD, alignment=_SMEM_ALIGN)
        acc = cuda.local.array((MT, NT, 4), np.float32)
        af = cuda.local.array((MT, 4), np.uint32)
        for i in range(MT):
            for j in range(NT):
                for v in range(4):
                    acc[i, j, v] = np.float32(0.0)

        # This thread's chunks of a stage: global element at step 0, shared word in a stage, column, validity.
        a_start = cuda.local.array(A_ITERS, np.int64)
        a_word = cuda.local.array(A_ITERS, np.uint32)
        a_col = cuda.local.array(A_ITERS, np.int32)
        b_start = cuda.local.array(B_ITERS, np.int64)
        b_word = cuda.local.array(B_ITERS, np.uint32)
        b_col = cuda.local.array(B_ITERS, np.int32)
        b_valid = cuda.local.array(B_ITERS, np.int32)
        for it in range(A_ITERS):
            q = tid + it * THREADS
            r = q // CPR
            c = q % CPR
            a_start[it] = (row0 + r) * k_dim + c * 8
            a_word[it] = r * WPR + swz(r, 2 * c)
            a_col[it] = c * 8
        for it in range(B_ITERS):
            q = tid + it * THREADS
            r = q // CPR
            c = q % CPR
            if gated:
                col = n0 + (r % HALF_N)
                b_start[it] = wbase + (up_off if r >= HALF_N else w_off) + np.int64(col) * k_dim + c * 8
            else:
                col = n0 + r
                b_start[it] = wbase + w_off + np.int64(col) * k_dim + c * 8
            b_word[it] = r * WPR + swz(r, 2 * c)
            b_col[it] = c * 8
            b_valid[it] = 1 if (col < n_out and q < B_CHUNKS) else 0

        # Fragment words: row r's logical word 4 ks + t sits at r * WPR + 4 (ks ^ f) + t, where the swizzle
        # group f depends on r only through g for every row a lane reads (A rows g + 16 i (+ 8), B rows g + 8 j):
        # a per-lane base plus constant offsets, unsigned (no negative-index handling in the loop).
        f = np.uint32(swz(g, 0) >> 2)
        a_lane = np.uint32((wm * MT * 16 + g) * WPR + t)
        b_lane = np.uint32(((wn * NH if gated else wn * NT) * 8 + g) * WPR + t)

        n_steps = (k_dim + BK - 1) // BK
        # Pipeline: stages 0 .. S-2 in flight before the loop; step s waits for its stage, then refills the stage
        # step s-1 used (every warp is past it after the barrier) with step s+S-1, then runs its mma's.
        for s in range(S - 1):
            if s < n_steps:
                fill_stage(smem, np.uint32(s * A_WORDS), np.uint32(B_SHARED + s * B_WORDS), s * BK, a, w, k_dim,
                           tid, a_start, a_word, a_col, b_start, b_word, b_col, b_valid)
            cp_async_commit()

        cur = np.uint32(0)                # stage of this step
        fs = np.uint32(S - 1)             # stage the refill goes to
        for step in range(n_steps):
            wait_stage()
            cuda.syncthreads()
            fill = step + S - 1
            if fill < n_steps:
                fill_stage(smem, fs * np.uint32(A_WORDS), np.uint32(B_SHARED) + fs * np.uint32(B_WORDS), fill * BK,
                           a, w, k_dim, tid, a_start, a_word, a_col, b_start, b_word, b_col, b_valid)
            cp_async_commit()
            a_base = cur * np.uint32(A_WORDS) + a_lane
            b_base = np.uint32(B_SHARED) + cur * np.uint32(B_WORDS) + b_lane
            for ks in range(KS):
                kw = (np.uint32(ks) ^ f) << np.uint32(2)
                for i in range(MT):
                    lo_row = smem[a_base + kw + np.uint32(i * 16 * WPR)]
                    hi_row = smem[a_base + kw + np.uint32((i * 16 + 8) * WPR)]
                    af[i, 0] = np.uint32(lo_row & _LO32)
                    af[i, 2] = np.uint32(lo_row >> np.uint64(32))
                    af[i, 1] = np.uint32(hi_row & _LO32)
                    af[i, 3] = np.uint32(hi_row >> np.uint64(32))
                for j in range(NT):
                    if gated:
                        n_row = (j // NH) * HALF_N + (j % NH) * 8
                    else:
                        n_row = j * 8
                    bw = smem[b_base + kw + np.uint32(n_row * WPR)]
                    b0 = np.uint32(bw & _LO32)
                    b1 = np.uint32(bw >> np.uint64(32))
                    for i in range(MT):
                        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma(
                            af[i, 0], af[i, 1], af[i, 2], af[i, 3], b0, b1,
                            acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
            cur = np.uint32(0) if cur == S - 1 else cur + np.uint32(1)
            fs = np.uint32(0) if fs == S - 1 else fs + np.uint32(1)

        # epilogue: accumulator (i, j, v) is row g + 8 (v // 2) of m-tile i, column 2t + v % 2 of n-tile j
        epilogue(acc, out, sorted_ids, route_w, row0 + wm * MT * 16, n0, n_out, top_k, wn, g, t)

    return moe_gemm_mma_kernel, cached_jit(moe_gemm_mma_kernel)


# ---- launchers ---------------------------------------------------------------------------------------------
def is_aligned(F: int, D: int, stride: int) -> bool:
    """16-byte loads need every weight/activation row to start on 16 bytes: D, F and the expert stride
    multiples of 8 bf16 values (the model format aligns expert blocks to 4096 bytes; D and F are the model's)."""
    return D % 8 == 0 and F % 8 == 0 and stride % 8 == 0


_STATIC_SHARED_MAX = 48 * 1024
_raised_shared: set[tuple[int, int]] = set()     # (kernel, device) pairs allowed their dynamic shared memory


class LaunchShape(Protocol):
    """What _launch reads of a block shape (this module's Config, moe_gemm_wgmma's)."""

    @property
    def threads(self) -> int: ...

    @property
    def shared_bytes(self) -> int: ...


def _launch(kernel, grid: int | tuple[int, int], cfg: LaunchShape, stream, args, shared_bytes: int | None = None) -> None:
    """kernel[grid, cfg.threads, stream, shared_bytes (default cfg.shared_bytes)](*args) (launch_with_shared)."""
    nbytes = cfg.shared_bytes if shared_bytes is None else shared_bytes
    launch_with_shared(kernel, grid, cfg.threads, stream, args, nbytes)


def launch_with_shared(kernel, grid, threads: int, stream, args, nbytes: int) -> None:
    """kernel[grid, threads, stream, nbytes](*args); a kernel that needs more than 48 KB of dynamic shared memory
    must first be allowed it (cuKernelSetAttribute on the compiled function: Numba has no API)."""
    # Once per kernel and device: each kernel has one overload (the launchers pass C-contiguous 1-d arrays of
    # fixed dtypes), so typing the arguments on every launch would only cost host time.
    key = (id(kernel), cuda.get_current_device().id) if nbytes > _STATIC_SHARED_MAX and not SIMULATOR else None
    if key is not None and key not in _raised_shared:
        from cuda.bindings.driver import CUfunction_attribute
        from numba.cuda.cudadrv.driver import driver as cu_driver
        cufunc = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))._codelibrary.get_cufunc()
        cu_driver.cuKernelSetAttribute(CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       nbytes, cufunc.handle, cufunc.device.id)
        _raised_shared.add(key)
    kernel[grid, threads, stream, nbytes](*args)


def _check_weights(W, F, D):
    if W.ndim != 2 or np.dtype(W.dtype) != np.uint16 or not W.flags["C_CONTIGUOUS"] or W.shape[1] < 3 * F * D:
        raise ValueError(f"moe_gemm_mma needs bf16 weights as C-contiguous uint16 [E, stride >= 3*F*D], "
                         f"got {W.dtype} {W.shape}")


def _flat(a, aligned):
    f = a.reshape(a.size)
    return f.view(np.uint32) if aligned else f


def launch_moe_gemm_gate_up(xs, tile_expert, num_tiles, W, F: int, D: int, h, config: Config | None = None,
                            stream=0) -> None:
    """xs [rows, D] uint16 (bf16, from launch_moe_gather_bf16), tile_expert [tiles] / num_tiles [1] int32
    (launch_moe_align with block_m = config.block_m; rows = tiles * BM), W [E, stride] uint16
    -> h [rows, F] uint16 (bf16 of silu(xs gate^T) * (xs up^T)) in every used row (padding rows: zeros)."""
    cfg = config or choose_config_for(xs.shape[0], tile_expert.shape[0])
    _check_weights(W, F, D)
    tiles = tile_expert.shape[0]
    rows = tiles * cfg.block_m
    check_array("xs", xs, (rows, D), np.uint16)
    check_array("h", h, (rows, F), np.uint16)
    check_array("tile_expert", tile_expert, (tiles,), np.int32)
    check_array("num_tiles", num_tiles, (1,), np.int32)
    if tiles == 0:
        return
    aligned = is_aligned(F, D, W.shape[1]) and aligned_to(16, xs, W, h)
    n_tiles_n = -(-F // (cfg.block_n // 2))
    kernel = _build(cfg, _MODE_SWIGLU, aligned, aligned and D % cfg.bk == 0)[1]
    dummy_i, dummy_f = tile_expert, num_tiles       # unused in this mode (typed like the real ones)
    _launch(kernel, tiles * n_tiles_n, cfg, stream, (
        _flat(xs, aligned), _flat(W, aligned), tile_expert, num_tiles, dummy_i, _float_dummy(dummy_f),
        np.int64(W.shape[1]), np.int64(F), np.int64(D), np.int64(0), np.int64(F * D), np.int64(n_tiles_n),
        np.int64(1), _flat(h, aligned)))


def launch_moe_gemm_down(h, tile_expert, num_tiles, sorted_ids, W, F: int, D: int, out, route_weights=None,
                         combine: str = COMBINE_ATOMIC, config: Config | None = None, stream=0) -> None:
    """h [rows, F] uint16 (bf16, from launch_moe_gemm_gate_up), tile_expert / num_tiles / sorted_ids from
    launch_moe_align, W [E, stride] uint16.
    combine="atomic": route_weights [T, K] f32, out [T, D] f32 (the residual): out[t] += w[t, k] * y[t*K + k]
      for every assignment (fp32 atomics: summation order not fixed).
    combine="store": out [T*K, D] f32 = y in assignment order (every routed row written); route_weights unused.
    Then launch_moe_combine(out, identity position, weights, residual) adds them up deterministically."""
    cfg = config or choose_config_for(h.shape[0], tile_expert.shape[0])
    _check_weights(W, F, D)
    tiles = tile_expert.shape[0]
    rows = tiles * cfg.block_m
    check_array("h", h, (rows, F), np.uint16)
    check_array("sorted_ids", sorted_ids, (rows,), np.int32)
    check_array("tile_expert", tile_expert, (tiles,), np.int32)
    check_array("num_tiles", num_tiles, (1,), np.int32)
    if combine == COMBINE_ATOMIC:
        if route_weights is None or route_weights.ndim != 2:
            raise ValueError("combine='atomic' needs route_weights [T, K]")
        n_tok, top_k = route_weights.shape
        check_array("route_weights", route_weights, (n_tok, top_k), np.float32)
        check_array("out", out, (n_tok, D), np.float32)
        mode, rw = _MODE_ATOMIC, route_weights.reshape(n_tok * top_k)
    elif combine == COMBINE_STORE:
        if out.ndim != 2:
            raise ValueError("combine='store' needs out [T*K, D]")
        check_array("out", out, (out.shape[0], D), np.float32)
        mode, top_k, rw = _MODE_STORE, 1, _float_dummy(num_tiles)
    else:
        raise ValueError(f"combine must be {COMBINE_ATOMIC!r} or {COMBINE_STORE!r}, got {combine!r}")
    if tiles == 0 or out.shape[0] == 0:
        return
    aligned = is_aligned(F, D, W.shape[1]) and aligned_to(16, h, W)
    n_tiles_n = -(-D // cfg.block_n)
    kernel = _build(cfg, mode, aligned, aligned and F % cfg.bk == 0)[1]
    _launch(kernel, tiles * n_tiles_n, cfg, stream, (
        _flat(h, aligned), _flat(W, aligned), tile_expert, num_tiles, sorted_ids, rw,
        np.int64(W.shape[1]), np.int64(D), np.int64(F), np.int64(2 * F * D), np.int64(0), np.int64(n_tiles_n),
        np.int64(top_k), out.reshape(out.size)))


def choose_config_for(rows: int, tiles: int) -> Config:
    """The config whose block_m matches buffers of `rows` rows over `tiles` tiles (launchers without config=)."""
    if SIMULATOR:
        for cfg in (SIM_CONFIG, SIM_CONFIG_2):
            if cfg.block_m * tiles == rows:
                return cfg
    for cfg in CONFIGS.values():
        if cfg.block_m * tiles == rows:
            return cfg
    raise ValueError(f"no config with block_m = {rows} / {tiles}: pass config=")


def _float_dummy(like):
    """A float32 1-d view for the unused route_w argument (any device array's first 4 bytes)."""
    return like.reshape(like.size).view(np.float32)


# ---- numpy reference --------------------------------------------------------------------------------------
def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), as float32 (the model files' conversion, common.dtypes)."""
    return bf16_to_float32(float32_to_bf16(x))


def moe_reference(x, ids, route_weights, mats, residual=None):
    """x [T, D] f32, ids / route_weights [T, K], mats[e] = (gate [F, D], up [F, D], down [D, F]) f32 (exact bf16
    values) -> (h_rows [T*K, F] in assignment order, y [T*K, D], out [T, D] = residual + sum_k w * y); x and h
    rounded to bf16 as the kernels do, products in float64."""
    n_tok, top_k = ids.shape
    xb = bf16_round(x).astype(np.float64)
    F, D = mats[0][0].shape
    h = np.zeros((n_tok * top_k, F), np.float32)
    y = np.zeros((n_tok * top_k, D), np.float64)
    for e in np.unique(ids):
        gate, up, down = (m.astype(np.float64) for m in mats[int(e)])
        rows = np.flatnonzero(ids.reshape(-1) == e)
        xe = xb[rows // top_k]
        g = xe @ gate.T
        he = bf16_round((g / (1.0 + np.exp(-g)) * (xe @ up.T)).astype(np.float32))
        h[rows] = he
        y[rows] = he.astype(np.float64) @ down.T
    out = np.zeros((n_tok, D)) if residual is None else residual.astype(np.float64).copy()
    out += (y.reshape(n_tok, top_k, D) * route_weights[:, :, None]).sum(axis=1)
    return h, y.astype(np.float32), out.astype(np.float32)


def sm90_signatures():
    """(python function, numba signature): every epilogue with 16-byte loads at each named config (input dim a
    multiple of BK, as real models have), and at one config every epilogue with a K tail and with element loads
    (the flags change only the copies)."""
    i1, i64, f1 = types.int32[::1], types.int64, types.float32[::1]
    out = []
    for name, cfg in CONFIGS.items():
        variants = ((True, True), (True, False), (False, False)) if name == "m64" else ((True, True),)
        for aligned, exact_k in variants:
            elem = types.uint32[::1] if aligned else types.uint16[::1]
            for mode in (_MODE_SWIGLU, _MODE_STORE, _MODE_ATOMIC):
                dst = elem if mode == _MODE_SWIGLU else f1
                out.append((_build(cfg, mode, aligned, exact_k)[0],
                            (elem, elem, i1, i1, i1, f1, i64, i64, i64, i64, i64, i64, i64, dst)))
    return out
