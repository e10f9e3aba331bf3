"""bench/attention_8bit.py without a GPU: its arguments refused in one line, and the 8-bit layer it times read through
the engine's meta rows gives the weights its bf16 side multiplies (the comparison the bench prints)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from bench.attention_8bit import SHAPES, eight_bit_layer, main, random_layer
from expert_service.kernels import expert_quant as q


@pytest.mark.parametrize("argv", [["--shapes", "nope"], ["--dtypes", "int4"], ["--q8-shapes", "a=1/2"]])
def test_bad_arguments_are_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_each_projection_read_through_its_meta_row_is_the_bf16_sides_weight(dtype):
    D, Q, KV = SHAPES["tiny"]
    code = q.CODES[dtype]
    qkv_bf16, o_bf16, qkv8, o8 = random_layer(np.random.default_rng(0), code, D, Q, KV)
    layer = eight_bit_layer(qkv8, o8, code, D, Q, KV, cuda.default_stream())
    rows = {"q": (0, Q), "k": (Q, Q + KV), "v": (Q + KV, Q + 2 * KV), "qkv": (0, Q + 2 * KV)}
    for name, (lo, hi) in rows.items():
        m = getattr(layer, name)
        block, meta = m.block.copy_to_host(), m.meta.copy_to_host()[0]
        codes = q.decode(block[meta[4] : meta[4] + m.n_out * m.n_in], code).reshape(m.n_out, m.n_in)
        scales = block[meta[7] : meta[7] + 4 * m.n_out].view(np.float32)
        weights = (codes.astype(np.float32) * scales[:, None]).astype(ml_dtypes.bfloat16).view(np.uint16)
        np.testing.assert_array_equal(weights, qkv_bf16[lo:hi], err_msg=name)
    o = layer.o
    block, meta = o.block.copy_to_host(), o.meta.copy_to_host()[0]
    codes = q.decode(block[meta[4] : meta[4] + D * Q], code).reshape(D, Q)
    scales = block[meta[7] : meta[7] + 4 * D].view(np.float32)
    weights = (codes.astype(np.float32) * scales[:, None]).astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(weights, o_bf16)


def test_variants_time_the_widened_path_everywhere_and_the_8bit_gemm_where_the_engine_widens():
    from types import SimpleNamespace

    from bench.attention_8bit import variants
    from expert_service.cuda.attention_8bit import DeviceAttention8Bit
    from expert_service.cuda.linear_8bit import MMA_MIN_ROWS
    from expert_service.engine.cuda_options import CudaOptions

    D, Q, KV = SHAPES["tiny"]
    code, stream = q.CODE_INT8, cuda.default_stream()
    _, _, qkv8, o8 = random_layer(np.random.default_rng(1), code, D, Q, KV)
    layer = eight_bit_layer(qkv8, o8, code, D, Q, KV, stream)
    weights = SimpleNamespace(layer=lambda i, name: None, dtype=np.dtype(np.uint16))
    linear = SimpleNamespace(weights_dtype=np.dtype(np.uint16))  # what the variants' rows hold, never called here
    eight = DeviceAttention8Bit((layer,), weights, 64, stream, linear, dense_rows=16)
    eight.use_options(CudaOptions(attention_8bit_dense_rows=16))
    small, large = variants(eight, 2, max(D, Q), {}, stream), variants(eight, 16, max(D, Q), {}, stream)
    assert set(small) == {"", "-widened", "-meta-read"} and small[""] is eight
    assert not small["-meta-read"].rows.layout_at_launch
    assert set(large) == {"", "-widened", "-gemm", "-whole", "-stream"}
    assert large["-widened"].rows.dense_at(1) and not large["-gemm"].rows.dense_at(16) and eight.rows.dense_at(16)
    assert not eight.rows.dense_at(MMA_MIN_ROWS)
    without = DeviceAttention8Bit((layer,), weights, 64, stream, dense_rows=32)  # no cuBLAS (the simulator's run)
    without.use_options(CudaOptions())
    assert set(variants(without, 2, max(D, Q), {}, stream)) == {"", "-meta-read"}
