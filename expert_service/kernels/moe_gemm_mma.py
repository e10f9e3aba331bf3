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
  >= num_tiles[0] (device) exits at once. Blocks are numbered in groups of GROUP_M M tiles (Triton's grouped
  order): consecutive blocks share an expert's weight tiles and a few A tiles, so both stay in L2.
- gate|up: the block's BN weight rows are BN/2 gate rows and the same BN/2 up rows (F columns f0 .. f0+BN/2),
  and each warp holds matching gate and up accumulators, so SwiGLU is the epilogue; h is written as bf16.
- Main loop over the input dim in BK steps: A [BM, BK] and B [BN, BK] tiles staged in shared memory as uint64
  words of 4 bf16 (XOR-swizzled rows: the fragment loads are free of bank conflicts without padding), double
  buffered with the next step's global loads held in registers across the mma's (one barrier per step).
  16-byte global loads (`ptx.ld_v4`) when D, F are multiples of 8 ("aligned"); otherwise the same kernel with
  element loads and bounds on every element ("generic": any D, F).
- mma fragments: the k index is permuted so that one 8-byte shared load is a lane's whole pair of A (or B)
  registers: lane t's "2t, 2t+1" / "2t+8, 2t+9" k slots hold k = 16 ks + 4t .. 4t+3 (kernels/mma.py).
- Warp tile: MT m-tiles of 16 rows x NT n-tiles of 8 weight rows; fp32 accumulators in registers.
Under NUMBA_ENABLE_CUDASIM the mma and bf16 packing are emulated through shared memory (the PTX fragment
layout, exactly), on small tiles, so the indexing is tested in CI; the kernels are otherwise identical.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, types

from expert_service.kernels.numeric import SIMULATOR, WARP, bf16_to_f32, f32_to_bf16
from expert_service.kernels.ptx import ld_v4
from expert_service.kernels.jit_cache import cached_jit


class Config(NamedTuple):
    """Block shape: WM x WN warps, each MT m-tiles (16 rows) x NT n-tiles (8 weight rows); BK input features
    per main-loop step (16, 32 or 64); GROUP_M M tiles per block group of the grid order."""
    wm: int
    wn: int
    mt: int
    nt: int
    bk: int = 32
    group_m: int = 8

    @property
    def threads(self) -> int:
        return WARP * self.wm * self.wn

    @property
    def block_m(self) -> int:
        return 16 * self.mt * self.wm

    @property
    def block_n(self) -> int:
        return 8 * self.nt * self.wn


# Named shapes (the benchmark times each; H200 figures in docs/kernels.md). BK = 64 helps the thin m32 tile
# (more bytes in flight per main-loop step) and hurts m64 (48 KB of shared memory), so m64 and m128 stage 32
# features per step.
# SIM: tiny tiles for the simulator (one Python thread per CUDA thread).
CONFIGS = {
    "m16": Config(1, 4, 1, 4, 64),
    "m32": Config(1, 4, 2, 4, 64),
    "m64": Config(2, 4, 2, 4, 32),
    "m128": Config(2, 4, 4, 4, 32),
}
SIM_CONFIG = Config(1, 2, 1, 2, 16, 2)
SIM_CONFIG_2 = Config(2, 1, 1, 4, 32, 1)    # second simulator shape: two warps along M, BK 32 (swizzled rows)
COMBINE_ATOMIC, COMBINE_STORE = "atomic", "store"
_MODE_SWIGLU, _MODE_STORE, _MODE_ATOMIC = 0, 1, 2
_LO32 = np.uint64(0xFFFFFFFF)
_MAX_SIM_THREADS = 256


def choose_config(n_assignments: int, n_experts: int) -> Config:
    """Tile shape for a step: BM near the mean rows per routed expert (fewer padding rows). On the H200, m64
    was fastest from ~48 rows per expert up (m128 never was: 1 block per SM), m32 around 32 (qwen3 T = 512),
    m16 for decode-sized steps."""
    if SIMULATOR:
        return SIM_CONFIG
    per_expert = n_assignments / max(1, min(n_experts, n_assignments))
    if per_expert >= 48:
        return CONFIGS["m64"]
    if per_expert >= 20:
        return CONFIGS["m32"]
    return CONFIGS["m16"]


