"""DeviceAttention8Bit (a layer's 8-bit q|k|v and o) in the simulator, with a host stand-in for cuBLAS: steps from
the widening threshold run each projection widened (q|k|v as three launches even at one token, where the fused launch
would need the stacked rows in the scratch), smaller ones the 8-bit kernels; o adds into the residual either way;
thresholds the engine was not laid out for are refused in one line."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from bench.attention_8bit import eight_bit_layer, random_layer
from common.dtypes import bf16_to_float32
from expert_service.cuda.attention_8bit import DeviceAttention8Bit, widens
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels import expert_quant as q
from tests.expert_service.cuda.test_linear_8bit import HostCublas, bf16

D, Q, KV = 64, 64, 32


def attention(dense_rows: int, max_rows: int = 8, seed: int = 0):
    """(DeviceAttention8Bit widening from dense_rows, its HostCublas, the dequantised qkv [Q+2KV, D] and o [D, Q])."""
    from expert_service.cuda.linear import DeviceLinear

    stream = cuda.default_stream()
    qkv_w, o_w, qkv8, o8 = random_layer(np.random.default_rng(seed), q.CODE_INT8, D, Q, KV)
    layer = eight_bit_layer(qkv8, o8, q.CODE_INT8, D, Q, KV, stream)
    blas = HostCublas()
    workspace = SimpleNamespace(cast=cuda.device_array(max_rows * max(D, Q), np.uint16))
    linear = DeviceLinear(stream, blas, workspace, np.dtype(np.uint16))
    weights = SimpleNamespace(layer=lambda i, name: None, dtype=np.dtype(np.uint16))
    att = DeviceAttention8Bit((layer,), weights, max_rows, stream, linear, dense_rows)
    att.use_options(CudaOptions(attention_8bit_dense_rows=dense_rows))
    return att, blas, bf16_to_float32(qkv_w).astype(np.float64), bf16_to_float32(o_w).astype(np.float64)


def run_layer(att, x, a, h0):
    """q|k|v of x and h0 + a @ o^T as the engine runs them at T = len(x) (the stacked row at one token)."""
    T = x.shape[0]
    flat = cuda.to_device(np.full(T * (Q + 2 * KV), np.nan, np.float32))
    views = (
        flat[: T * Q].reshape(T, Q),
        flat[T * Q : T * (Q + KV)].reshape(T, KV),
        flat[T * (Q + KV) :].reshape(T, KV),
    )
    stacked = flat.reshape(1, Q + 2 * KV) if T == 1 else None
    h = cuda.to_device(h0)
    att.start_pass(T)
    att.qkv(0, cuda.to_device(x), *views, stacked, fused=True)
    att.o(0, cuda.to_device(a), h)
    q_, k_, v_ = (view.copy_to_host() for view in views)
    return np.concatenate([q_, k_, v_], axis=1), h.copy_to_host()


@pytest.mark.parametrize("T", [1, 3, 6])
def test_widened_steps_from_the_threshold_on(T):
    """Threshold 1: every step widened (one token too, three launches): bf16 rows times the widened weights;
    threshold 0: the 8-bit kernels, and no cuBLAS call."""
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, D)).astype(np.float32)
    a = rng.standard_normal((T, Q)).astype(np.float32)
    h0 = rng.standard_normal((T, D)).astype(np.float32)
    widened, blas, qkv_w, o_w = attention(1)
    qkv, h = run_layer(widened, x, a, h0)
    assert widened.rows.on_dense and blas.calls == 4  # q, k, v, o
    want_qkv = bf16(x).astype(np.float64) @ qkv_w.T
    want_h = h0 + bf16(a).astype(np.float64) @ o_w.T
    np.testing.assert_allclose(qkv, want_qkv, rtol=1e-5, atol=1e-5 * np.abs(want_qkv).max())
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
    kernels, blas8, _, _ = attention(0)
    qkv8, h8 = run_layer(kernels, x, a, h0)
    assert not kernels.rows.on_dense and blas8.calls == 0 and kernels.rows.widened is None
    # the same weights (bf16 of the dequantised values), rows rounded or not: within bf16's reach of each other
    np.testing.assert_allclose(qkv8, qkv, rtol=0, atol=2e-2 * np.abs(qkv).max())
    np.testing.assert_allclose(h8, h, rtol=0, atol=2e-2 * np.abs(h).max())


def test_the_path_is_the_one_set_rows_chose():
    """A threshold changed between set_rows and the launches applies from the next pass: the pass keeps its path."""
    att, blas, _, _ = attention(4)
    att.start_pass(6)
    assert att.rows.on_dense
    att.rows.use_dense_rows(0)
    assert att.rows.on_dense  # until the next set_rows
    att.start_pass(6)
    assert not att.rows.on_dense and att.rows.on_mma


def test_thresholds_without_a_scratch_are_refused_in_one_line():
    att, _, _, _ = attention(0, max_rows=8)
    assert not widens(0, 8) and widens(8, 8) and not widens(9, 8)
    att.use_options(CudaOptions(attention_8bit_dense_rows=9))  # past every step: nothing widens, accepted
    with pytest.raises(ValueError) as error:
        att.use_options(CudaOptions(attention_8bit_dense_rows=8))
    assert str(error.value) == (
        "cuda_options: attention_8bit_dense_rows 8 needs the widening scratch the engine was not laid out with; "
        "give it to the engine's config instead"
    )
    laid_out, _, _, _ = attention(4)
    assert laid_out.refusal(dataclasses.replace(CudaOptions(), attention_8bit_dense_rows=2)) is None
