"""Inline-PTX device helpers that Numba has no API for: 16-byte global loads and asynchronous copies to shared
memory.

Numba's vector types are register values only, and its cache-hint loads (`cuda.ldcs`, ...) stop at 8 bytes,
so a 16-byte `ld.global.*.v4` needs an intrinsic that emits the instruction itself (the pattern of
numba-cuda's cache_hints.py). The widest load streams weights fastest (docs/kernels.md has the figures).

- ``ld_stream_v4(a, i)``: ``ld.global.nc.L1::no_allocate.v4`` -- weights, read once: they bypass L1 so
  they do not evict the activation vector that every warp of the SM re-reads.
- ``ld_v4(a, i)``: ``ld.global.nc.v4`` -- activations, cached in L1 (re-read by every warp).
Both return the four 32-bit elements a[i], a[i+1], a[i+2], a[i+3] of a 1-d C-contiguous uint32 or float32
array as a 4-tuple of that dtype. The caller guarantees a[i] is 16-byte aligned and that nothing writes the
array during the kernel (`.nc` goes through the read-only path). No bounds check.
- ``ld_stream_v4_coherent(a, i)`` / ``ld_v4_coherent(a, i)``: the same without ``.nc``
  (``ld.global.L1::no_allocate.v4`` / ``ld.global.v4``), for kernels whose inputs a programmatic predecessor may
  still be writing when they start: the memory model does not cover ``.nc`` loads, and ptxas hoists
  ``griddepcontrol.wait`` above them, where it keeps these after it.

- ``prmt_fn(selector)``: the device function ``prmt(a, b) -> uint32`` emitting ``prmt.b32 d, a, b, selector``
  (selector a compile-time constant): byte k of d is byte (selector >> 4k) & 7 of the 8 bytes b:a (0-3 from a,
  4-7 from b). One instruction places a byte anywhere in a word, which the 8-bit decoders need per value.
- ``dp4a(a, b, c) -> int32``: ``dp4a.s32.s32 d, a, b, c``: c plus the dot product of the four signed bytes of a
  with those of b (byte k with byte k), in 32-bit integers -- an int8 x int8 dot product of 4 values in one
  instruction, where widening each value to float32 takes three.
- ``cp_async16(dst, di, src, si, valid)``: ``cp.async.cg.shared.global`` of 16 bytes: src[si .. si+3] (1-d
  uint32 array in global memory, si a multiple of 4) to dst[di], dst[di+1] (1-d uint64 array in shared memory, di
  even) or dst[di .. di+3] (uint32 shared array, di a multiple of 4), without passing through registers; zeros
  instead when valid is false (src-size 0: nothing is read).
  ``cp_async_commit()`` closes the group of copies this thread issued; ``cp_async_wait(n)`` (n a compile-time
  constant: ``cp_async_wait_fn(n)`` returns the device function) waits until at most n of this thread's groups
  are in flight. A block barrier after the wait makes every thread's copies visible (Ampere's multi-stage GEMM
  pipeline).
- ``lds32(smem, i)``: ``ld.volatile.shared.b32`` of smem[i] (1-d uint32 shared array). Adjacent 32-bit loads are
  otherwise fused into one 64-bit load, whose register pair may not be where an mma wants its fragment: four
  separate loads can land in the mma's four consecutive registers directly, where a fused pair needs moves.
- ``st_v4(a, i, x0, x1, x2, x3)``: ``st.global.v4.f32`` of a[i .. i+3] (1-d float32 array, a[i] 16-byte aligned):
  one store where Numba's indexing spends four, each with its own index arithmetic.
- ``ld_shared(smem, i)``: ``ld.shared.b32`` / ``.b64`` of smem[i] (1-d uint32 / uint64 shared array) at a 32-bit
  address. Numba's own indexing handles negative indices (a compare and a select) in 64-bit arithmetic, ~6 integer
  instructions a load, which made a tensor-core kernel's fragment loads cost more issue slots than its mma; the
  statement is volatile to LLVM (never merged with or moved across another, so never across a barrier), ptxas
  still schedules it.
- ``ld_shared_v4(smem, i)`` / ``st_shared_v4(smem, i, x0, x1, x2, x3)``: ``ld.shared.v4.b32`` / ``st.shared.v4.b32``
  of smem[i .. i+3] (1-d uint32 shared array, smem[i] 16-byte aligned) at a 32-bit address: one 16-byte access
  where Numba's indexing spends four, each with its own index arithmetic. Volatile statements (never moved
  across a barrier).
- ``griddep_launch_dependents()`` / ``griddep_wait()``: ``griddepcontrol.launch_dependents`` / ``.wait``
  (sm_90 programmatic dependent launch): a kernel joined to the next by a programmatic graph edge lets that
  kernel's blocks start once every block has called the first; the dependent calls the second before it reads
  what its predecessor wrote (it returns when the predecessor has completed and its memory is visible). Without a
  programmatic edge both return at once.
- ``prefetch_l2_bulk(a, i, nbytes)``: ``cp.async.bulk.prefetch.L2.global`` (sm_90): the bulk-copy unit starts
  bringing `nbytes` (a multiple of 16) of global memory from a[i] (1-d uint8 / uint32 array, a[i] 16-byte aligned)
  into L2 and the thread goes on at once: no registers, no completion to wait for. A hint: a later load finds
  the bytes in L2 or on their way there, and nothing is wrong if it does not.
Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) inline PTX cannot run; the same names are plain array
reads and copies (the waits do nothing), so kernels using them still run (slowly) on tiny shapes.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from expert_service.kernels.numeric import SIMULATOR

if SIMULATOR:
    @cuda.jit(device=True)
    def ld_stream_v4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @cuda.jit(device=True)
    def ld_v4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    ld_stream_v4_coherent, ld_v4_coherent = ld_stream_v4, ld_v4

    @cuda.jit(device=True)
    def cp_async16(dst, di, src, si, valid):
        if dst.dtype == np.uint32:
            for j in range(4):
                dst[di + j] = src[si + j] if valid else np.uint32(0)
        elif valid:
            dst[di] = np.uint64(src[si]) | (np.uint64(src[si + 1]) << np.uint64(32))
            dst[di + 1] = np.uint64(src[si + 2]) | (np.uint64(src[si + 3]) << np.uint64(32))
        else:
            dst[di] = np.uint64(0)
            dst[di + 1] = np.uint64(0)

    @cuda.jit(device=True)
    def cp_async_commit():
        pass

    griddep_launch_dependents = griddep_wait = cp_async_commit   # no programmatic launch here: nothing to do

    @cuda.jit(device=True)
    def prefetch_l2_bulk(a, i, nbytes):
        pass    # no cache to warm

    @cuda.jit(device=True)
    def ld_shared(a, i):
        return a[i]

    lds32 = ld_shared

    @cuda.jit(device=True)
    def ld_shared_v4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @cuda.jit(device=True)
    def st_v4(a, i, x0, x1, x2, x3):
        a[i] = x0
        a[i + 1] = x1
        a[i + 2] = x2
        a[i + 3] = x3

    st_shared_v4 = st_v4

    def cp_async_wait_fn(pending: int):
        return cp_async_commit      # the copies are synchronous here: nothing to wait for

    @cuda.jit(device=True)
    def dp4a(a, b, c):
        total = int(c)
        for k in range(4):
            x, y = (int(a) >> (8 * k)) & 0xFF, (int(b) >> (8 * k)) & 0xFF
            total += (x - 256 if x > 127 else x) * (y - 256 if y > 127 else y)
        return np.int32(total)

    @functools.cache
    def prmt_fn(selector: int):
        shifts = [np.uint64(8 * ((selector >> (4 * k)) & 7)) for k in range(4)]

        @cuda.jit(device=True)
        def prmt(a, b):
            both = np.uint64(a) | (np.uint64(b) << np.uint64(32))
            out = np.uint64(0)
            for k in range(4):
                out |= ((both >> shifts[k]) & np.uint64(0xFF)) << np.uint64(8 * k)
            return np.uint32(out)
        return prmt
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils  # type: ignore[attr-defined]  # numba's own numba/cuda stub lacks what numba-cuda provides
    from numba.cuda.core.errors import NumbaTypeError
    from numba.cuda.extending import intrinsic

    _PTX_TYPE = {types.uint32: ("u32", "r"), types.float32: ("f32", "f")}

    def _require_indexed(name: str, array, dtypes, index, what: str = "") -> None:
        """Typing check of an intrinsic's (1-d array of one of `dtypes`, integer index) pair."""
        if not (isinstance(array, types.Array) and array.ndim == 1 and array.dtype in dtypes
                and isinstance(index, types.Integer)):
            raise NumbaTypeError(f"{name} needs a 1-d {'/'.join(map(str, dtypes))} {what}array and an integer index, "
                                 f"got {array}, {index}")

    def _item_pointer(context, builder, array_t, array_v, index_t, index_v):
        """Pointer to array[index] of a 1-d array, without Numba's negative-index wraparound."""
        ary = context.make_array(array_t)(context, builder, value=array_v)
        index = context.cast(builder, index_v, index_t, types.intp)
        return cgutils.get_item_pointer(context, builder, array_t, ary, [index], wraparound=False)

    def _ld_v4_intrinsic(cache_op: str):
        """Intrinsic `(array, index) -> UniTuple(dtype, 4)` emitting `ld.global.<cache_op>.v4.<type>`."""
        @intrinsic
        def impl(typingctx, array, index):
            _require_indexed("a 16-byte load", array, tuple(_PTX_TYPE), index)
            sig = types.UniTuple(array.dtype, 4)(array, index)

            def codegen(context, builder, sig, args):
                array_type, index_type = sig.args
                ptr = _item_pointer(context, builder, array_type, args[0], index_type, args[1])
                elem = context.get_value_type(array_type.dtype)
                ptx_type, reg = _PTX_TYPE[array_type.dtype]
                fnty = ir.FunctionType(ir.LiteralStructType([elem] * 4), [elem.as_pointer()])
                op = f"ld.global.{cache_op}" if cache_op else "ld.global"
                asm = ir.InlineAsm(fnty, f"{op}.v4.{ptx_type} {{$0, $1, $2, $3}}, [$4];",
                                   f"={reg},={reg},={reg},={reg},l")
                res = builder.call(asm, [ptr])
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(res, j) for j in range(4)])
            return sig, codegen
        return impl

    ld_stream_v4 = _ld_v4_intrinsic("nc.L1::no_allocate")
    ld_v4 = _ld_v4_intrinsic("nc")
    ld_stream_v4_coherent = _ld_v4_intrinsic("L1::no_allocate")
    ld_v4_coherent = _ld_v4_intrinsic("")

    def _shared_address(context, builder, array_t, array_v, index_t, index_v):
        """The 32-bit shared-window address of array[index] (a 1-d shared array). Numba hands the shared array over
        as a generic pointer cast from the shared variable; casting it back lets LLVM fold the pair, so the address
        is the variable plus the element offset, truncated to 32 bits (no cvta per access)."""
        ary = context.make_array(array_t)(context, builder, value=array_v)
        shared = builder.addrspacecast(ary.data, ir.PointerType(ary.data.type.pointee, 3))
        index = context.cast(builder, index_v, index_t, types.intp)
        return builder.ptrtoint(builder.gep(shared, [index], inbounds=True), ir.IntType(32))

    @intrinsic
    def cp_async16(typingctx, dst, di, src, si, valid):
        """16-byte cp.async (module docstring): dst 1-d uint64 or uint32 shared array, src 1-d uint32 global array."""
        if not (isinstance(dst, types.Array) and dst.ndim == 1 and dst.dtype in (types.uint64, types.uint32)
                and isinstance(src, types.Array) and src.ndim == 1 and src.dtype == types.uint32
                and isinstance(di, types.Integer) and isinstance(si, types.Integer)):
            raise NumbaTypeError(f"cp_async16 needs a 1-d uint64/uint32 shared array and a 1-d uint32 array, got "
                                 f"{dst}, {src}")
        sig = types.void(dst, di, src, si, valid)

        def codegen(context, builder, sig, args):
            dst_t, di_t, src_t, si_t, valid_t = sig.args
            dst_a, di_v, src_a, si_v, valid_v = args
            i32 = ir.IntType(32)
            dst_addr = _shared_address(context, builder, dst_t, dst_a, di_t, di_v)
            src_ptr = _item_pointer(context, builder, src_t, src_a, si_t, si_v)
            valid_i1 = context.cast(builder, valid_v, valid_t, types.boolean)
            size = builder.select(valid_i1, ir.Constant(i32, 16), ir.Constant(i32, 0))
            fnty = ir.FunctionType(ir.VoidType(), [i32, src_ptr.type, i32])
            asm = "cp.async.cg.shared.global [$0], [$1], 16, $2;"
            builder.call(ir.InlineAsm(fnty, asm, "r,l,r,~{memory}", side_effect=True), [dst_addr, src_ptr, size])
            return context.get_dummy_value()
        return sig, codegen

    def _shared_load_intrinsic(name: str, dtypes: tuple, volatile: bool):
        """Intrinsic `(smem, i) -> smem[i]` for 1-d shared arrays of `dtypes` at a 32-bit address, as one
        `ld.shared` (`ld.volatile.shared` with a memory clobber when volatile: never fused with a neighbour)."""
        @intrinsic
        def impl(typingctx, smem, i):
            _require_indexed(name, smem, dtypes, i, "shared ")
            sig = smem.dtype(smem, i)

            def codegen(context, builder, sig, args):
                smem_t, i_t = sig.args
                addr = _shared_address(context, builder, smem_t, args[0], i_t, args[1])
                bits = 64 if smem_t.dtype == types.uint64 else 32
                fnty = ir.FunctionType(ir.IntType(bits), [ir.IntType(32)])
                reg = "l" if bits == 64 else "r"
                op, clobber = ("ld.volatile.shared", ",~{memory}") if volatile else ("ld.shared", "")
                asm = ir.InlineAsm(fnty, f"{op}.b{bits} $0, [$1];", f"={reg},r{clobber}", side_effect=True)
                return builder.call(asm, [addr])
            return sig, codegen
        return impl

    lds32 = _shared_load_intrinsic("lds32", (types.uint32,), volatile=True)
    ld_shared = _shared_load_intrinsic("ld_shared", (types.uint32, types.uint64), volatile=False)

    @intrinsic
    def st_v4(typingctx, array, index, x0, x1, x2, x3):
        """a[i .. i+3] = x0 .. x3 in one `st.global.v4.f32` (module docstring)."""
        _require_indexed("st_v4", array, (types.float32,), index)
        sig = types.void(array, index, types.float32, types.float32, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.VoidType(), [f32.as_pointer(), f32, f32, f32, f32])
            asm = ir.InlineAsm(fnty, "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f,~{memory}",
                               side_effect=True)
            builder.call(asm, [ptr, *args[2:]])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def ld_shared_v4(typingctx, smem, i):
        """(smem[i], .., smem[i + 3]) in one `ld.shared.v4.b32` (module docstring)."""
        _require_indexed("ld_shared_v4", smem, (types.uint32,), i, "shared ")
        sig = types.UniTuple(types.uint32, 4)(smem, i)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
            asm = ir.InlineAsm(fnty, "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                               side_effect=True)
            res = builder.call(asm, [addr])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, j) for j in range(4)])
        return sig, codegen

    @intrinsic
    def st_shared_v4(typingctx, smem, i, x0, x1, x2, x3):
        """smem[i .. i + 3] = x0 .. x3 in one `st.shared.v4.b32` (module docstring)."""
        _require_indexed("st_shared_v4", smem, (types.uint32,), i, "shared ")
        sig = types.void(smem, i, types.uint32, types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            fnty = ir.FunctionType(ir.VoidType(), [i32] * 5)
            asm = ir.InlineAsm(fnty, "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}",
                               side_effect=True)
            builder.call(asm, [addr, *args[2:]])
            return context.get_dummy_value()
        return sig, codegen

    def _statement(asm: str, doc: str):
        """Intrinsic `() -> None` emitting one PTX statement without operands (a memory barrier to LLVM)."""
        @intrinsic
        def impl(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, asm, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return sig, codegen
        impl.__doc__ = doc
        return impl

    cp_async_commit = _statement("cp.async.commit_group;", "Close this thread's group of cp.async copies.")
    griddep_launch_dependents = _statement("griddepcontrol.launch_dependents;",
                                           "Let a programmatic dependent's blocks launch (module docstring).")
    griddep_wait = _statement("griddepcontrol.wait;", "Wait for the programmatic predecessor (module docstring).")

    @functools.cache
    def cp_async_wait_fn(pending: int):
        """Device function: wait until at most `pending` of this thread's cp.async groups are in flight."""
        return _statement(f"cp.async.wait_group {int(pending)};", cp_async_wait_fn.__doc__ or "")  # None only under -OO


    @intrinsic
    def prefetch_l2_bulk(typingctx, array, index, nbytes):
        """Start an L2 prefetch of nbytes from array[index] (module docstring)."""
        _require_indexed("an L2 prefetch", array, (types.uint8, types.uint32), index)
        if not isinstance(nbytes, types.Integer):
            raise NumbaTypeError(f"an L2 prefetch needs an integer byte count, got {nbytes}")
        sig = types.void(array, index, nbytes)

        def codegen(context, builder, sig, args):
            array_t, index_t, size_t = sig.args
            ptr = _item_pointer(context, builder, array_t, args[0], index_t, args[1])
            size = context.cast(builder, args[2], size_t, types.uint32)
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, ir.IntType(32)])
            asm = "cp.async.bulk.prefetch.L2.global [$0], $1;"
            builder.call(ir.InlineAsm(fnty, asm, "l,r,~{memory}", side_effect=True), [ptr, size])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def dp4a(typingctx, a, b, c):
        """c + the dot product of the signed bytes of words a and b (module docstring)."""
        if not all(isinstance(v, types.Integer) for v in (a, b, c)):
            raise NumbaTypeError(f"dp4a needs three integers (two words and an int32 sum), got {a}, {b}, {c}")
        sig = types.int32(a, b, c)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            # the low 32 bits of each operand (Numba widens 32-bit integer arithmetic to 64 bits)
            words = [context.cast(builder, v, t, d) for v, t, d in zip(args, sig.args, (types.uint32,) * 2 + (types.int32,))]
            fnty = ir.FunctionType(i32, [i32, i32, i32])
            return builder.call(ir.InlineAsm(fnty, "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r"), words)
        return sig, codegen

    @functools.cache
    def prmt_fn(selector: int):
        """Device function `prmt(a, b) -> uint32`: `prmt.b32` with this constant selector (module docstring)."""
        if not 0 <= selector <= 0x7777 or any((selector >> (4 * k)) & 8 for k in range(4)):
            raise ValueError(f"prmt selector {selector:#x}: four nibbles 0-7 (sign-replicating modes not supported)")

        @intrinsic
        def prmt(typingctx, a, b):
            if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
                raise NumbaTypeError(f"prmt needs two integer words, got {a}, {b}")
            sig = types.uint32(a, b)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                # Numba widens uint32 arithmetic to 64 bits: the low 32 bits are the word
                words = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
                fnty = ir.FunctionType(i32, [i32, i32])
                asm = ir.InlineAsm(fnty, f"prmt.b32 $0, $1, $2, {int(selector):#x};", "=r,r,r")
                return builder.call(asm, words)
            return sig, codegen
        return prmt