# ---- mma and bf16 packing: inline PTX on the GPU, an exact emulation in the simulator -------------------------
if SIMULATOR:
    # Fragment maps of mma.m16n8k16 (PTX ISA): A[r, k] is half k % 2 of register r // 8 + 2 (k // 8) of lane
    # (r % 8) * 4 + (k % 8) // 2; B[k, n] is half k % 2 of register 4 + k // 8 of lane n * 4 + (k % 8) // 2.
    _r, _k = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    _A_LANE, _A_REG, _A_SHIFT = (_r % 8) * 4 + (_k % 8) // 2, _r // 8 + 2 * (_k // 8), 16 * (_k % 2)
    _kb, _n = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    _B_LANE, _B_REG, _B_SHIFT = _n * 4 + (_kb % 8) // 2, 4 + _kb // 8, 16 * (_kb % 2)

    def _unpack(words, shift):
        return (((words >> shift.astype(np.uint32)) & np.uint32(0xFFFF)) << np.uint32(16)).view(np.float32)

    @cuda.jit(device=True)
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """mma.sync m16n8k16 bf16 -> f32 over the block's warps (every thread of the block must call it together:
        the emulation exchanges fragments through shared memory between two block barriers)."""
        regs = cuda.shared.array((_MAX_SIM_THREADS, 6), np.uint32)
        tid = cuda.threadIdx.x
        for i, v in enumerate((a0, a1, a2, a3, b0, b1)):
            regs[tid, i] = v
        cuda.syncthreads()
        warp = regs[tid - tid % WARP:tid - tid % WARP + WARP]
        a = _unpack(warp[_A_LANE, _A_REG], _A_SHIFT).astype(np.float64)
        b = _unpack(warp[_B_LANE, _B_REG], _B_SHIFT).astype(np.float64)
        g, t = (tid % WARP) // 4, tid % 4
        d = a @ b
        cuda.syncthreads()
        return (np.float32(c0 + d[g, 2 * t]), np.float32(c1 + d[g, 2 * t + 1]),
                np.float32(c2 + d[g + 8, 2 * t]), np.float32(c3 + d[g + 8, 2 * t + 1]))

    @cuda.jit(device=True)
    def pack(lo, hi):
        return np.uint32(f32_to_bf16(lo)) | (np.uint32(f32_to_bf16(hi)) << np.uint32(16))
else:
    from expert_service.kernels.mma import mma_bf16_m16n8k16 as mma, pack_bf16x2 as pack


@cuda.jit(device=True, inline=True)
def _silu(v):
    return v / (np.float32(1.0) + math.exp(-v))


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


def _chunk_loader(aligned: bool):
    """load(src, row_start, k, k_dim, valid) -> 4 uint32 (8 bf16 at src[row_start + k ..]): a 16-byte load from a
    uint32 view (aligned: row_start, k and k_dim multiples of 8, k < k_dim or the chunk is skipped) or 8 element
    loads from a uint16 array with each element's k checked."""
    if aligned:
        @cuda.jit(device=True, inline=True)
        def load(src, row_start, k, k_dim, valid):
            if valid and k < k_dim:
                return ld_v4(src, (row_start + k) >> 1)
            z = np.uint32(0)
            return z, z, z, z
    else:
        @cuda.jit(device=True, inline=True)
        def load(src, row_start, k, k_dim, valid):
            i = row_start + k
            return (_pair16(src, i, valid and k < k_dim, valid and k + 1 < k_dim),
                    _pair16(src, i + 2, valid and k + 2 < k_dim, valid and k + 3 < k_dim),
                    _pair16(src, i + 4, valid and k + 4 < k_dim, valid and k + 5 < k_dim),
                    _pair16(src, i + 6, valid and k + 6 < k_dim, valid and k + 7 < k_dim))
    return load


