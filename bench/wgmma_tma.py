"""Warpgroup MMA fed by the Tensor Memory Accelerator, with a producer warpgroup (GPU): the next step after
bench/wgmma_gemm.py, whose kernels have every thread issue cp.async copies and the whole block wait at one barrier
a step (0.55-0.84x cuBLAS at best). Dense C [M, N] fp32 = A [M, K] @ B [N, K]^T, bf16 K-major, against
torch.matmul in the same run; C is checked against a float64 reference on sampled rows before it is timed.

Kernel: 3 warpgroups (384 threads, one block an SM). Warpgroup 0 is the producer: one thread issues, per K step
of 64, two `cp.async.bulk.tensor.2d` copies (A [128, 64] and B [BN, 64] tiles, 128-byte swizzle: the layout the
wgmma descriptors read) into stage s, completing on the stage's `full` mbarrier (expect_tx of the step's bytes).
Warpgroups 1 and 2 (64 rows each) wait on `full[s]`, run four wgmma m64 n<BN> k16, commit, wait for all but this
group, and release the previous step's stage by arriving on its `empty` mbarrier (one thread a warpgroup), which
the producer waits on before it refills the stage. No block-wide barrier in the main loop. Tensor maps
(cuTensorMapEncodeTiled) live in device memory; the kernel gets their generic address.

Variants: bn 128 / 256 (per consumer warpgroup n = bn), stages 3 / 4 / 5. A first run prints each variant before it
launches (a hang shows where) and writes the JSON after every shape.

    python bench/wgmma_tma.py --out out/wgmma_tma.json
    python bench/wgmma_tma.py --sass     # no GPU: each variant's sm_90a resources and HGMMA / TMA / mbarrier counts
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.wgmma_gemm import accumulator_store_fn, time_call  # noqa: E402
from expert_service.kernels.moe_gemm_mma import launch_with_shared  # noqa: E402
from expert_service.kernels.ptx import _shared_address, _statement  # noqa: E402
from expert_service.kernels.wgmma import (  # noqa: E402
    smem_desc_sw128,
    wgmma_bf16_fn,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait_fn,
)

BM, BK, THREADS = 128, 64, 384
ROW_BYTES, ATOM_BYTES = 128, 1024
SHAPES = ((4096, 4096, 4096), (2048, 14336, 4096), (512, 28672, 4096), (2048, 4096, 14336))
VARIANTS = {"tma_n256_s4": (256, 4), "tma_n128_s5": (128, 5), "tma_n256_s3": (256, 3)}

# ---- mbarrier and bulk-tensor copies (inline PTX; shared addresses as 32-bit window offsets) ----------------
fence_mbarrier_init = _statement(
    "fence.mbarrier_init.release.cluster;", "Make mbarrier.init visible to the async proxy."
)


def _mbar_statement(asm: str, with_value: bool):
    """Intrinsic `(bars, index)`, or `(bars, index, value)` with a uint32 operand $1: one mbarrier statement on
    bars[index] (a 1-d uint64 shared array) at its 32-bit shared address $0."""

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        operands = [_shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])]
        if with_value:
            operands.append(context.cast(builder, args[2], sig.args[2], types.uint32))
        fnty = ir.FunctionType(ir.VoidType(), [i32] * len(operands))
        constraints = ",".join(["r"] * len(operands)) + ",~{memory}"
        builder.call(ir.InlineAsm(fnty, asm, constraints, side_effect=True), operands)
        return context.get_dummy_value()

    if with_value:

        @intrinsic
        def with_operand(typingctx, bars, index, value):
            return types.void(bars, index, types.uint32), codegen

        return with_operand

    @intrinsic
    def plain(typingctx, bars, index):
        return types.void(bars, index), codegen

    return plain


mbar_init = _mbar_statement("mbarrier.init.shared::cta.b64 [$0], $1;", with_value=True)  # $1: arrival count
mbar_arrive = _mbar_statement("mbarrier.arrive.shared::cta.b64 _, [$0];", with_value=False)
mbar_arrive_expect_tx = _mbar_statement("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", with_value=True)


@intrinsic
def mbar_try_wait(typingctx, bars, index, parity):
    """1 once the phase of `parity` of bars[index] has completed, else 0 (after a bounded hardware wait)."""
    sig = types.uint32(bars, index, types.uint32)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        fnty = ir.FunctionType(i32, [i32, i32])
        asm = "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;\nselp.u32 $0, 1, 0, p;\n}"
        return builder.call(
            ir.InlineAsm(fnty, asm, "=r,r,r,~{memory}", side_effect=True),
            [addr, context.cast(builder, args[2], sig.args[2], types.uint32)],
        )

    return sig, codegen


@intrinsic
def fence_tensormap(typingctx, tmap):
    """fence.proxy.tensormap::generic.acquire.sys on a tensor map the host wrote into device memory: the copy
    engine caches descriptors by address (SASS UTMACCTL.IV), and a freed map's address can come back with other
    contents."""
    sig = types.void(tmap)

    def codegen(context, builder, sig, args):
        tm = context.make_array(sig.args[0])(context, builder, value=args[0])
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64])
        asm = ir.InlineAsm(
            fnty, "fence.proxy.tensormap::generic.acquire.sys [$0], 128;", "l,~{memory}", side_effect=True
        )
        builder.call(asm, [builder.ptrtoint(tm.data, i64)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def tma_load_2d(typingctx, smem, index, tmap, c0, c1, bars, bar_index):
    """cp.async.bulk.tensor.2d of the box at (c0 innermost, c1) of tensor map `tmap` (a uint64 [16] device array
    holding a CUtensorMap) into smem[index...] (1,024-byte aligned), completing on bars[bar_index]."""
    sig = types.void(smem, index, tmap, types.int32, types.int32, bars, bar_index)

    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        dst = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        bar = _shared_address(context, builder, sig.args[5], args[5], sig.args[6], args[6])
        tm = context.make_array(sig.args[2])(context, builder, value=args[2])
        tm_addr = builder.ptrtoint(tm.data, i64)
        x = context.cast(builder, args[3], sig.args[3], types.int32)
        y = context.cast(builder, args[4], sig.args[4], types.int32)
        fnty = ir.FunctionType(ir.VoidType(), [i32, i64, i32, i32, i32])
        asm = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1, {$2, $3}], [$4];"
        builder.call(ir.InlineAsm(fnty, asm, "r,l,r,r,r,~{memory}", side_effect=True), [dst, tm_addr, x, y, bar])
        return context.get_dummy_value()

    return sig, codegen


# ---- the kernel ---------------------------------------------------------------------------------------------
@functools.cache
def gemm_kernel(bn: int, stages: int):
    """(kernel, dynamic shared bytes): C = A @ B^T with tensor maps ta (A [M, K], box [64, 128]) and tb (B [N, K],
    box [64, bn]); c [M, N] f32, M % 128 == 0, N % bn == 0, K % 64 == 0; grid (N / bn, M / 128), 384 threads."""
    mma = wgmma_bf16_fn(bn)
    regs = bn // 2
    a_words, b_words = BM * ROW_BYTES // 4, bn * ROW_BYTES // 4
    stage_words = a_words + b_words
    stage_bytes = stage_words * 4
    bars_offset = stages * stage_words * 4  # bytes: the mbarriers follow the stages
    wait_older, wait_all = wgmma_wait_fn(1), wgmma_wait_fn(0)
    store = accumulator_store_fn(bn)

    def kernel(ta, tb, c, k):
        smem = cuda.shared.array(0, np.uint32, alignment=ATOM_BYTES)
        bars = cuda.shared.array(0, np.uint64, alignment=ATOM_BYTES)  # the same memory: full[s] at stage words
        tid = cuda.threadIdx.x
        wg = tid // 128
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * bn
        nk = k // BK
        full0 = bars_offset // 8  # bars index of full[0]; empty[s] = full0 + stages + s
        if tid == 0:
            for s in range(stages):
                mbar_init(bars, full0 + s, 1)
                mbar_init(bars, full0 + stages + s, 2)
            fence_mbarrier_init()
        cuda.syncthreads()
        if wg == 0:  # the producer: one thread issues every copy, the warpgroup's other threads have nothing to do
            if tid == 0:
                fence_tensormap(ta)
                fence_tensormap(tb)
                for kt in range(nk):
                    s = kt % stages
                    if kt >= stages:  # wait until both consumers released the stage's previous use
                        while mbar_try_wait(bars, full0 + stages + s, ((kt // stages) - 1) & 1) == 0:
                            pass
                    mbar_arrive_expect_tx(bars, full0 + s, stage_bytes)
                    tma_load_2d(smem, s * stage_words, ta, kt * BK, m0, bars, full0 + s)
                    tma_load_2d(smem, s * stage_words + a_words, tb, kt * BK, n0, bars, full0 + s)
            return
        acc = cuda.local.array(regs, np.float32)
        for i in range(regs):
            acc[i] = np.float32(0.0)
        cw = wg - 1  # consumer warpgroup: rows 64 cw ..
        for kt in range(nk):
            s = kt % stages
            while mbar_try_wait(bars, full0 + s, (kt // stages) & 1) == 0:
                pass
            base = s * stage_words
            wgmma_fence()
            for kk in range(BK // 16):
                mma(
                    acc,
                    0,
                    smem_desc_sw128(smem, base + cw * 64 * ROW_BYTES // 4 + kk * 8, 16, ATOM_BYTES),
                    smem_desc_sw128(smem, base + a_words + kk * 8, 16, ATOM_BYTES),
                    1,
                )
            wgmma_commit()
            wait_older()  # step kt - 1's group is done: its stage may be refilled
            if kt > 0 and tid % 128 == 0:
                mbar_arrive(bars, full0 + stages + (kt - 1) % stages)
        wait_all()
        store(c, acc, m0 + cw * 64, n0)

    return kernel, stages * stage_bytes + 2 * stages * 8


def signature():
    return (types.uint64[::1], types.uint64[::1], types.float32[:, ::1], types.int32)


@functools.cache
def compiled(bn: int, stages: int):
    """The jitted kernel (sm_90a on the H200; one block an SM, so ptxas may give each thread 168 registers)."""
    fn, _ = gemm_kernel(bn, stages)
    return cuda.jit(fn, launch_bounds=(THREADS, 1))


def tensor_map(ptr: int, rows: int, k: int, box_rows: int):
    """A device uint64 [16] array holding the CUtensorMap of a row-major bf16 [rows, k] matrix at `ptr`, boxes of
    [box_rows, 64] with the 128-byte swizzle."""
    from cuda.bindings import driver as d

    u64, u32 = d.cuuint64_t, d.cuuint32_t  # the bindings refuse plain ints in these lists
    err, tmap = d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        2,
        ptr,
        [u64(k), u64(rows)],
        [u64(k * 2)],
        [u32(BK), u32(box_rows)],
        [u32(1), u32(1)],
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled: {err}")
    return cuda.to_device(np.array([int(v) for v in tmap.opaque], dtype=np.uint64))


def launch(variant, ta, tb, c, k, stream):
    bn, stages = variant
    m, n = c.shape
    if m % BM or n % bn or k % BK:
        raise ValueError(f"wgmma_tma needs M % {BM}, N % {bn} and K % {BK} zero, got {m} x {n} x {k}")
    kernel = compiled(bn, stages)
    smem_bytes = gemm_kernel(bn, stages)[1]
    launch_with_shared(kernel, (n // bn, m // BM), THREADS, stream, (ta, tb, c, np.int32(k)), smem_bytes)


def run_shape(m: int, n: int, k: int, rng) -> dict:
    import torch

    a16 = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).to("cuda", torch.bfloat16)
    b16 = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).to("cuda", torch.bfloat16)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    rows = rng.choice(m, 64, replace=False)
    ref = (a16[rows].double() @ b16.double().T).cpu().numpy()
    flop = 2.0 * m * n * k
    out = {"m": m, "n": n, "k": k, "cublas_tflops": flop / time_call(lambda: a16 @ b16.T) / 1e9}
    line = f"M={m:5d} N={n:5d} K={k:5d}: cuBLAS {out['cublas_tflops']:6.1f} TFLOP/s"
    for name, (bn, stages) in VARIANTS.items():
        print(f"  {m} x {n} x {k} {name} ...", flush=True)
        try:
            ta = tensor_map(a16.data_ptr(), m, k, BM)
            tb = tensor_map(b16.data_ptr(), n, k, bn)
            c = torch.full((m, n), float("nan"), device="cuda")
            c_dev = cuda.as_cuda_array(c)
            launch((bn, stages), ta, tb, c_dev, k, stream)
            torch.cuda.synchronize()
            got = c[rows].double().cpu().numpy()
            err = float(np.abs(got - ref).max() / np.abs(ref).max())
            out[f"{name}_max_rel"] = err
            if not np.isfinite(got).all() or err > 1e-4:
                line += f"  {name} WRONG ({err:.1e})"
                continue
            out[f"{name}_tflops"] = flop / time_call(lambda: launch((bn, stages), ta, tb, c_dev, k, stream)) / 1e9
        except Exception as exc:  # noqa: BLE001 -- a variant that fails is reported (a fault ends the run's GPU use)
            out[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            line += f"  {name} ERROR {out[f'{name}_error']}"
            continue
        line += f"  {name} {out[f'{name}_tflops']:6.1f} ({out[f'{name}_tflops'] / out['cublas_tflops']:.2f}x)"
    print(line, flush=True)
    return out


def sass_counts() -> dict:
    """Per variant (no GPU): nvJitLink's resources for sm_90a and the SASS counts of the instructions the design
    rests on (HGMMA: wgmma, UTMALDG: the bulk tensor copies, SYNCS: mbarrier operations, CALL: none allowed)."""
    import re
    import subprocess
    import tempfile
    from collections import Counter

    from bench.kernel_resources import link_report, nvdisasm_path

    out = {}
    for name, (bn, stages) in VARIANTS.items():
        fn, _ = gemm_kernel(bn, stages)
        ptx, _ = cuda.compile_ptx(fn, signature(), cc=(9, 0, "a"), launch_bounds=(THREADS, 1))
        report, cubin = link_report(ptx, "sm_90a")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            sass = subprocess.run([nvdisasm_path(), f.name], capture_output=True, text=True, check=True).stdout
        ops = Counter(
            m.split(".")[0]
            for m in re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M)
        )
        out[name] = {**report, **{op: ops[op] for op in ("HGMMA", "UTMALDG", "SYNCS", "CALL")}}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wgmma_tma.json")
    parser.add_argument("--sass", action="store_true", help="print each variant's sm_90a SASS counts (no GPU)")
    args = parser.parse_args(argv)
    if args.sass:
        print(json.dumps(sass_counts()))
        return 0
    rng = np.random.default_rng(0)
    result: dict = {"device": str(cuda.get_current_device().name), "cases": []}
    for m, n, k in SHAPES:  # the JSON after every shape: a later fault or hang keeps what was measured
        result["cases"].append(run_shape(m, n, k, rng))
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
