"""The inline PTX behind `kernels.wgmma`, imported only outside the CUDA simulator (its docstring says what each
name does)."""
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
    return impl


smem_desc = _descriptor_intrinsic(0, "smem_desc")
smem_desc_sw128 = _descriptor_intrinsic(1, "smem_desc_sw128")


# kind -> (shape's k, type suffix, immediates after scale-d, accumulator type, its register constraint). bf16 takes
# imm-scale-a / b and the two transpose immediates (both operands K-major: 0); 8-bit operands have no transpose
# immediates (K-major only), e4m3 keeps the scale immediates, s8 has none and accumulates in s32.
KINDS = {
    "bf16": (16, "f32.bf16.bf16", ", 1, 1, 0, 0", types.float32, "=f"),
    "e4m3": (32, "f32.e4m3.e4m3", ", 1, 1", types.float32, "=f"),
    "s8": (32, "s32.s8.s8", "", types.int32, "=r"),
}


@functools.cache
def wgmma_fn(n: int, kind: str):
    """Device function `mma(acc, base, desc_a, desc_b, accumulate)` for m64n<n>k<16 or 32> of this operand kind
    (module docstring of kernels.wgmma)."""
    if n not in N_CHOICES:
        raise ValueError(f"wgmma n must be one of {N_CHOICES}, got {n}")
    if kind not in KINDS:
        raise ValueError(f"wgmma kind must be one of {sorted(KINDS)}, got {kind!r}")
    k, types_suffix, immediates, acc_type, reg = KINDS[kind]
    regs = n // 2
    outs = ", ".join(f"${i}" for i in range(regs))
    asm = ("{\n.reg .pred p;\n"
           f"setp.ne.b32 p, ${regs + 2}, 0;\n"
           f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.{types_suffix} {{{outs}}}, ${regs}, ${regs + 1}, p{immediates};\n"
           "}")
    constraints = ",".join([reg] * regs + ["l", "l", "r"] + [str(i) for i in range(regs)])

    @intrinsic
    def mma(typingctx, acc, base, desc_a, desc_b, accumulate):
        if not (isinstance(acc, types.Array) and acc.layout == "C" and acc.dtype == acc_type
                and isinstance(base, types.IntegerLiteral)):
            raise NumbaTypeError(f"wgmma {kind} needs a C-contiguous {acc_type} local array and a literal base index, "
                                 f"got {acc}, {base}")
        sig = types.void(acc, base, types.uint64, types.uint64, types.int32)
        first = base.literal_value

        def codegen(context, builder, sig, args):
            value_t, i32, i64 = context.get_value_type(acc_type), ir.IntType(32), ir.IntType(64)
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            ptrs = [builder.gep(ary.data, [ir.Constant(i64, first + r)], inbounds=True) for r in range(regs)]
            old = [builder.load(p) for p in ptrs]
            fnty = ir.FunctionType(ir.LiteralStructType([value_t] * regs), [i64, i64, i32] + [value_t] * regs)
            flag = context.cast(builder, args[4], sig.args[4], types.int32)
            out = builder.call(ir.InlineAsm(fnty, asm, constraints, side_effect=True),
                               [args[2], args[3], flag] + old)
            for r, p in enumerate(ptrs):
                builder.store(builder.extract_value(out, r), p)
            return context.get_dummy_value()
        return sig, codegen
    return mma


def wgmma_bf16_fn(n: int):
    """`wgmma_fn(n, "bf16")`: m64n<n>k16, bf16 operands, fp32 accumulators."""
    return wgmma_fn(n, "bf16")


def wgmma_q8_fn(n: int, kind: str):
    """`wgmma_fn(n, kind)` for 8-bit operands, m64n<n>k32: kind "e4m3" (fp32 accumulators) or "s8" (int32)."""
    if kind not in ("e4m3", "s8"):
        raise ValueError(f"8-bit wgmma kind must be e4m3 or s8, got {kind!r}")
    return wgmma_fn(n, kind)