def _epilogue(mode: int, aligned: bool, MT: int, NT: int):
    """epi(acc, out, sorted_ids, route_w, m0, n0, n_out, top_k, wn, g, t): write a warp's accumulators
    acc [MT, NT, 4] (rows m0 + 16 i + g + 8 (v // 2), n-tile j, column 2t + v % 2) to `out`."""
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
                                    _silu(acc[i, j, 2 * hv]) * acc[i, j + NH, 2 * hv],
                                    _silu(acc[i, j, 2 * hv + 1]) * acc[i, j + NH, 2 * hv + 1])
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
                                        _silu(acc[i, j, 2 * hv + e]) * acc[i, j + NH, 2 * hv + e])
        return epi
    atomic = mode == _MODE_ATOMIC

    if atomic:
        @cuda.jit(device=True, inline=True)
        def put(out, idx, value, scale):
            cuda.atomic.add(out, idx, value * scale)
    else:
        @cuda.jit(device=True, inline=True)
        def put(out, idx, value, scale):
            out[idx] = value

    @cuda.jit(device=True, inline=True)
    def epi(acc, out, sorted_ids, route_w, m0, n0, n_out, top_k, wn, g, t):
        # row m holds assignment sorted_ids[m] (-1: padding, dropped): y row asg (store) or residual row
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


