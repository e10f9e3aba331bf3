"""Inline-PTX Hopper warpgroup MMA (sm_90a) for Numba CUDA kernels: `wgmma.mma_async` bf16 -> fp32 with both
operands in shared memory, and the fences and group waits around it.

Numba compiles for `compute_90a` on an sm_90 device (numba-cuda picks the arch-specific target from 9.0 on), so
these instructions assemble there; for a PTX check without a GPU pass ``cc=(9, 0, "a")`` to ``compile_ptx``.
A warpgroup is four consecutive warps starting at a warp index divisible by four; all 128 threads issue each
instruction together (`.sync.aligned`).

- ``wgmma_bf16_fn(n)``: device function ``mma(acc, base, desc_a, desc_b, accumulate)`` issuing
  `wgmma.mma_async.sync.aligned.m64n<n>k16.f32.bf16.bf16`: D[64 x n] (+)= A[64 x 16] @ B[n x 16]^T, both K-major
  (rows of 16 bf16 along K), fp32 accumulators acc[base .. base + n/2) of this thread (a local float32 array,
  indexed by constants only so it stays in registers). accumulate == 0 ignores the old acc (D = A B).
  Fragment of thread i of the warpgroup (w = i // 32 its warp, l = i % 32): acc[base + 4j + 2h + c] holds
  D[16w + l // 4 + 8h, 8j + 2 (l % 4) + c] for j < n / 8, h, c in {0, 1} (PTX ISA, "wgmma D fragments").
- ``smem_desc(smem, index, lbo, sbo)``: the 64-bit matrix descriptor of the tile starting at smem[index] (a 1-d
  shared array, 16-byte aligned element) in the no-swizzle layout: the tile is made of core matrices of 8 rows
  x 16 bytes stored as 128 contiguous bytes; `lbo` is the byte distance between core matrices adjacent along K
  and `sbo` between core matrices adjacent along M / N (both multiples of 16).
- ``smem_desc_sw128(smem, index, lbo, sbo)``: the same in the 128-byte swizzle layout: a K-major row of 64 bf16
  is 128 contiguous bytes whose 16-byte chunk c sits at position c ^ (row % 8); 8 rows form a 1,024-byte atom
  (1,024-byte aligned), `sbo` is the distance between atoms along M / N (1,024 when rows follow each other) and
  `lbo` is unused (16). A k16 step inside the 64-wide row starts 32 bytes further (the hardware applies the XOR to
  the address bits, so the descriptor of step s is the atom's plus 32 s bytes).
- ``wgmma_fence()`` (`wgmma.fence.sync.aligned`): before the first mma of a group, once registers or shared
  memory it reads were written by ordinary instructions. ``wgmma_commit()`` closes this warpgroup's group of
  mma's; ``wgmma_wait_fn(n)`` returns the device function waiting until at most n groups are pending (the
  accumulators of finished groups are then readable). ``fence_proxy_async()`` (`fence.proxy.async.shared::cta`):
  shared memory written by ordinary stores or cp.async that wgmma (the async proxy) reads next; each writing
  thread runs it, then a block barrier.
The simulator cannot run any of this: kernels using it are GPU-only.
"""
from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.cuda.core.errors import NumbaTypeError
from numba.cuda.extending import intrinsic

from expert_service.kernels.ptx import _shared_address, _statement

N_CHOICES = (8, 16, 32, 64, 96, 128, 192, 256)

wgmma_fence = _statement("wgmma.fence.sync.aligned;", "Order earlier register / shared writes before wgmma.")
wgmma_commit = _statement("wgmma.commit_group.sync.aligned;", "Close this warpgroup's group of wgmma's.")
fence_proxy_async = _statement("fence.proxy.async.shared::cta;", "Make generic shared writes visible to wgmma.")


@functools.cache
def wgmma_wait_fn(pending: int):
    """Device function: wait until at most `pending` of this warpgroup's wgmma groups are in flight."""
    return _statement(f"wgmma.wait_group.sync.aligned {int(pending)};", wgmma_wait_fn.__doc__ or "")


def _descriptor_intrinsic(swizzle: int, name: str):
    """Intrinsic `(smem, index, lbo, sbo) -> uint64` matrix descriptor with this layout type (bits 62-63)."""
    @intrinsic
    def impl(typingctx, smem, index, lbo, sbo):
        if not (isinstance(smem, types.Array) and smem.ndim == 1 and isinstance(index, types.Integer)
                and isinstance(lbo, types.Integer) and isinstance(sbo, types.Integer)):
            raise NumbaTypeError(f"{name} needs a 1-d shared array and integer index / offsets, got {smem}, {index}")
        sig = types.uint64(smem, index, lbo, sbo)

        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            addr = builder.zext(_shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1]), i64)

            def field(value, value_t, shift):
                v = builder.lshr(context.cast(builder, value, value_t, types.uint64), ir.Constant(i64, 4))
                return builder.shl(builder.and_(v, ir.Constant(i64, 0x3FFF)), ir.Constant(i64, shift))

            desc = builder.and_(builder.lshr(addr, ir.Constant(i64, 4)), ir.Constant(i64, 0x3FFF))
            desc = builder.or_(desc, field(args[2], sig.args[2], 16))
            desc = builder.or_(desc, field(args[3], sig.args[3], 32))
            return builder.or_(desc, ir.Constant(i64, swizzle << 62))
        return sig, codegen
    impl.__name__ = name
    return impl


smem_desc = _descriptor_intrinsic(0, "smem_desc")
smem_desc_sw128 = _descriptor_intrinsic(1, "smem_desc_sw128")


@functools.cache
def wgmma_bf16_fn(n: int):
    """Device function `mma(acc, base, desc_a, desc_b, accumulate)` for m64n<n>k16 (module docstring)."""
    if n not in N_CHOICES:
        raise ValueError(f"wgmma n must be one of {N_CHOICES}, got {n}")
    regs = n // 2
    outs = ", ".join(f"${i}" for i in range(regs))
    asm = ("{\n.reg .pred p;\n"
           f"setp.ne.b32 p, ${regs + 2}, 0;\n"
           f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{outs}}}, ${regs}, ${regs + 1}, p, 1, 1, 0, 0;\n"
           "}")
    constraints = ",".join(["=f"] * regs + ["l", "l", "r"] + [str(i) for i in range(regs)])

    @intrinsic
    def mma(typingctx, acc, base, desc_a, desc_b, accumulate):
        if not (isinstance(acc, types.Array) and acc.ndim == 1 and acc.dtype == types.float32
                and isinstance(base, types.IntegerLiteral)):
            raise NumbaTypeError(f"wgmma needs a 1-d float32 local array and a literal base index, got {acc}, {base}")
        sig = types.void(acc, base, types.uint64, types.uint64, types.int32)
        first = base.literal_value

        def codegen(context, builder, sig, args):
            f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            ptrs = [builder.gep(ary.data, [ir.Constant(i64, first + r)], inbounds=True) for r in range(regs)]
            old = [builder.load(p) for p in ptrs]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * regs), [i64, i64, i32] + [f32] * regs)
            flag = context.cast(builder, args[4], sig.args[4], types.int32)
            out = builder.call(ir.InlineAsm(fnty, asm, constraints, side_effect=True),
                               [args[2], args[3], flag] + old)
            for r, p in enumerate(ptrs):
                builder.store(builder.extract_value(out, r), p)
            return context.get_dummy_value()
        return sig, codegen
    return mma
