"""Hopper warpgroup MMA (wgmma) from Numba on a dense bf16 GEMM, against cuBLAS (torch.matmul) in the same run
(GPU): what `kernels.wgmma` reaches before any MoE kernel is built on it.

C [M, N] fp32 = A [M, K] @ B [N, K]^T, A and B bf16 K-major. One block = BM = 128 rows (two warpgroups, 64 rows
each) x BN columns; K in steps of 64 through STAGES shared-memory stages filled by 16-byte cp.async in the
no-swizzle core-matrix layout (8 rows x 16 bytes contiguous; within a row group the 8 K-chunks follow each
other, so LBO = 128 bytes and SBO = 1,024). Variants:
Shared layouts: core matrices without swizzle, or 128-byte rows XOR-swizzled in 16-byte chunks (prefix sw_).
- wait0: each step issues its 4 wgmma's (k16 each) per warpgroup, commits, and waits for them before the next
  step's barrier; the refill of the stage the previous step read goes out right after the barrier;
- wait1: each step waits only for the previous step's group (wgmma.wait_group 1), so the tensor cores always
  have the next group queued; the refill targets the stage of two steps back.
Each variant's C must match numpy (fp64 reference on the same bf16 values) before it is timed. Printed per
shape: TFLOP/s of each variant and cuBLAS, and the ratio to cuBLAS.

    python bench/wgmma_gemm.py --out out/wgmma.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from expert_service.kernels.moe_gemm_mma import launch_with_shared  # noqa: E402
from expert_service.kernels.ptx import cp_async16, cp_async_commit, cp_async_wait_fn  # noqa: E402
from expert_service.kernels.wgmma import (  # noqa: E402
    fence_proxy_async,
    smem_desc,
    smem_desc_sw128,
    wgmma_bf16_fn,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait_fn,
)

BM, BK, THREADS = 128, 64, 256
CORE_BYTES, GROUP_BYTES = 128, 1024  # one core matrix (8 rows x 16 B); one row group (8 K-chunks of a BK step)
SHAPES = ((4096, 4096, 4096), (2048, 14336, 4096), (512, 28672, 4096), (2048, 4096, 14336))


@functools.cache
def accumulator_store_fn(bn: int):
    """Device function store(c, acc, row0, n0): a warpgroup's m64 x n`bn` float32 accumulator, in wgmma's fragment
    order (warp w of the warpgroup, lane l: rows row0 + 16w + l / 4 and + 8, column pairs n0 + 8j + 2 (l % 4)),
    into c [M, N]; row0 is the warpgroup's first row."""

    @cuda.jit(device=True, inline=True)
    def store(c, acc, row0, n0):
        warp, lane = (cuda.threadIdx.x // 32) % 4, cuda.threadIdx.x % 32
        row = row0 + warp * 16 + lane // 4
        for j in range(bn // 8):
            col = n0 + 8 * j + 2 * (lane % 4)
            for h in range(2):
                c[row + 8 * h, col] = acc[4 * j + 2 * h]
                c[row + 8 * h, col + 1] = acc[4 * j + 2 * h + 1]

    return store


@functools.cache
def gemm_kernel(bn: int, stages: int, overlap: bool, swizzle: bool):
    """C = A @ B^T (module docstring): a [M * K / 2] uint32 (bf16 pairs), b [N * K / 2] uint32, c [M, N] f32;
    M % 128 == 0, N % bn == 0, K % 64 == 0. Grid (N / bn, M / 128), block 256, dynamic shared stages * (128 + bn)
    * 128 bytes."""
    mma = wgmma_bf16_fn(bn)
    regs = bn // 2
    primed = stages - 2 if overlap else stages - 1
    wait_copies = cp_async_wait_fn(primed - 1)
    wait_mma = wgmma_wait_fn(1 if overlap else 0)
    wait_all = wgmma_wait_fn(0)
    store = accumulator_store_fn(bn)
    a_words, b_words = BM * BK // 2, bn * BK // 2  # uint32 words of a stage's A and B tiles
    stage_words = a_words + b_words

    @cuda.jit(device=True, inline=True)
    def chunk_slot(idx):
        """(row, K-chunk, byte offset in the tile) of the idx-th 16-byte chunk a thread copies."""
        if swizzle:  # 8 threads a row: 128 contiguous bytes read, one 128-byte row written (XOR within it)
            r, c = idx // 8, idx % 8
            return r, c, r * 128 + (c ^ (r % 8)) * 16
        g, within = idx // 64, idx % 64  # 8 threads a chunk column: one core matrix written
        r, c = g * 8 + within % 8, within // 8
        return r, c, g * GROUP_BYTES + c * CORE_BYTES + (within % 8) * 16

    @cuda.jit(device=True, inline=True)
    def load_tile(smem, stage, a, b, m0, n0, kt, k_words):
        base = stage * stage_words
        for i in range(BM * 8 // THREADS):
            r, c, offset = chunk_slot(cuda.threadIdx.x + i * THREADS)
            cp_async16(smem, base + offset // 4, a, (m0 + r) * k_words + kt * (BK // 2) + c * 4, True)
        for i in range(bn * 8 // THREADS):
            r, c, offset = chunk_slot(cuda.threadIdx.x + i * THREADS)
            cp_async16(smem, base + a_words + offset // 4, b, (n0 + r) * k_words + kt * (BK // 2) + c * 4, True)

    @cuda.jit(device=True, inline=True)
    def descriptors(smem, base, wg, kk):
        if swizzle:
            return (
                smem_desc_sw128(smem, base + (wg * 64 * 128 + kk * 32) // 4, 16, GROUP_BYTES),
                smem_desc_sw128(smem, base + a_words + (kk * 32) // 4, 16, GROUP_BYTES),
            )
        return (
            smem_desc(smem, base + (wg * 8 * GROUP_BYTES + kk * 2 * CORE_BYTES) // 4, CORE_BYTES, GROUP_BYTES),
            smem_desc(smem, base + a_words + (kk * 2 * CORE_BYTES) // 4, CORE_BYTES, GROUP_BYTES),
        )

    @cuda.jit
    def kernel(a, b, c, n_cols, k):
        smem = cuda.shared.array(0, np.uint32, alignment=1024)
        acc = cuda.local.array(regs, np.float32)
        for i in range(regs):
            acc[i] = np.float32(0.0)
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * bn
        k_words = k // 2
        nk = k // BK
        wg = cuda.threadIdx.x // 128
        for s in range(primed):
            if s < nk:
                load_tile(smem, s, a, b, m0, n0, s, k_words)
            cp_async_commit()
        for kt in range(nk):
            wait_copies()
            fence_proxy_async()
            cuda.syncthreads()
            nxt = kt + primed
            if nxt < nk:
                load_tile(smem, nxt % stages, a, b, m0, n0, nxt, k_words)
            cp_async_commit()
            base = (kt % stages) * stage_words
            wgmma_fence()
            for kk in range(BK // 16):
                da, db = descriptors(smem, base, wg, kk)
                mma(acc, 0, da, db, 1)
            wgmma_commit()
            wait_mma()
        wait_all()
        store(c, acc, m0 + wg * 64, n0)

    return kernel, stages * stage_words * 4


def launch(variant, a, b, c, stream):
    kernel, smem_bytes = gemm_kernel(*variant)
    m, n = c.shape
    k = a.size * 2 // m
    args = (a, b, c, np.int32(n), np.int32(k))
    launch_with_shared(kernel, (n // variant[0], m // BM), THREADS, stream, args, smem_bytes)


VARIANTS = {
    "n128_s4_wait0": (128, 4, False, False),
    "sw_n128_s4_wait0": (128, 4, False, True),
    "sw_n128_s5_wait1": (128, 5, True, True),
    "sw_n256_s4_wait1": (256, 4, True, True),
}


def time_call(fn, repeat: int = 20) -> float:
    """Mean ms of fn() between CUDA events after a warm-up call."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def run_shape(m: int, n: int, k: int, rng) -> dict:
    import torch

    a16 = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).to("cuda", torch.bfloat16)
    b16 = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).to("cuda", torch.bfloat16)
    a_words = cuda.as_cuda_array(a16.view(torch.int32).reshape(-1)).view(np.uint32)
    b_words = cuda.as_cuda_array(b16.view(torch.int32).reshape(-1)).view(np.uint32)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    rows = rng.choice(m, 64, replace=False)
    ref = (a16[rows].double() @ b16.double().T).cpu().numpy()
    flop = 2.0 * m * n * k
    out = {"m": m, "n": n, "k": k}
    ms = time_call(lambda: a16 @ b16.T)
    out["cublas_tflops"] = flop / ms / 1e9
    line = f"M={m:5d} N={n:5d} K={k:5d}: cuBLAS {out['cublas_tflops']:6.1f} TFLOP/s"
    for name, variant in VARIANTS.items():
        c = torch.full((m, n), float("nan"), device="cuda")
        c_dev = cuda.as_cuda_array(c)
        launch(variant, a_words, b_words, c_dev, stream)
        torch.cuda.synchronize()
        got = c[rows].double().cpu().numpy()
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        out[f"{name}_max_rel"] = err
        if not np.isfinite(got).all() or err > 1e-4:
            out[f"{name}_tflops"] = None
            line += f"  {name} WRONG ({err:.1e})"
            continue
        ms = time_call(lambda: launch(variant, a_words, b_words, c_dev, stream))
        out[f"{name}_tflops"] = flop / ms / 1e9
        line += f"  {name} {out[f'{name}_tflops']:6.1f} ({out[f'{name}_tflops'] / out['cublas_tflops']:.2f}x)"
    print(line, flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wgmma.json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    cases = [run_shape(m, n, k, rng) for m, n, k in SHAPES]
    Path(args.out).write_text(json.dumps({"device": str(cuda.get_current_device().name), "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