@functools.lru_cache(maxsize=None)
def _build(cfg: Config, mode: int, aligned: bool):
    """Kernel for one block shape, epilogue mode (SwiGLU -> bf16 h; store fp32 rows; atomic weighted combine) and
    load width. Returns (python function, jitted kernel)."""
    WM, WN, MT, NT, BK, GM = cfg.wm, cfg.wn, cfg.mt, cfg.nt, cfg.bk, cfg.group_m
    THREADS, BM, BN = cfg.threads, cfg.block_m, cfg.block_n
    gated = mode == _MODE_SWIGLU
    if gated and NT % 2:
        raise ValueError("gate|up needs an even number of n-tiles per warp")
    WPR = BK // 4                       # uint64 words per shared row
    CPR = BK // 8                       # 16-byte chunks per tile row
    A_ITERS = -(-BM * CPR // THREADS)   # chunks per thread per step
    B_ITERS = -(-BN * CPR // THREADS)
    KS = BK // 16
    NH = NT // 2
    HALF_N = BN // 2                    # gated: F columns per block
    swz = _swizzle(WPR)
    load = _chunk_loader(aligned)

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

        a_s = cuda.shared.array((2, BM, WPR), np.uint64)
        b_s = cuda.shared.array((2, BN, WPR), np.uint64)
        ra = cuda.local.array((A_ITERS, 4), np.uint32)
        rb = cuda.local.array((B_ITERS, 4), np.uint32)
        acc = cuda.local.array((MT, NT, 4), np.float32)
        af = cuda.local.array((MT, 4), np.uint32)
        for i in range(MT):
            for j in range(NT):
                for v in range(4):
                    acc[i, j, v] = np.float32(0.0)

        # Row starts (elements) of this thread's chunks: fixed over the k loop.
        a_start = cuda.local.array(A_ITERS, np.int64)
        b_start = cuda.local.array(B_ITERS, np.int64)
        b_valid = cuda.local.array(B_ITERS, np.int32)
        for it in range(A_ITERS):
            q = tid + it * THREADS
            a_start[it] = (row0 + q // CPR) * k_dim
        for it in range(B_ITERS):
            q = tid + it * THREADS
            r = q // CPR
            if gated:
                col = n0 + (r % HALF_N)
                b_start[it] = wbase + (up_off if r >= HALF_N else w_off) + np.int64(col) * k_dim
            else:
                col = n0 + r
                b_start[it] = wbase + w_off + np.int64(col) * k_dim
            b_valid[it] = 1 if (col < n_out and q < BN * CPR) else 0

        n_steps = (k_dim + BK - 1) // BK
        # prologue: step 0 into registers, then shared buffer 0
        for it in range(A_ITERS):
            q = tid + it * THREADS
            ra[it, 0], ra[it, 1], ra[it, 2], ra[it, 3] = load(a, a_start[it], (q % CPR) * 8, k_dim, q < BM * CPR)
        for it in range(B_ITERS):
            q = tid + it * THREADS
            rb[it, 0], rb[it, 1], rb[it, 2], rb[it, 3] = load(w, b_start[it], (q % CPR) * 8, k_dim, b_valid[it] != 0)
        for it in range(A_ITERS):
            q = tid + it * THREADS
            if q < BM * CPR:
                r = q // CPR
                c = q % CPR
                a_s[0, r, swz(r, 2 * c)] = _u64(ra[it, 0], ra[it, 1])
                a_s[0, r, swz(r, 2 * c + 1)] = _u64(ra[it, 2], ra[it, 3])
        for it in range(B_ITERS):
            q = tid + it * THREADS
            if q < BN * CPR:
                r = q // CPR
                c = q % CPR
                b_s[0, r, swz(r, 2 * c)] = _u64(rb[it, 0], rb[it, 1])
                b_s[0, r, swz(r, 2 * c + 1)] = _u64(rb[it, 2], rb[it, 3])
        cuda.syncthreads()

        for step in range(n_steps):
            cur = step % 2
            more = step + 1 < n_steps
            if more:                       # next step's global loads fly while this step's mma's run
                k_next = (step + 1) * BK
                for it in range(A_ITERS):
                    q = tid + it * THREADS
                    ra[it, 0], ra[it, 1], ra[it, 2], ra[it, 3] = load(a, a_start[it], k_next + (q % CPR) * 8,
                                                                      k_dim, q < BM * CPR)
                for it in range(B_ITERS):
                    q = tid + it * THREADS
                    rb[it, 0], rb[it, 1], rb[it, 2], rb[it, 3] = load(w, b_start[it], k_next + (q % CPR) * 8,
                                                                      k_dim, b_valid[it] != 0)
            for ks in range(KS):
                wl = 4 * ks + t
                for i in range(MT):
                    r = wm * MT * 16 + i * 16 + g
                    lo_row = a_s[cur, r, swz(r, wl)]
                    hi_row = a_s[cur, r + 8, swz(r + 8, wl)]
                    af[i, 0] = np.uint32(lo_row & _LO32)
                    af[i, 2] = np.uint32(lo_row >> np.uint64(32))
                    af[i, 1] = np.uint32(hi_row & _LO32)
                    af[i, 3] = np.uint32(hi_row >> np.uint64(32))
                for j in range(NT):
                    if gated:
                        n = (j // NH) * HALF_N + (wn * NH + j % NH) * 8 + g
                    else:
                        n = (wn * NT + j) * 8 + g
                    bw = b_s[cur, n, swz(n, wl)]
                    b0 = np.uint32(bw & _LO32)
                    b1 = np.uint32(bw >> np.uint64(32))
                    for i in range(MT):
                        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma(
                            af[i, 0], af[i, 1], af[i, 2], af[i, 3], b0, b1,
                            acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
            if more:
                nxt = 1 - cur
                for it in range(A_ITERS):
                    q = tid + it * THREADS
                    if q < BM * CPR:
                        r = q // CPR
                        c = q % CPR
                        a_s[nxt, r, swz(r, 2 * c)] = _u64(ra[it, 0], ra[it, 1])
                        a_s[nxt, r, swz(r, 2 * c + 1)] = _u64(ra[it, 2], ra[it, 3])
                for it in range(B_ITERS):
                    q = tid + it * THREADS
                    if q < BN * CPR:
                        r = q // CPR
                        c = q % CPR
                        b_s[nxt, r, swz(r, 2 * c)] = _u64(rb[it, 0], rb[it, 1])
                        b_s[nxt, r, swz(r, 2 * c + 1)] = _u64(rb[it, 2], rb[it, 3])
            cuda.syncthreads()

        # epilogue: accumulator (i, j, v) is row g + 8 (v // 2) of m-tile i, column 2t + v % 2 of n-tile j
        epilogue(acc, out, sorted_ids, route_w, row0 + wm * MT * 16, n0, n_out, top_k, wn, g, t)

    return moe_gemm_mma_kernel, cached_jit(moe_gemm_mma_kernel)


# ---- launchers ---------------------------------------------------------------------------------------------
def is_aligned(F: int, D: int, stride: int) -> bool:
    """16-byte loads need every weight/activation row to start on 16 bytes: D, F and the expert stride
    multiples of 8 bf16 values (the model format aligns expert blocks to 4096 bytes; D and F are the model's)."""
    return D % 8 == 0 and F % 8 == 0 and stride % 8 == 0


def _check_weights(W, F, D):
    if W.ndim != 2 or np.dtype(W.dtype) != np.uint16 or not W.flags["C_CONTIGUOUS"] or W.shape[1] < 3 * F * D:
        raise ValueError(f"moe_gemm_mma needs bf16 weights as C-contiguous uint16 [E, stride >= 3*F*D], "
                         f"got {W.dtype} {W.shape}")


def _check(name, a, shape, dtype):
    if a.shape != shape or a.dtype != dtype or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name} must be C-contiguous {np.dtype(dtype).name} {list(shape)}, got {a.dtype} "
                         f"{list(a.shape)}")


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
    _check("xs", xs, (rows, D), np.uint16)
    _check("h", h, (rows, F), np.uint16)
    _check("tile_expert", tile_expert, (tiles,), np.int32)
    _check("num_tiles", num_tiles, (1,), np.int32)
    if tiles == 0:
        return
    aligned = is_aligned(F, D, W.shape[1])
    n_tiles_n = -(-F // (cfg.block_n // 2))
    kernel = _build(cfg, _MODE_SWIGLU, aligned)[1]
    dummy_i, dummy_f = tile_expert, num_tiles       # unused in this mode (typed like the real ones)
    kernel[tiles * n_tiles_n, cfg.threads, stream](
        _flat(xs, aligned), _flat(W, aligned), tile_expert, num_tiles, dummy_i, _float_dummy(dummy_f),
        np.int64(W.shape[1]), np.int64(F), np.int64(D), np.int64(0), np.int64(F * D), np.int64(n_tiles_n),
        np.int64(1), _flat(h, aligned))


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
    _check("h", h, (rows, F), np.uint16)
    _check("sorted_ids", sorted_ids, (rows,), np.int32)
    _check("tile_expert", tile_expert, (tiles,), np.int32)
    _check("num_tiles", num_tiles, (1,), np.int32)
    if combine == COMBINE_ATOMIC:
        if route_weights is None or route_weights.ndim != 2:
            raise ValueError("combine='atomic' needs route_weights [T, K]")
        n_tok, top_k = route_weights.shape
        _check("route_weights", route_weights, (n_tok, top_k), np.float32)
        _check("out", out, (n_tok, D), np.float32)
        mode, rw = _MODE_ATOMIC, route_weights.reshape(n_tok * top_k)
    elif combine == COMBINE_STORE:
        if out.ndim != 2:
            raise ValueError("combine='store' needs out [T*K, D]")
        _check("out", out, (out.shape[0], D), np.float32)
        mode, top_k, rw = _MODE_STORE, 1, _float_dummy(num_tiles)
    else:
        raise ValueError(f"combine must be {COMBINE_ATOMIC!r} or {COMBINE_STORE!r}, got {combine!r}")
    if tiles == 0 or out.shape[0] == 0:
        return
    aligned = is_aligned(F, D, W.shape[1])
    n_tiles_n = -(-D // cfg.block_n)
    kernel = _build(cfg, mode, aligned)[1]
    kernel[tiles * n_tiles_n, cfg.threads, stream](
        _flat(h, aligned), _flat(W, aligned), tile_expert, num_tiles, sorted_ids, rw,
        np.int64(W.shape[1]), np.int64(D), np.int64(F), np.int64(2 * F * D), np.int64(0), np.int64(n_tiles_n),
        np.int64(top_k), out.reshape(out.size))


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
    """float32 -> nearest bf16 (ties to even), as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


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
    """(python function, numba signature): every epilogue with 16-byte loads at each named config, and every
    epilogue with element loads at one config (the load width changes only the loader)."""
    i1, i64, f1 = types.int32[::1], types.int64, types.float32[::1]
    out = []
    for name, cfg in CONFIGS.items():
        for aligned in ((True, False) if name == "m64" else (True,)):
            elem = types.uint32[::1] if aligned else types.uint16[::1]
            for mode in (_MODE_SWIGLU, _MODE_STORE, _MODE_ATOMIC):
                dst = elem if mode == _MODE_SWIGLU else f1
                out.append((_build(cfg, mode, aligned)[0],
                            (elem, elem, i1, i1, i1, f1, i64, i64, i64, i64, i64, i64, i64, dst)))
    return out
