"""The shared-memory load, vector store and dp4a intrinsics of kernels.ptx against numpy: a kernel stages random words in
shared memory, reads them back through `ld_shared` at a permuted index (uint32 and uint64 arrays) and writes float
rows through `st_v4`; 16-byte groups go through shared memory by `st_shared_v4` and come back by `ld_shared_v4`
at permuted group indices; `dp4a` sums the signed byte products of random words. The same test runs in the simulator (the plain-array fallbacks) and on the GPU (the PTX)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, types

from expert_service.kernels.ptx import dp4a, ld_shared, ld_shared_v4, st_shared_v4, st_v4

N = 64  # threads = shared words = float rows of 4
GROUP_WORDS = 4 * N  # a shared array's size must be a constant the CUDA target sees: an expression is typed int64


@cuda.jit
def _shared_roundtrip(words32, words64, perm, out32, out64):
    s32 = cuda.shared.array(N, types.uint32)
    s64 = cuda.shared.array(N, types.uint64)
    i = cuda.threadIdx.x
    s32[i] = words32[i]
    s64[i] = words64[i]
    cuda.syncthreads()
    out32[i] = ld_shared(s32, perm[i])
    out64[i] = ld_shared(s64, perm[i])


@cuda.jit
def _store_rows(values, out):
    i = cuda.threadIdx.x
    st_v4(out, 4 * i, values[i, 0], values[i, 1], values[i, 2], values[i, 3])


@cuda.jit
def _shared_v4_roundtrip(words, perm, out):
    """Thread i stores words[4i .. 4i+3] at shared group i with one st_shared_v4, then reads group perm[i] back with
    one ld_shared_v4 into out[4i .. 4i+3]."""
    smem = cuda.shared.array(GROUP_WORDS, types.uint32)
    i = cuda.threadIdx.x
    st_shared_v4(smem, 4 * i, words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3])
    cuda.syncthreads()
    a, b, c, d = ld_shared_v4(smem, 4 * perm[i])
    out[4 * i] = a
    out[4 * i + 1] = b
    out[4 * i + 2] = c
    out[4 * i + 3] = d


@cuda.jit
def _dot4(a, b, c, out):
    i = cuda.threadIdx.x
    out[i] = dp4a(a[i], b[i], c[i])


WHERE = ["here", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("where", WHERE)
def test_dp4a_sums_signed_byte_products(where):
    rng = np.random.default_rng(4)
    a = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    a[0], b[0] = 0x80808080, 0x80808080  # -128 * -128 four times: the largest sum
    c = rng.integers(-(2**30), 2**30, N).astype(np.int32)
    out = cuda.to_device(np.zeros(N, np.int32))
    _dot4[1, N](a, b, c, out)
    want = (a.view(np.int8).reshape(N, 4).astype(np.int64) * b.view(np.int8).reshape(N, 4)).sum(axis=1) + c
    np.testing.assert_array_equal(out.copy_to_host(), want.astype(np.int32))


@pytest.mark.parametrize("where", WHERE)
def test_ld_shared_reads_the_element_it_is_given(where):
    rng = np.random.default_rng(1)
    words32 = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    words64 = rng.integers(0, 2**63, N, dtype=np.int64).astype(np.uint64) | np.uint64(1 << 63)
    perm = rng.permutation(N).astype(np.int32)
    out32 = cuda.to_device(np.zeros(N, np.uint32))
    out64 = cuda.to_device(np.zeros(N, np.uint64))
    _shared_roundtrip[1, N](words32, words64, perm, out32, out64)
    np.testing.assert_array_equal(out32.copy_to_host(), words32[perm])
    np.testing.assert_array_equal(out64.copy_to_host(), words64[perm])


@pytest.mark.parametrize("where", WHERE)
def test_st_v4_writes_four_consecutive_floats(where):
    values = np.random.default_rng(2).standard_normal((N, 4), dtype=np.float32)
    out = cuda.to_device(np.full(4 * N + 4, np.nan, np.float32))  # one row past the end stays untouched
    _store_rows[1, N](values, out)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[: 4 * N], values.reshape(-1))
    assert np.isnan(got[4 * N :]).all()


@pytest.mark.parametrize("where", WHERE)
def test_shared_v4_stores_and_loads_sixteen_byte_groups(where):
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2**32, 4 * N, dtype=np.uint64).astype(np.uint32)
    perm = rng.permutation(N).astype(np.int32)
    out = cuda.to_device(np.zeros(4 * N, np.uint32))
    _shared_v4_roundtrip[1, N](words, perm, out)
    np.testing.assert_array_equal(out.copy_to_host().reshape(N, 4), words.reshape(N, 4)[perm])
