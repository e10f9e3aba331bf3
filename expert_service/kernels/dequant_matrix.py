"""Widen one 8-bit dense matrix (int8 or fp8 e4m3 codes with one float32 scale per output row: linear_q8's block
and meta row) into a dense matrix for cuBLAS: out[r, c] = q[r, c] * scale[r], rounded to nearest in the dense
dtype (bf16 / f16 / f32), as dequant_experts widens an expert for the per-expert GEMMs. Reference:
``dequant_matrix_reference``.

Past a few dozen rows the 8-bit attention projections read their matrices many times (once per tile of rows),
and the tensor-core kernels that widen codes in shared memory run such dense shapes at a fraction of cuBLAS's
speed: widening the matrix once into a scratch and handing it to cuBLAS costs one pass of 1 byte read + 2 written
a weight. Each thread widens one 16-value chunk (a 16-byte streaming load) and writes it as four 8-byte words of
bf16 / f16 (float32 scratch: 16 stores); a block covers THREADS chunks of one row. No host reads, no allocation:
graph-capturable.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types
from numba.np import numpy_support

from expert_service.kernels import expert_quant
from expert_service.kernels.dequant_experts import DENSE_DTYPES, VALUES, chunk_storer, widen_chunk
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.linear_q8 import CODES
from expert_service.kernels.numeric import SIMULATOR, check_array

THREADS = 8 if SIMULATOR else 128  # the simulator pays per thread; short test rows need few


@functools.cache
def _kernel(dtype):
    store_chunk = chunk_storer(dtype)

    def kernel(words, scales, meta, n_in, chunks, out, out64):
        """words / scales: the block as flat uint32 / float32; meta [1, META_WIDTH] int32 (linear_q8.matrix_meta:
        code, codes' byte offset in [0, 4], scales' in [0, 7]); n_in: values a row; chunks: blocks a row;
        out [n_out * n_in] dense dtype, flat, and out64 the same bytes as uint64 (16-bit dtypes: four values a
        store). Grid n_out * chunks blocks of THREADS threads."""
        b = cuda.blockIdx.x
        r = b // chunks  # one division a block: which row and which part of it
        c = ((b - r * chunks) * cuda.blockDim.x + cuda.threadIdx.x) * VALUES
        if c >= n_in:
            return
        code = meta[0, 0]
        factor = scales[meta[0, 7] // 4 + r]
        v = cuda.local.array(VALUES, np.float32)
        widen_chunk(words, (meta[0, 4] + r * n_in + c) // 4, code, v)
        store_chunk(v, factor, out, out64, r * n_in + c)  # a multiple of 16

    return kernel, cached_jit(kernel)


class MatrixWidening:
    """One matrix's widening into one output, checked and with its device-array views made once: an eager step
    launches it again at the cost of the launch alone (each view costs tens of µs of host time, and a widened
    step widens q, k, v and o of every layer).

    block uint8 [nbytes] (16-byte aligned, nbytes % 4 == 0) holding the matrix [n_out, n_in] of `code` (int8 / fp8
    e4m3) from byte meta[0, 4] and its n_out float32 scales from byte meta[0, 7]; meta [1, META_WIDTH] int32 on the
    device (linear_q8.matrix_meta); out [n_out, n_in] uint16 (bf16) / float16 / float32, every element written."""

    def __init__(self, block, meta, code: int, n_out: int, n_in: int, out):
        check_array("meta", meta, (1, expert_quant.META_WIDTH), np.int32)
        if code not in CODES:
            raise ValueError(f"expert_quant code {code}: an 8-bit matrix is int8 or fp8 e4m3")
        if n_in <= 0 or n_in % VALUES or n_out <= 0:
            raise ValueError(f"an 8-bit matrix [{n_out}, {n_in}] needs rows of a positive multiple of {VALUES} values")
        if block.ndim != 1 or np.dtype(block.dtype) != np.uint8 or block.size % 4:
            raise ValueError(f"block must be uint8 [n] with n % 4 == 0, got {block.dtype} {list(block.shape)}")
        if out.shape != (n_out, n_in) or np.dtype(out.dtype) not in [np.dtype(d) for d in DENSE_DTYPES]:
            raise ValueError(
                f"out must be [{n_out}, {n_in}] bfloat16/float16/float32, got {out.dtype} {list(out.shape)}"
            )
        chunks = -(-n_in // (VALUES * THREADS))
        flat = out.reshape(out.size)
        out64 = flat.view(np.uint64)  # read by the 16-bit dtypes only (whole 16-value rows: always 8-byte multiples)
        self._kernel = _kernel(np.dtype(out.dtype).type)[1]
        self._blocks = n_out * chunks
        self._args = (block.view(np.uint32), block.view(np.float32), meta, n_in, chunks, flat, out64)

    def launch(self, stream=0) -> None:
        self._kernel[self._blocks, THREADS, stream](*self._args)


def launch_dequant_matrix(block, meta, code: int, n_out: int, n_in: int, out, stream=0) -> None:
    """One widening (MatrixWidening's arguments), checked and launched."""
    MatrixWidening(block, meta, code, n_out, n_in, out).launch(stream)


def dequant_matrix_reference(q: np.ndarray, scale: np.ndarray, code: int) -> np.ndarray:
    """float32 q * scale[:, None] with q's codes [n_out, n_in] decoded exactly (expert_quant.decode)."""
    w = expert_quant.decode(np.ascontiguousarray(q).view(np.uint8), code).reshape(q.shape).astype(np.float32)
    return w * scale.astype(np.float32)[:, None]


def sm90_signatures():
    """(python function, numba signature) per dense dtype, for the sm_90 compile check."""
    i64 = types.int64
    return [
        (
            _kernel(dt)[0],
            (
                types.uint32[::1],
                types.float32[::1],
                types.int32[:, ::1],
                i64,
                i64,
                numpy_support.from_dtype(np.dtype(dt))[::1],
                types.uint64[::1],
            ),
        )
        for dt in DENSE_DTYPES
    ]
