"""Inline-PTX Hopper warpgroup MMA (sm_90a) for Numba CUDA kernels: `wgmma.mma_async` bf16 -> fp32 with both
operands in shared memory, and the fences and group waits around it.

Numba compiles for `compute_90a` on an sm_90 device (numba-cuda picks the arch-specific target from 9.0 on), so
these instructions assemble there; for a PTX check without a GPU pass ``cc=(9, 0, "a")`` to ``compile_ptx``.
A warpgroup is four consecutive warps starting at a warp index divisible by four; all 128 threads issue each
instruction together (`.sync.aligned`).

- ``wgmma_bf16_fn(n)``: device function ``mma(acc, base, desc_a, desc_b, accumulate)`` issuing
  `wgmma.mma_async.sync.aligned.m64n<n>k16.f32.bf16.bf16`: D[64 x n] (+)= A[64 x 16] @ B[n x 16]^T, both K-major
  (rows of 16 bf16 along K), fp32 accumulators acc[base .. base + n/2) of this thread (a C-contiguous local
  float32 array of any shape, taken flat; indexed by constants only so it stays in registers). accumulate == 0 ignores the old acc (D = A B).
  Fragment of thread i of the warpgroup (w = i // 32 its warp, l = i % 32): acc[base + 4j + 2h + c] holds
  D[16w + l // 4 + 8h, 8j + 2 (l % 4) + c] for j < n / 8, h, c in {0, 1} (PTX ISA, "wgmma D fragments").
- ``wgmma_q8_fn(n, kind)``: the same for 8-bit operands, `m64n<n>k32`: kind "e4m3" (fp32 accumulators) or "s8"
  (int32 accumulators, a C-contiguous local int32 array). A k32 step covers the same 32 bytes of a K-major row as
  a bf16 k16 step, so the descriptors below serve both; 8-bit operands must be K-major (PTX allows no transpose).
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
The simulator cannot run any of this: kernels using it are GPU-only (under it the names exist and raise).
"""
from __future__ import annotations

from expert_service.kernels.numeric import SIMULATOR

if SIMULATOR:  # the simulator cannot run inline PTX: the names exist (modules import), calling one fails
    def _unavailable(*args):
        raise NotImplementedError("wgmma does not run in the CUDA simulator")

    wgmma_fence = wgmma_commit = fence_proxy_async = smem_desc = smem_desc_sw128 = _unavailable

    def wgmma_wait_fn(pending: int):
        return _unavailable

    def wgmma_bf16_fn(n: int):
        return _unavailable

    def wgmma_q8_fn(n: int, kind: str):
        return _unavailable
else:
    from expert_service.kernels._wgmma_ptx import (  # noqa: F401  (re-exported)
        fence_proxy_async,
        smem_desc,
        smem_desc_sw128,
        wgmma_bf16_fn,
        wgmma_commit,
        wgmma_fence,
        wgmma_q8_fn,
        wgmma_wait_fn,
    )
