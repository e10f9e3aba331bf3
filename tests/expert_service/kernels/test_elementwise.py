"""Elementwise kernels (silu_mul, shared-expert sigmoid gate, clamp, bias add, 16-bit casts) vs numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.moe import silu
from expert_service.kernels import elementwise
from expert_service.kernels.elementwise import (
    launch_add_bias,
    launch_cast,
    launch_clamp,
    launch_sigmoid_gate_add,
    launch_silu_mul,
    launch_silu_mul_halves,
)
from tests.helpers import (
    STORAGE_DTYPES,
    assert_close,
    awkward_floats,
    bf16_bits,
    from_storage,
    nan_device,
    random_weight,
    to_storage,
)


def _check_all(rng, rows, cols, threads):
    g = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(4.0)
    u = rng.standard_normal((rows, cols), dtype=np.float32)
    h = nan_device((rows, cols))
    launch_silu_mul(cuda.to_device(g), cuda.to_device(u), h, threads=threads)
    assert_close(h.copy_to_host(), silu(g) * u, 1e-5)

    base = rng.standard_normal((rows, cols), dtype=np.float32)
    shared = rng.standard_normal((rows, cols), dtype=np.float32)
    gate = rng.standard_normal((rows, 1), dtype=np.float32) * np.float32(3.0)
    d_out = cuda.to_device(base)
    launch_sigmoid_gate_add(d_out, cuda.to_device(shared), cuda.to_device(gate), threads=threads)
    assert_close(d_out.copy_to_host(), base + shared / (np.float32(1.0) + np.exp(-gate)), 1e-5)

    x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(10.0)
    x.flat[0] = np.nan
    d_x = cuda.to_device(x)
    launch_clamp(d_x, 8.0, threads=threads)
    np.testing.assert_array_equal(d_x.copy_to_host(), np.clip(x, -8.0, 8.0))

    for dtype in STORAGE_DTYPES:
        b, bf = random_weight(rng, (cols,), dtype)
        d_y = cuda.to_device(base)
        launch_add_bias(d_y, cuda.to_device(b), threads=threads)
        assert_close(d_y.copy_to_host(), base + bf, 1e-6)

    for dtype in (np.float16, np.uint16):
        out = cuda.to_device(np.full((rows, cols), 0x7E01 if dtype is np.uint16 else np.nan, dtype=dtype))
        launch_cast(cuda.to_device(x), out, threads=threads)
        # values compared (NaN payloads differ between numpy and the GPU's cvt), NaN positions must match
        np.testing.assert_array_equal(from_storage(out.copy_to_host()), from_storage(to_storage(x, dtype)))


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("f32_input", [False, True])
@pytest.mark.parametrize("rows,F,threads", [(1, 5, 32), (3, 37, 32), (70, 9, 32), (2, 300, 64), (5, 64, 32)])
def test_silu_mul_halves_matches_reference(dtype, f32_input, rows, F, threads):
    """h = silu(gate) * up over rows holding [gate | up] (in h's dtype, or float32 as per-expert cuBLAS writes
    them for fp16 / fp32 weights), in float32 from the stored values, rounded once to h's dtype (within one
    rounding step of the float32 reference); every element of h written."""
    rng = np.random.default_rng(rows * 1000 + F)
    gu, values = random_weight(rng, (rows, 2 * F), np.float32 if f32_input else dtype, scale=4.0)
    h = cuda.to_device(np.full((rows, F), 0xFFFF if dtype is np.uint16 else np.nan, dtype=dtype))
    launch_silu_mul_halves(cuda.to_device(gu), h, threads=threads)
    want = silu(values[:, :F]) * values[:, F:]
    step = {np.float32: 1e-5, np.float16: 2.0**-10, np.uint16: 2.0**-7}[dtype]
    got = from_storage(h.copy_to_host())
    assert np.isfinite(got).all()
    assert np.all(np.abs(got - want) <= step * np.maximum(np.abs(want), 1e-3) + 1e-6)
    if dtype is np.uint16 and not f32_input and F % 4 == 0:  # the 8-byte word path: the element path's bits
        one = cuda.to_device(np.full((rows, F), 0xFFFF, np.uint16))
        elementwise._build_silu_mul_halves(np.dtype(np.uint16), np.dtype(np.uint16))[1][(1, rows), threads](
            cuda.to_device(gu).reshape(-1), one.reshape(-1), np.int32(F), np.int32(0), np.int32(rows)
        )
        np.testing.assert_array_equal(h.copy_to_host(), one.copy_to_host())


@pytest.mark.parametrize("dtype,f32_input,F", [(np.uint16, False, 8), (np.uint16, False, 6), (np.float16, True, 5)])
def test_silu_mul_halves_on_row_ranges_equals_the_sliced_launch(dtype, f32_input, F):
    """SiluMulHalves, made once on whole buffers, computes rows [r0, r1) of each call bit for bit as a launch on
    those rows' slices, and leaves every other row as it was (one launcher serves every group of every step)."""
    rng = np.random.default_rng(F + 7)
    N = 11
    gu, _ = random_weight(rng, (N, 2 * F), np.float32 if f32_input else dtype, scale=4.0)
    fill = 0xFFFF if dtype is np.uint16 else np.nan
    d_gu = cuda.to_device(gu)
    h = cuda.to_device(np.full((N, F), fill, dtype=dtype))
    launcher = elementwise.SiluMulHalves(d_gu, h, threads=32)
    for r0, r1 in ((0, N), (0, 4), (3, 9), (10, 11)):
        want = cuda.to_device(np.full((r1 - r0, F), fill, dtype=dtype))
        launch_silu_mul_halves(d_gu[r0:r1], want, threads=32)
        h.copy_to_device(np.full((N, F), fill, dtype=dtype))
        launcher(r0, r1)
        got = h.copy_to_host()
        np.testing.assert_array_equal(got[r0:r1], want.copy_to_host())
        untouched = np.r_[0:r0, r1:N]
        np.testing.assert_array_equal(got[untouched], np.full((untouched.size, F), fill, dtype=dtype))
    for r0, r1 in ((0, N + 1), (4, 4), (-1, 2)):
        with pytest.raises(AssertionError):
            launcher(r0, r1)


