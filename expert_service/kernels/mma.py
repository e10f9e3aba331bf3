"""Inline-PTX tensor-core helpers for Numba CUDA kernels (sm_80 and later; the kernels target sm_90).

Numba has no mma/wmma API (numba/numba#5899), so these are `numba.cuda.extending.intrinsic`s emitting llvmlite
`ir.InlineAsm`, the way numba-cuda's own cache_hints.py emits `ld.global.cs`. The CUDA simulator cannot run inline
PTX: a kernel that calls them must not be launched under NUMBA_ENABLE_CUDASIM (callers keep a plain fallback), or
calls `block_mma` / `block_pack` / `block_exp2` instead: the intrinsics on the GPU and, in the simulator, an exact
emulation through shared memory (every thread of the block must then call block_mma together; block_exp2 is
math.exp2 there).

Fragments of `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (PTX ISA, "Matrix Fragments for mma.m16n8k16
with floating point type"), per lane with g = lane >> 2 and t = lane & 3. Each A/B register is a uint32 holding two
bf16 values, the lower index in the low half (what `pack_bf16x2(lo, hi)` builds):
    A [16 x 16], row-major:  a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]   a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
    B [16 x 8], "col":       b0 = B[2t:2t+2, g]   b1 = B[2t+8:2t+10, g]
    C, D [16 x 8] float32:   c0, c1 = C[g, 2t], C[g, 2t+1]        c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
Only the pairing of A's and B's k indices matters to the product, so a kernel may permute k (e.g. give lane t the
four consecutive values 4t:4t+4 as its "2t:2t+2" and "2t+8:2t+10" pairs) to read wider words from memory.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

from expert_service.kernels.numeric import SIMULATOR, WARP, f32_to_bf16

_MAX_SIM_THREADS = 256

_MMA_BF16 = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
             "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


@intrinsic
def mma_bf16_m16n8k16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A @ B + C on one warp's fragments (layout in the module docstring): a0..a3, b0, b1 uint32 (packed bf16
    pairs), c0..c3 float32; returns (d0, d1, d2, d3) float32. Every lane of the warp must call it together."""
    u32, f32 = types.uint32, types.float32
    sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, u32, u32, f32, f32, f32, f32)

    def codegen(context, builder, signature, args):
        i32, f32_ir = ir.IntType(32), ir.FloatType()
        fnty = ir.FunctionType(ir.LiteralStructType([f32_ir] * 4), [i32] * 6 + [f32_ir] * 4)
        asm = ir.InlineAsm(fnty, _MMA_BF16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
        out = builder.call(asm, list(args))
        return context.make_tuple(builder, signature.return_type, [builder.extract_value(out, i) for i in range(4)])

    return sig, codegen


@intrinsic
def pack_bf16x2(typingctx, lo, hi):
    """uint32 holding bf16(lo) in the low half and bf16(hi) in the high half, each rounded to nearest even
    (`cvt.rn.bf16x2.f32`, whose first source fills the high half)."""
    sig = types.uint32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
        asm = ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
        return builder.call(asm, [args[1], args[0]])

    return sig, codegen


@intrinsic
def exp2_approx(typingctx, x):
    """2**x in float32 via `ex2.approx.ftz.f32` (max relative error 2**-22; exp2(-inf) = +0), the instruction
    flash-attention's softmax uses. Numba's math.exp2 calls libdevice, which adds range handling around it."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
        return builder.call(ir.InlineAsm(fnty, "ex2.approx.ftz.f32 $0, $1;", "=f,f"), list(args))

    return sig, codegen


@intrinsic
def rcp_approx(typingctx, x):
    """1 / x in float32 via `rcp.approx.ftz.f32` (max error 1 ulp). IEEE division (`div.rn.f32`) brings ptxas's
    slow-path subroutine into the kernel, and a kernel with a call serialises its wgmma's."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
        return builder.call(ir.InlineAsm(fnty, "rcp.approx.ftz.f32 $0, $1;", "=f,f"), list(args))

    return sig, codegen


# ---- block_mma / block_pack: the intrinsics on the GPU, an exact emulation in the simulator ---------------
# Kernels that must also run under NUMBA_ENABLE_CUDASIM (on small tiles, so CI tests their indexing) call these.
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
        the emulation exchanges fragments through shared memory between two block barriers). Lane 0 of each warp
        multiplies the warp's fragments once for its 32 lanes (each lane's own product was 32 times the work)."""
        regs = cuda.shared.array((_MAX_SIM_THREADS, 6), np.uint32)
        products = cuda.shared.array((_MAX_SIM_THREADS // WARP, 16, 8), np.float64)
        tid = cuda.threadIdx.x
        for i, v in enumerate((a0, a1, a2, a3, b0, b1)):
            regs[tid, i] = v
        cuda.syncthreads()
        if tid % WARP == 0:
            warp = regs[tid:tid + WARP]
            a = _unpack(warp[_A_LANE, _A_REG], _A_SHIFT).astype(np.float64)
            b = _unpack(warp[_B_LANE, _B_REG], _B_SHIFT).astype(np.float64)
            products[tid // WARP] = a @ b
        cuda.syncthreads()  # regs are free again, and the products written, once every thread is past this
        d = products[tid // WARP]
        g, t = (tid % WARP) // 4, tid % 4
        return (np.float32(c0 + d[g, 2 * t]), np.float32(c1 + d[g, 2 * t + 1]),
                np.float32(c2 + d[g + 8, 2 * t]), np.float32(c3 + d[g + 8, 2 * t + 1]))

    @cuda.jit(device=True)
    def pack(lo, hi):
        return np.uint32(f32_to_bf16(lo)) | (np.uint32(f32_to_bf16(hi)) << np.uint32(16))

    @cuda.jit(device=True)
    def exp2(x):
        return np.float32(math.exp2(x))
    block_mma, block_pack, block_exp2 = mma, pack, exp2
else:
    block_mma, block_pack, block_exp2 = mma_bf16_m16n8k16, pack_bf16x2, exp2_approx
