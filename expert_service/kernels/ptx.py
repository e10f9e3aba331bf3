"""Inline-PTX device helpers that Numba has no API for: 16-byte global loads.

Numba's vector types are register values only, and its cache-hint loads (`cuda.ldcs`, ...) stop at 8 bytes,
so a 16-byte `ld.global.*.v4` needs an intrinsic that emits the instruction itself (the pattern of
numba-cuda's cache_hints.py). The widest load streams weights fastest (docs/kernels.md has the figures).

- ``ld_stream_v4(a, i)``: ``ld.global.nc.L1::no_allocate.v4`` -- weights, read once: they bypass L1 so
  they do not evict the activation vector that every warp of the SM re-reads.
- ``ld_v4(a, i)``: ``ld.global.nc.v4`` -- activations, cached in L1 (re-read by every warp).
Both return the four 32-bit elements a[i], a[i+1], a[i+2], a[i+3] of a 1-d C-contiguous uint32 or float32
array as a 4-tuple of that dtype. The caller guarantees a[i] is 16-byte aligned and that nothing writes the
array during the kernel (`.nc` goes through the read-only path). No bounds check.

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) inline PTX cannot run; the same names are plain array
reads, so kernels using them still run (slowly) on tiny shapes.
"""
from __future__ import annotations

from numba import cuda

from expert_service.kernels.numeric import SIMULATOR

if SIMULATOR:
    @cuda.jit(device=True)
    def ld_stream_v4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @cuda.jit(device=True)
    def ld_v4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.core.errors import NumbaTypeError
    from numba.cuda.extending import intrinsic

    _PTX_TYPE = {types.uint32: ("u32", "r"), types.float32: ("f32", "f")}

    def _ld_v4_intrinsic(cache_op: str):
        """Intrinsic `(array, index) -> UniTuple(dtype, 4)` emitting `ld.global.<cache_op>.v4.<type>`."""
        @intrinsic
        def impl(typingctx, array, index):
            if not (isinstance(array, types.Array) and array.ndim == 1 and array.dtype in _PTX_TYPE
                    and isinstance(index, types.Integer)):
                raise NumbaTypeError(f"16-byte load needs a 1-d uint32/float32 array and an integer index, "
                                     f"got {array}, {index}")
            sig = types.UniTuple(array.dtype, 4)(array, index)

            def codegen(context, builder, sig, args):
                array_type, index_type = sig.args
                arr, idx = args
                ary = context.make_array(array_type)(context, builder, value=arr)
                idx = context.cast(builder, idx, index_type, types.intp)
                ptr = cgutils.get_item_pointer(context, builder, array_type, ary, [idx], wraparound=False)
                elem = context.get_value_type(array_type.dtype)
                ptx_type, reg = _PTX_TYPE[array_type.dtype]
                fnty = ir.FunctionType(ir.LiteralStructType([elem] * 4), [elem.as_pointer()])
                asm = ir.InlineAsm(fnty, f"ld.global.{cache_op}.v4.{ptx_type} {{$0, $1, $2, $3}}, [$4];",
                                   f"={reg},={reg},={reg},={reg},l")
                res = builder.call(asm, [ptr])
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(res, j) for j in range(4)])
            return sig, codegen
        return impl

    ld_stream_v4 = _ld_v4_intrinsic("nc.L1::no_allocate")
    ld_v4 = _ld_v4_intrinsic("nc")