@pytest.mark.parametrize("dtype,F", [(np.uint16, 8), (np.uint16, 6), (np.float32, 5)])
def test_silu_mul_halves_strides_over_rows_past_the_grid(monkeypatch, dtype, F):
    """More rows than a grid's y extent (65535 on the GPU; 3 here): blocks stride over the rest, every row
    written (a step of 8192 tokens x top-8 has 65536 assignment rows)."""
    monkeypatch.setattr(elementwise, "MAX_GRID_ROWS", 3)
    rng = np.random.default_rng(F)
    gu, values = random_weight(rng, (10, 2 * F), dtype, scale=4.0)
    h = cuda.to_device(np.full((10, F), 0xFFFF if dtype is np.uint16 else np.nan, dtype=dtype))
    launch_silu_mul_halves(cuda.to_device(gu), h, threads=32)
    got = from_storage(h.copy_to_host())
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, silu(values[:, :F]) * values[:, F:], rtol=2.0**-7, atol=1e-6)


@pytest.mark.parametrize("rows,cols", [(1, 5), (3, 37)])
def test_elementwise_matches_reference(rows, cols):
    _check_all(np.random.default_rng(cols), rows, cols, threads=32)


class _WordCount:
    """Wraps the cast kernel: records how many 4-element words each launch was given (0: all scalar)."""

    def __init__(self, kernel, words):
        self.kernel, self.words = kernel, words

    def __getitem__(self, config):
        def launch(*args):
            self.words.append(args[3].shape[0])
            self.kernel[config](*args)

        return launch


# sizes around whole words (1, 3, 4, 5; 35 = 8 words + 3; 1032 = more words than one block's threads);
# offset 1 starts x one float past an 8-byte boundary: the whole array takes the scalar path
@pytest.mark.parametrize("dtype", [np.uint16, np.float16])
@pytest.mark.parametrize(
    "shape,offset", [((1,), 0), ((3,), 0), ((4,), 0), ((5,), 0), ((7, 5), 0), ((2, 516), 0), ((1032,), 1), ((3, 37), 1)]
)
def test_cast_words_and_tail(dtype, shape, offset, monkeypatch):
    import expert_service.kernels.elementwise as elementwise

    rng = np.random.default_rng(int(np.prod(shape)) + offset)
    x = awkward_floats(rng, shape)
    d_x = cuda.to_device(np.r_[np.full(offset, 1.5, np.float32), x.reshape(-1)])[offset:].reshape(shape)
    sentinel = 0x7E01 if dtype is np.uint16 else 0x7C01  # a NaN no rounding produces
    out = cuda.to_device(np.full(shape, sentinel, np.uint16).view(dtype))
    words, build = [], elementwise._build_cast
    monkeypatch.setattr(elementwise, "_build_cast", lambda dt: (build(dt)[0], _WordCount(build(dt)[1], words)))
    launch_cast(d_x, out, threads=32)
    assert words == [0 if offset else x.size // 4]
    got = out.copy_to_host().view(np.uint16)
    if dtype is np.uint16:
        np.testing.assert_array_equal(got, bf16_bits(x))
    else:  # the GPU's cvt gives its own NaN payload: NaN where numpy has one, numpy's bits elsewhere
        with np.errstate(over="ignore"):
            want = x.astype(np.float16).view(np.uint16)
        nan = np.isnan(x)
        assert np.isnan(got.view(np.float16)[nan]).all() and (got[nan] != sentinel).all()
        np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 33, 512])
def test_elementwise_gpu(rows):
    rng = np.random.default_rng(rows)
    for cols in (14336, 2048, 1001):
        _check_all(rng, rows, cols, threads=256)
