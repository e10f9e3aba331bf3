"""Grouped MoE GEMM on tensor cores for 8-bit experts (int8, fp8 e4m3; per-channel or 128x128 block scales, one
dtype per expert): `moe_gemm_mma`'s pipeline with 8-bit weight tiles. Tokens sorted by expert on the device
(`moe_align`, `moe_gather_bf16`), mma.sync m16n8k16 bf16 with fp32 accumulation; no host synchronisation.

Per MoE layer (experts = the layer's uint8 blocks [E, stride], meta [E, META_WIDTH] from `expert_quant`):
  launch_q8mma_gate_up(xs, tile_expert, num_tiles, experts, meta, F, D, h)    h = silu(xs gate^T) * (xs up^T), bf16
  launch_q8mma_down(h, tile_expert, num_tiles, sorted_ids, experts, meta, F, D, y)   y [T*K, D] f32, assignment order
then `moe_combine` as the bf16 strategy (store epilogue only: deterministic).

What changes against the bf16 kernel (its docstring has the rest: grid order, stages, swizzled A rows, k
permutation, epilogues):
- B tiles are the expert's 8-bit rows: BK bytes a row a stage, copied by 16-byte `cp.async` (16 values a copy,
  half the bytes of bf16) into their own swizzled shared rows. The 128-byte row pieces of BK = 128 are what the
  memory-bound small tiles stream.
- Fragments: with lane t's k slots holding k = 16 ks + 4t .. 4t+3, a lane's B pair is one 32-bit shared word
  (4 weight bytes), widened exactly to float32 (`expert_quant.int8x4` / `fp8x4`, the dtype code read from
  meta once per tile: a tile belongs to one expert) and packed into two bf16x2 registers. int8 and e4m3 values
  are exact in bf16, so with per-channel scales the product is exact q and the scale multiplies each fp32 sum
  after the K loop (the epilogue). With 128x128 block scales (the scale changes every 128 inputs) the widened
  value is multiplied by its block's scale and rounded to bf16 (nearest even): the weights `dequant_experts`
  gives per-expert cuBLAS. BK divides 128, so a main-loop step lies in one scale block, and an n-tile's 8 rows
  too: one scale a step per n-tile.
- D and F must be multiples of 16 (whole 16-byte chunks of 8-bit rows, as moe_q8); the K tail of a step (input
  dim not a multiple of BK) is zero-filled by the copies.
- Experts whose code is neither int8 nor fp8 are not this kernel's: their outputs are NaN (never silently wrong);
  the MoE strategy sends a layer here only when every expert is 8-bit (cuda/moe_strategy.py).
Reference: `moe_reference_q8` (numpy: the same bf16 roundings of x, h and block-scaled weights).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.expert_quant import (
    CODE_FP8,
    CODE_INT8,
    META_WIDTH,
    SCALE_BLOCK,
    SCALE_BLOCK_SIZE,
    SCALE_CHANNEL,
    decode,
    dequantize,
    fp8x4,
    int8x4,
)
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.mma import block_mma as mma
from expert_service.kernels.mma import block_pack as pack
from expert_service.kernels.moe_gemm_mma import (
    _MODE_ADD,
    _MODE_STORE,
    _MODE_SWIGLU,
    Config,
    _epilogue,
    _launch,
    bf16_round,
)
from expert_service.kernels.numeric import SIMULATOR, WARP, check_array
from expert_service.kernels.ptx import cp_async16, cp_async_commit, cp_async_wait_fn, lds32
from expert_service.kernels.split_sum import launch_split_sum

# Named shapes (bench/moe_gemm.py --q8 times them): m16 / m32 stream weights (128-byte 8-bit row pieces a stage),
# m64 / m128 reuse each weight tile over more rows.
CONFIGS = {
    "m16": Config(1, 4, 1, 4, bk=128, stages=3),
    "m32": Config(1, 4, 2, 4, bk=128, stages=3),
    "m64": Config(2, 2, 2, 8, bk=64, stages=3),
    "m128": Config(2, 4, 4, 4, bk=64, stages=3),
}
SIM_CONFIG = Config(1, 2, 1, 2, bk=32, stages=2, group_m=2)
NO_SPLIT = 1 << 40  # split_steps of a launch that does not split K
SIM_CONFIG_2 = Config(2, 1, 1, 4, bk=64, stages=3, group_m=1)
MIN_DIM = 16
_WORD = np.dtype(np.uint64)
_WORD32 = np.dtype(np.uint32)
_SMEM_ALIGN = None if SIMULATOR else 16


def shared_bytes(cfg: Config) -> int:
    """A stages (BM rows of BK bf16) and B stages (BN rows of BK bytes)."""
    return cfg.stages * (2 * cfg.block_m + cfg.block_n) * cfg.bk


def choose_config(n_assignments: int, n_experts: int) -> Config:
    """Tile shape by the mean rows per routed expert (thresholds of the bf16 kernel's choose_config)."""
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


def _group_xor(words_per_row: int, word_bytes: int):
    """xor(r): the swizzle of shared row r, XORed into the index of its 16-byte chunk pair (A: 4-word groups of
    8-byte words, read 8 bytes a lane) or chunk (B: 2-word chunks, read 4 bytes a lane), so that the 8 rows
    g = 0..7 a warp's fragment load touches land on distinct banks."""
    if word_bytes == 8:  # A: a half-warp reads rows g = 0..3, 4 words each
        table = {4: (0, 0), 8: (1, 1), 16: (0, 3), 32: (0, 3)}
    else:  # B: the warp reads 2 words of each of rows g = 0..7 (lanes 2u, 2u + 1 share a word)
        table = {4: (2, 1), 8: (1, 3), 16: (0, 7)}
    if words_per_row not in table:
        raise ValueError(f"BK must be 32, 64 or 128, got a shared row of {words_per_row} words")
    shift, mask = table[words_per_row]

    @cuda.jit(device=True, inline=True)
    def xor(r):
        return (r >> shift) & mask

    return xor


@functools.cache
def _widener(int8: bool, block_scaled: bool):
    """widen(w, factor): 4 weight bytes (k order) -> two bf16x2 words, exact values (times `factor` and rounded
    when block_scaled). One body per encoding, so the main loop carries no per-value branch or predicated
    multiply."""
    decode4 = int8x4 if int8 else fp8x4

    @cuda.jit(device=True, inline=True)
    def widen(w, factor):
        # whole-word decoders (a prmt per value; moe_q8's): fewer integer ops in the mma loop than per-byte shifts
        v0, v1, v2, v3 = decode4(w)
        if block_scaled:
            v0, v1, v2, v3 = v0 * factor, v1 * factor, v2 * factor, v3 * factor
        return pack(v0, v1), pack(v2, v3)

    return widen


def channel_scaler(MT: int, NT: int, gated: bool):
    """scale(acc, meta, expert, base, scales, n0, n_out, wn, t): a warp's fp32 sums acc [MT, NT, 4] (mma.sync C
    fragments: n-tile j, column 2t + v % 2; gated: gate n-tiles j < NT / 2, their up partners j + NT / 2) times
    their output channel's scale when the expert's scales are per channel; NaN when the expert is not 8-bit
    (never silently wrong); untouched for block-scaled experts (their scales went into the widened weights)."""
    NH = NT // 2
    SCALE_OFF = 5 if gated else 7  # meta column of the first matrix's scales

    @cuda.jit(device=True, inline=True)
    def scale(acc, meta, expert, base, scales, n0, n_out, wn, t):
        code = meta[expert, 0]
        bad = not (code == CODE_INT8 or code == CODE_FP8)
        if meta[expert, 1] == SCALE_CHANNEL or bad:
            for j in range(NT):
                if gated:
                    col = n0 + (wn * NH + j % NH) * 8 + 2 * t
                    mat = j // NH
                else:
                    col = n0 + (wn * NT + j) * 8 + 2 * t
                    mat = 0
                s0 = (base + meta[expert, SCALE_OFF + mat]) // 4
                for e in range(2):
                    sc = np.float32(np.nan) if bad else np.float32(0.0)
                    if not bad and col + e < n_out:
                        sc = scales[s0 + col + e]
                    for i in range(MT):
                        acc[i, j, e] *= sc
                        acc[i, j, 2 + e] *= sc

    return scale


@functools.cache
def _build(cfg: Config, mode: int, exact_k: bool):
    """Kernel for one block shape, epilogue mode (SwiGLU -> bf16 h, or store fp32 rows) and whether the input dim
    is a multiple of BK (no K-tail checks). Returns (python function, jitted kernel)."""
    WN, MT, NT, BK, S, GM = cfg.wn, cfg.mt, cfg.nt, cfg.bk, cfg.stages, cfg.group_m
    THREADS, BM, BN = cfg.threads, cfg.block_m, cfg.block_n
    gated = mode == _MODE_SWIGLU
    if gated and NT % 2:
        raise ValueError("gate|up needs an even number of n-tiles per warp")
    if S < 2 or SCALE_BLOCK_SIZE % BK:
        raise ValueError("the pipeline needs at least 2 stages and BK dividing the 128-wide scale blocks")
    WPR_A, WPR_B = BK // 4, BK // 8  # uint64 words per shared row: BK bf16 (A), BK bytes (B)
    CPR_A, CPR_B = BK // 8, BK // 16  # 16-byte chunks per tile row
    A_WORDS, B_WORDS = BM * WPR_A, BN * WPR_B
    B_SHARED = S * A_WORDS
    A_CHUNKS, B_CHUNKS = BM * CPR_A, BN * CPR_B
    A_ITERS, B_ITERS = -(-A_CHUNKS // THREADS), -(-B_CHUNKS // THREADS)
    KS, NH, HALF_N = BK // 16, NT // 2, BN // 2
    xor_a, xor_b = _group_xor(WPR_A, 8), _group_xor(WPR_B, 4)
    wait_stage = cp_async_wait_fn(S - 2)
    epilogue = _epilogue(mode, True, MT, NT)
    GATE_OFF, SCALE_OFF = (2, 5) if gated else (4, 7)  # meta columns of the first matrix and of its scale
    scale_sums = channel_scaler(MT, NT, gated)

    @cuda.jit(device=True, inline=True)
    def fill(smem, a_stage, b_stage, k0, a, words, k_dim, tid, a_start, a_word, a_col, b_start, b_word, b_col, b_ok):
        # a_start / b_start are 32-bit word indices at step 0 (an absent B row's is 0): one add a copy, and with
        # no K tail no select (index 0 + the step's offset stays in the array)
        for it in range(A_ITERS):
            if A_ITERS * THREADS == A_CHUNKS or tid + it * THREADS < A_CHUNKS:
                ok = exact_k or k0 + a_col[it] < k_dim
                src = a_start[it] + (k0 >> 1)
                cp_async16(smem, a_stage + a_word[it], a, src if exact_k or ok else 0, ok)
        for it in range(B_ITERS):
            if B_ITERS * THREADS == B_CHUNKS or tid + it * THREADS < B_CHUNKS:
                ok = b_ok[it] != 0 and (exact_k or k0 + b_col[it] < k_dim)
                src = b_start[it] + (k0 >> 2)
                cp_async16(smem, b_stage + b_word[it], words, src if exact_k or ok else 0, ok)

    def main_loop(int8: bool, block_scaled: bool):
        widen = _widener(int8, block_scaled)

        @cuda.jit(device=True, inline=True)
        def run(smem, smem32, acc, af, factor, scales, s_row, a, words, k_dim, tid, a_start, a_word, a_col, b_start,
                b_word, b_col, b_ok, n_steps, a_lane, b_lane, fa, fb, step0):
            """The K loop of one tile: S-stage cp.async pipeline, A fragments as four 32-bit shared loads (the mma
            reads them from four consecutive registers, which 64-bit loads of row pairs cannot give without
            moves), B as one 32-bit word of 4 weight bytes a lane, widened once per n-tile for every m-tile.
            step0: the split's first step (k_dim, a_start and b_start are already the split's)."""
            cur = np.uint32(0)
            fs = np.uint32(S - 1)
            for step in range(n_steps):
                wait_stage()
                cuda.syncthreads()
                nxt = step + S - 1
                if nxt < n_steps:
                    fill(smem, fs * np.uint32(A_WORDS), np.uint32(B_SHARED) + fs * np.uint32(B_WORDS), nxt * BK, a,
                         words, k_dim, tid, a_start, a_word, a_col, b_start, b_word, b_col, b_ok)
                cp_async_commit()
                if block_scaled:
                    kb = ((step + step0) * BK) // SCALE_BLOCK_SIZE
                    for j in range(NT):
                        if s_row[j] >= 0:
                            factor[j] = scales[s_row[j] + kb]
                a_base = np.uint32(2) * cur * np.uint32(A_WORDS) + a_lane
                b_base = np.uint32(2) * (np.uint32(B_SHARED) + cur * np.uint32(B_WORDS)) + b_lane
                for ks in range(KS):
                    kw = ((np.uint32(ks) << np.uint32(2)) ^ fa) << np.uint32(1)
                    for i in range(MT):
                        lo = a_base + kw + np.uint32(2 * i * 16 * WPR_A)
                        hi = a_base + kw + np.uint32(2 * (i * 16 + 8) * WPR_A)
                        af[i, 0] = lds32(smem32, lo)
                        af[i, 1] = lds32(smem32, hi)
                        af[i, 2] = lds32(smem32, lo + np.uint32(1))
                        af[i, 3] = lds32(smem32, hi + np.uint32(1))
                    kb_word = ((np.uint32(ks) << np.uint32(1)) ^ fb) << np.uint32(1)
                    for j in range(NT):
                        n_row = (j // NH) * HALF_N + (j % NH) * 8 if gated else j * 8
                        b0, b1 = widen(smem32[b_base + kb_word + np.uint32(2 * n_row * WPR_B)], factor[j])
                        for i in range(MT):
                            acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma(
                                af[i, 0], af[i, 1], af[i, 2], af[i, 3], b0, b1,
                                acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
                cur = np.uint32(0) if cur == S - 1 else cur + np.uint32(1)
                fs = np.uint32(0) if fs == S - 1 else fs + np.uint32(1)

        return run

    loop_int8_channel, loop_int8_block = main_loop(True, False), main_loop(True, True)
    loop_fp8_channel, loop_fp8_block = main_loop(False, False), main_loop(False, True)

    def q8mma_kernel(a, words, scales, meta, tile_expert, tile_block, num_tiles, sorted_ids, stride, n_out, k_dim,
                     n_tiles_n, split_steps, plane, out):
        """a: A rows [rows * k_dim] bf16 as uint32 pairs; words / scales: the blocks [blocks * stride bytes] as
        uint32 / float32; meta [E, META_WIDTH] int32; tile_expert [tiles] (the tile's expert: its meta row),
        tile_block [tiles] (the block holding its weights: the expert, or its cache slot; -1: skip the tile),
        num_tiles [1], sorted_ids [rows] int32; stride: bytes per block; n_out, k_dim: output columns, input dim
        (F, D for gate|up; D, F for down); out: h [rows * F / 2] (bf16 pairs) | y [T*K * D] f32. split_steps:
        K steps a split sums (split-K: >= every step's count, no split); each split s writes its partial sums to
        out[s * plane:] (store mode). Grid (splits * tiles * n_tiles_n,), THREADS."""
        tiles = tile_expert.shape[0]
        split = cuda.blockIdx.x // (tiles * n_tiles_n)
        b = cuda.blockIdx.x - split * (tiles * n_tiles_n)
        group = b // (GM * n_tiles_n)
        first = group * GM
        gsize = min(GM, tiles - first)
        local = b - group * GM * n_tiles_n
        m_tile = first + local % gsize
        n_tile = local // gsize
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
        n0 = n_tile * (HALF_N if gated else BN)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        wm = warp // WN
        wn = warp % WN
        g = lane // 4
        t = lane % 4

        smem = cuda.shared.array(0, _WORD, alignment=_SMEM_ALIGN)
        smem32 = cuda.shared.array(0, _WORD32, alignment=_SMEM_ALIGN)  # the same dynamic memory, 32-bit words
        acc = cuda.local.array((MT, NT, 4), np.float32)
        af = cuda.local.array((MT, 4), np.uint32)
        for i in range(MT):
            for j in range(NT):
                for v in range(4):
                    acc[i, j, v] = np.float32(0.0)

        a_start = cuda.local.array(A_ITERS, np.int64)  # uint32 word (bf16 pair) of the chunk at step 0
        a_word = cuda.local.array(A_ITERS, np.uint32)
        a_col = cuda.local.array(A_ITERS, np.int32)
        b_start = cuda.local.array(B_ITERS, np.int64)  # uint32 word of the chunk at step 0 (0: no row)
        b_word = cuda.local.array(B_ITERS, np.uint32)
        b_col = cuda.local.array(B_ITERS, np.int32)
        b_ok = cuda.local.array(B_ITERS, np.int32)
        # split-K: this split's steps [step0, step0 + n_steps) of the input, seen as an input of k_left values from
        # step0 (the start offsets below move there; the K-tail checks count from it)
        step0 = np.int64(split) * split_steps
        k_left = k_dim - step0 * BK
        k_from = step0 * BK
        for it in range(A_ITERS):
            q = tid + it * THREADS
            r, c = q // CPR_A, q % CPR_A
            a_start[it] = ((row0 + r) * k_dim + k_from + c * 8) >> 1
            a_word[it] = r * WPR_A + ((c >> 1) ^ xor_a(r)) * 4 + (c & 1) * 2
            a_col[it] = c * 8
        for it in range(B_ITERS):
            q = tid + it * THREADS
            r, c = q // CPR_B, q % CPR_B
            if gated:  # rows < HALF_N: gate rows n0 .., then the same up rows
                col = n0 + r % HALF_N
                mat = 1 if r >= HALF_N else 0
            else:
                col = n0 + r
                mat = 0
            b_ok[it] = 1 if (col < n_out and q < B_CHUNKS) else 0
            b_start[it] = 0
            if b_ok[it]:
                b_start[it] = (base + meta[expert, GATE_OFF + mat] + np.int64(col) * k_dim + k_from + c * 16) >> 2
            b_word[it] = r * WPR_B + (c ^ xor_b(r)) * 2
            b_col[it] = c * 16

        # Per n-tile: its weight rows (one 128-row scale block), the float index of its block-scale row.
        n_cb = (k_dim + SCALE_BLOCK_SIZE - 1) // SCALE_BLOCK_SIZE
        s_row = cuda.local.array(NT, np.int64)
        for j in range(NT):
            if gated:
                col = n0 + (wn * NH + j % NH) * 8
                mat = j // NH
            else:
                col = n0 + (wn * NT + j) * 8
                mat = 0
            s_row[j] = -1
            if col < n_out:
                s_row[j] = (base + meta[expert, SCALE_OFF + mat]) // 4 + (col // SCALE_BLOCK_SIZE) * n_cb
        factor = cuda.local.array(NT, np.float32)
        for j in range(NT):
            factor[j] = np.float32(1.0)

        fa = np.uint32(xor_a(g) << 2)
        fb = np.uint32(xor_b(g) << 1)
        # 32-bit indices (smem32 aliases smem): a lane's A pair words and its own half of a B word
        a_lane = np.uint32(2 * ((wm * MT * 16 + g) * WPR_A + t))
        b_lane = np.uint32(2 * (((wn * NH if gated else wn * NT) * 8 + g) * WPR_B + (t >> 1)) + (t & 1))

        n_steps = min((k_left + BK - 1) // BK, split_steps)
        for s in range(S - 1):
            if s < n_steps:
                fill(smem, np.uint32(s * A_WORDS), np.uint32(B_SHARED + s * B_WORDS), s * BK, a, words, k_left, tid,
                     a_start, a_word, a_col, b_start, b_word, b_col, b_ok)
            cp_async_commit()

        # one main loop per encoding (a tile is one expert's): no per-value branches or predicated multiplies
        if is_int8 and block_scaled:
            loop_int8_block(smem, smem32, acc, af, factor, scales, s_row, a, words, k_left, tid, a_start, a_word, a_col,
                            b_start, b_word, b_col, b_ok, n_steps, a_lane, b_lane, fa, fb, step0)
        elif is_int8:
            loop_int8_channel(smem, smem32, acc, af, factor, scales, s_row, a, words, k_left, tid, a_start, a_word,
                              a_col, b_start, b_word, b_col, b_ok, n_steps, a_lane, b_lane, fa, fb, step0)
        elif block_scaled:
            loop_fp8_block(smem, smem32, acc, af, factor, scales, s_row, a, words, k_left, tid, a_start, a_word, a_col,
                           b_start, b_word, b_col, b_ok, n_steps, a_lane, b_lane, fa, fb, step0)
        else:
            loop_fp8_channel(smem, smem32, acc, af, factor, scales, s_row, a, words, k_left, tid, a_start, a_word,
                             a_col, b_start, b_word, b_col, b_ok, n_steps, a_lane, b_lane, fa, fb, step0)

        scale_sums(acc, meta, expert, base, scales, n0, n_out, wn, t)
        dst = out[split * plane :] if split > 0 else out  # a split's partial sums: its own plane
        epilogue(acc, dst, sorted_ids, scales, row0 + wm * MT * 16, n0, n_out, 1, wn, g, t)

    return q8mma_kernel, cached_jit(q8mma_kernel)


# ---- launchers ---------------------------------------------------------------------------------------------
def _check_common(experts, meta, tile_expert, tile_slot, num_tiles, F: int, D: int) -> int:
    if experts.ndim != 2 or np.dtype(experts.dtype) != np.uint8 or experts.shape[1] % 16:
        raise ValueError(f"experts must be uint8 [E, stride] with stride % 16 == 0, got {experts.dtype} "
                         f"{list(experts.shape)}")
    check_array("experts", experts, experts.shape, np.uint8)
    if meta.ndim != 2:
        raise ValueError(f"meta must be int32 [E, {META_WIDTH}], got {list(meta.shape)}")
    check_array("meta", meta, (meta.shape[0] if tile_slot is not None else experts.shape[0], META_WIDTH), np.int32)
    if F % MIN_DIM or D % MIN_DIM or F <= 0 or D <= 0:
        raise ValueError(f"F={F} and D={D} must be positive multiples of {MIN_DIM} for 8-bit experts")
    tiles = tile_expert.shape[0]
    check_array("tile_expert", tile_expert, (tiles,), np.int32)
    if tile_slot is not None:
        check_array("tile_slot", tile_slot, (tiles,), np.int32)
    check_array("num_tiles", num_tiles, (1,), np.int32)
    return tiles


def _run(cfg: Config, mode: int, grid: int, a, experts, meta, tile_expert, tile_slot, num_tiles, sorted_ids,
         n_out, k_dim, n_tiles_n, out, stream, split_steps: int = NO_SPLIT, plane: int = 0) -> None:
    flat = experts.reshape(experts.size)
    kernel = _build(cfg, mode, k_dim % cfg.bk == 0)[1]
    _launch(kernel, grid, cfg, stream, (
        a.reshape(a.size).view(np.uint32), flat.view(np.uint32), flat.view(np.float32), meta, tile_expert,
        tile_expert if tile_slot is None else tile_slot, num_tiles, sorted_ids, np.int64(experts.shape[1]),
        np.int64(n_out), np.int64(k_dim), np.int64(n_tiles_n), np.int64(split_steps), np.int64(plane), out),
        shared_bytes=shared_bytes(cfg))


def split_plan(splits: int, k_dim: int, cfg: Config) -> tuple[int, int]:
    """(splits that each get steps, K steps a split sums) for asking `splits` ways over k_dim's steps of BK."""
    steps = -(-k_dim // cfg.bk)
    per = -(-steps // max(1, min(splits, steps)))
    return -(-steps // per), per


def launch_q8mma_gate_up(xs, tile_expert, num_tiles, experts, meta, F: int, D: int, h, config: Config | None = None,
                         stream=0, tile_slot=None) -> None:
    """xs [rows, D] uint16 (bf16 rows in sorted order, launch_moe_gather_bf16), tile_expert [tiles] / num_tiles
    [1] int32 (launch_moe_align with block_m = config.block_m; rows = tiles * BM), experts uint8 [E, stride],
    meta [E, META_WIDTH] int32 (every expert int8 or fp8) -> h [rows, F] uint16 (bf16 of silu(xs gate^T) *
    (xs up^T)) in every used row (padding rows: zeros). tile_slot [tiles] int32 (the expert cache's waves,
    kernels/tile_slots.py): experts is then the slot buffer [slots, stride], each tile's weights come from its
    slot (meta still by expert id: a block's layout is the same in any slot), and tiles at -1 are skipped
    (their rows of h untouched)."""
    cfg = config or choose_config(xs.shape[0], tile_expert.shape[0])
    tiles = _check_common(experts, meta, tile_expert, tile_slot, num_tiles, F, D)
    rows = tiles * cfg.block_m
    check_array("xs", xs, (rows, D), np.uint16)
    check_array("h", h, (rows, F), np.uint16)
    if tiles == 0:
        return
    n_tiles_n = -(-F // (cfg.block_n // 2))
    _run(cfg, _MODE_SWIGLU, tiles * n_tiles_n, xs, experts, meta, tile_expert, tile_slot, num_tiles, tile_expert,
         F, D, n_tiles_n, h.reshape(h.size).view(np.uint32), stream)


def launch_q8mma_down(h, tile_expert, num_tiles, sorted_ids, experts, meta, F: int, D: int, out,
                      config: Config | None = None, stream=0, tile_slot=None, accumulate: bool = False,
                      splits: int = 1, partials=None) -> None:
    """h [rows, F] uint16 (launch_q8mma_gate_up's), tile_expert / num_tiles / sorted_ids from launch_moe_align,
    experts / meta / tile_slot as for gate_up -> out [T*K, D] f32 = h @ down^T in assignment order (every routed
    row written, skipped tiles' rows untouched; not yet weighted: launch_moe_combine adds them up). accumulate:
    out += instead (a dense matrix's rows into the residual: the 8-bit attention's o_proj).
    splits > 1 (split-K, for steps of too few tiles to fill the GPU: a dense matrix over a few rows): each of up to
    `splits` parts of the F axis writes its sums to its plane of partials (float32, >= splits * T*K * D), and
    split_sum adds the planes into out in a fixed order (deterministic); every row of out must be routed."""
    cfg = config or choose_config(h.shape[0], tile_expert.shape[0])
    tiles = _check_common(experts, meta, tile_expert, tile_slot, num_tiles, F, D)
    rows = tiles * cfg.block_m
    check_array("h", h, (rows, F), np.uint16)
    check_array("sorted_ids", sorted_ids, (rows,), np.int32)
    if out.ndim != 2:
        raise ValueError(f"out must be [T*K, D] float32, got {list(out.shape)}")
    check_array("out", out, (out.shape[0], D), np.float32)
    if tiles == 0 or out.shape[0] == 0:
        return
    n_tiles_n = -(-D // cfg.block_n)
    used, per = split_plan(splits, F, cfg)
    if used > 1:
        plane = out.size
        if partials is None or partials.ndim != 1 or partials.size < used * plane:
            raise ValueError(f"split-K over {used} parts needs partials float32 [>= {used * plane}]")
        check_array("partials", partials, partials.shape, np.float32)
        _run(cfg, _MODE_STORE, used * tiles * n_tiles_n, h, experts, meta, tile_expert, tile_slot, num_tiles,
             sorted_ids, D, F, n_tiles_n, partials, stream, per, plane)
        launch_split_sum(partials[: used * plane].reshape(used, out.shape[0], D), out, accumulate, stream=stream)
        return
    mode = _MODE_ADD if accumulate else _MODE_STORE
    _run(cfg, mode, tiles * n_tiles_n, h, experts, meta, tile_expert, tile_slot, num_tiles, sorted_ids, D, F,
         n_tiles_n, out.reshape(out.size), stream)


# ---- numpy reference --------------------------------------------------------------------------------------
def kernel_weights(block: np.ndarray, meta: np.ndarray, F: int, D: int):
    """One expert's (gate, up, down) as the kernel multiplies them: block scales folded in and rounded to bf16,
    per-channel ones left out -> (matrices, per-row scales of each, or None)."""
    code, scheme = int(meta[0]), int(meta[1])
    if code not in (CODE_INT8, CODE_FP8):
        raise ValueError(f"dtype code {code} is not 8-bit")
    if scheme == SCALE_BLOCK:  # q * scale in float32 (dequantize), then to bf16, as the kernel widens
        return [bf16_round(m) for m in dequantize(block, meta, F, D)], None
    mats, scales = [], []
    for k, (rows, cols) in enumerate(((F, D), (F, D), (D, F))):
        w0, s0 = int(meta[2 + k]), int(meta[5 + k])
        mats.append(decode(np.ascontiguousarray(block[w0 : w0 + rows * cols]), code).reshape(rows, cols))
        scales.append(np.ascontiguousarray(block[s0 : s0 + 4 * rows]).view(np.float32).astype(np.float64))
    return mats, scales


def moe_reference_q8(x, ids, route_weights, blocks, metas, F: int, D: int, residual=None):
    """x [T, D] f32, ids / route_weights [T, K], blocks [E, stride] uint8, metas [E, META_WIDTH] -> (h [T*K, F],
    y [T*K, D], out [T, D]) with the kernel's roundings (x and h to bf16, block-scaled weights to bf16), float64
    products."""
    n_tok, top_k = ids.shape
    xb = bf16_round(x).astype(np.float64)
    h = np.zeros((n_tok * top_k, F), np.float32)
    y = np.zeros((n_tok * top_k, D), np.float64)
    for e in np.unique(ids):
        (gate, up, down), scales = kernel_weights(blocks[e], metas[e], F, D)
        rows = np.flatnonzero(ids.reshape(-1) == e)
        xe = xb[rows // top_k]
        gs, us = xe @ gate.astype(np.float64).T, xe @ up.astype(np.float64).T
        if scales is not None:
            gs, us = gs * scales[0], us * scales[1]
        he = bf16_round((gs / (1.0 + np.exp(-gs)) * us).astype(np.float32))
        h[rows] = he
        ye = he.astype(np.float64) @ down.astype(np.float64).T
        y[rows] = ye * scales[2] if scales is not None else ye
    out = np.zeros((n_tok, D)) if residual is None else residual.astype(np.float64).copy()
    out += (y.reshape(n_tok, top_k, D) * route_weights[:, :, None]).sum(axis=1)
    return h, y.astype(np.float32), out.astype(np.float32)


def sm90_signatures():
    """(python function, numba signature): the three epilogues at each named config (input dim a multiple of BK, as
    real models), and with a K tail up to m64 (the 8-bit attention projections over a few rows)."""
    u32, i1, i64, f1 = types.uint32[::1], types.int32[::1], types.int64, types.float32[::1]
    out = []
    for name, cfg in CONFIGS.items():
        for exact_k in (True, False) if name != "m128" else (True,):  # dense matrices' K tails at few rows
            for mode in (_MODE_SWIGLU, _MODE_STORE, _MODE_ADD):
                dst = u32 if mode == _MODE_SWIGLU else f1
                out.append((_build(cfg, mode, exact_k)[0],
                            (u32, u32, f1, types.int32[:, ::1], i1, i1, i1, i1, i64, i64, i64, i64, i64, i64, dst)))
    return out
