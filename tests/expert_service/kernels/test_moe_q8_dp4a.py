"""The int8-activation decode kernels (moe_q8_dp4a) against their numpy reference, in the simulator and on the GPU:
random int8 per-channel experts, one token routed to K of them, outputs starting as NaN. Checks: the codes at
exact ties and a hair from them (one rounding of the exact product), h against the float64 SwiGLU of the quantized
token and the dequantised weights, each block's maximum against the kernel's own h (exactly), y from the kernel's own h quantized as the reference quantizes it (isolating the down launch), the whole
against the exact float32-activation expert (the int8 rounding's size), a NaN or infinite token giving NaN outputs, an expert
of another encoding left untouched, and the refusals."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels import expert_quant as q
from expert_service.kernels.moe_q8_dp4a import (
    dp4a_reference,
    gate_up_parts,
    launch_dp4a_down,
    launch_dp4a_gate_up,
    magnitude,
    quantize4,
    quantize_row_reference,
    row_scale,
)
from expert_service.kernels.numeric import SIMULATOR
from tests.expert_service.kernels.test_moe_gemm_q8mma import q8_layer

WHERE = ["here", pytest.param("gpu", marks=pytest.mark.gpu)]
INT8 = (q.CODE_INT8, q.SCALE_CHANNEL)
# 65 chunks of 16 values (33 in the simulator, one warp a block, UNROLL 1) against steps of 32 x UNROLL chunks: the
# full steps and the partial last one both run, in gate/up (over D) and down (over F)
SHAPE = (528, 528) if SIMULATOR else (1040, 1040)  # F, D
SMALL = (48, 80) if SIMULATOR else SHAPE  # the checks that need no full step (the simulator's minute is spent once)


def run(x, ids, W, meta, F, D, slot_of=None):
    K = ids.shape[1]
    dids, dW, dmeta = cuda.to_device(ids), cuda.to_device(W), cuda.to_device(meta)
    h = cuda.to_device(np.full((K, F), np.nan, np.float32))
    part = cuda.to_device(np.full((K, gate_up_parts(F)), np.nan, np.float32))
    y = cuda.to_device(np.full((K, D), np.nan, np.float32))
    slots = dict(slot_of=cuda.to_device(slot_of)) if slot_of is not None else {}
    launch_dp4a_gate_up(cuda.to_device(x), dids, dW, dmeta, F, D, h, part, **slots)
    launch_dp4a_down(h, part, dids, dW, dmeta, F, D, y, **slots)
    return h.copy_to_host(), part.copy_to_host(), y.copy_to_host()


@cuda.jit
def _quantize_words(values, inv, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = quantize4(values[4 * i], values[4 * i + 1], values[4 * i + 2], values[4 * i + 3], inv[0])


@pytest.mark.parametrize("where", WHERE)
def test_quantize4_packs_the_references_codes(where):
    """Codes of random values and of exact ties (a max of 127 makes the scale 1: k + 1/2 rounds to even), packed
    byte 0 first."""
    rng = np.random.default_rng(5)
    v = (rng.standard_normal(256) * 40).clip(-126, 126).astype(np.float32)
    v[:64] = (rng.integers(-127, 126, 64) + 0.5).astype(np.float32)
    v[0] = np.float32(127.0)
    codes, s = quantize_row_reference(v)
    assert s == 1 and (np.abs(codes[1:64].astype(np.int32)) % 2 == 0).all()  # ties went to even codes
    out = cuda.to_device(np.zeros(64, np.uint32))
    _quantize_words[1, 64](v, np.array([np.float32(1.0) / s], np.float32), out)
    np.testing.assert_array_equal(out.copy_to_host().view(np.int8), codes)
    assert codes[0] == 127 and np.abs(codes.astype(np.int32)).max() == 127


@pytest.mark.parametrize("where", WHERE)
def test_quantize4_rounds_the_exact_product_once(where):
    """Values whose product with a non-unit 1 / scale lies within a few float32 steps of k + 1/2: rounding the
    product to float32 first, then to an integer, would move some of these codes; the fma (and the reference's
    exact product) must not."""
    rng = np.random.default_rng(6)
    v = np.empty(256, np.float32)
    v[0] = np.float32(3.7)
    s = np.float32(v[0] / np.float32(127.0))
    inv = np.float32(np.float32(1.0) / s)
    k = rng.integers(-126, 126, 255) + 0.5
    near = (k / np.float64(inv)).astype(np.float32)
    v[1:] = np.nextafter(near, np.where(rng.random(255) < 0.5, np.inf, -np.inf).astype(np.float32))
    codes, s_ref = quantize_row_reference(v)
    assert s_ref == s
    exact = v[1:].astype(np.float64) * np.float64(inv)
    assert np.abs(np.abs(exact - np.floor(exact)) - 0.5).max() < 1e-4  # all within a hair of a tie
    twice = np.rint((v[1:] * inv).astype(np.float32))  # product rounded to float32, then to an integer
    assert (twice != codes[1:]).any(), "no value here would tell one rounding from two"
    out = cuda.to_device(np.zeros(64, np.uint32))
    _quantize_words[1, 64](v, np.array([inv], np.float32), out)
    np.testing.assert_array_equal(out.copy_to_host().view(np.int8), codes)


@cuda.jit
def _scale_and_quantize(values, out, scale):
    """One thread: the row's max, row_scale, then quantize4 over the row, as the kernels do."""
    if cuda.grid(1) == 0:
        m = np.float32(0.0)
        for v in values:
            m = max(m, magnitude(v))
        s, inv = row_scale(m)
        scale[0] = s
        for i in range(out.size):
            out[i] = quantize4(values[4 * i], values[4 * i + 1], values[4 * i + 2], values[4 * i + 3], inv)


@pytest.mark.parametrize("where", WHERE)
def test_a_row_too_small_for_a_normal_scale_keeps_its_codes(where):
    """A row whose max / 127 is below the smallest normal float32 (max < 1.5e-36): the scale stops there, so
    1 / scale stays finite and the codes are the reference's (an infinite 1 / scale turned every code into 0)."""
    rng = np.random.default_rng(7)
    v = (rng.standard_normal(64) * 3e-37).astype(np.float32)
    v[0] = np.float32(1e-36)
    codes, s = quantize_row_reference(v)
    assert s == np.finfo(np.float32).tiny and np.abs(codes.astype(np.int32)).max() > 1
    out, scale = cuda.to_device(np.zeros(16, np.uint32)), cuda.to_device(np.zeros(1, np.float32))
    _scale_and_quantize[1, 1](v, out, scale)
    np.testing.assert_array_equal(out.copy_to_host().view(np.int8), codes)
    assert scale.copy_to_host()[0] == s


@pytest.mark.parametrize("where", WHERE)
def test_dp4a_decode_matches_the_reference(where):
    F, D = SHAPE
    rng = np.random.default_rng(11)
    W, meta = q8_layer(rng, [INT8] * 6, F, D)
    ids = np.array([[4, 1]] if SIMULATOR else [[4, 1, 5]], np.int32)
    x = rng.standard_normal((1, D)).astype(np.float32)
    h, part, y = run(x, ids, W, meta, F, D)
    assert np.isfinite(h).all() and np.isfinite(part).all() and np.isfinite(y).all(), "an output was not written"
    h_ref, _ = dp4a_reference(x, ids, W, meta, F, D)
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5 * np.abs(h_ref).max())
    # each gate/up block's largest |h| over its rows, exactly: what the down launch scales by
    np.testing.assert_array_equal(part, np.abs(h).reshape(len(part), part.shape[1], -1).max(axis=2))
    _, y_own = dp4a_reference(x, ids, W, meta, F, D, h=h)
    np.testing.assert_allclose(y, y_own, rtol=1e-5, atol=1e-5 * np.abs(y_own).max())
    # against the expert on the float32 token and h: within the two int8 roundings of the activations
    exact = np.stack([q.expert_ffn(x, W[e], meta[e], F, D)[0] for e in ids[0]])
    err = np.abs(y - exact).max() / np.abs(exact).max()
    assert 1e-4 < err < 3e-2, err  # nonzero: the activations did go through int8


@pytest.mark.parametrize("where", WHERE)
def test_dp4a_decode_non_finite_token_and_other_encodings(where):
    F, D = SMALL
    rng = np.random.default_rng(12)
    W, meta = q8_layer(rng, [INT8, (q.CODE_FP8, q.SCALE_BLOCK), INT8], F, D)
    ids = np.array([[0, 1, 2]], np.int32)
    x = rng.standard_normal((1, D)).astype(np.float32)
    h, _, y = run(x, ids, W, meta, F, D)
    assert np.isnan(h[1]).all() and np.isnan(y[1]).all(), "the fp8 expert's rows must stay untouched"
    assert np.isfinite(h[[0, 2]]).all() and np.isfinite(y[[0, 2]]).all()
    for bad in (np.nan, -np.inf):
        x[0, D // 3] = bad
        h, part, y = run(x, ids, W, meta, F, D)
        assert np.isnan(h[[0, 2]]).all() and np.isnan(y[[0, 2]]).all(), f"a token holding {bad} must give NaN rows"
        assert np.isinf(part[[0, 2]]).all()


@pytest.mark.parametrize("where", WHERE)
def test_dp4a_decode_through_slots_equals_the_resident_layout(where):
    """The expert cache's layout: the experts' blocks in a slot buffer of other size and order (stale blocks in the
    other slots), found through slot_of with their meta rows by expert id. The outputs equal the resident
    launch's bit for bit; an expert whose slot is -1 is not computed (its rows stay NaN)."""
    F, D = SMALL
    rng = np.random.default_rng(13)
    W, meta = q8_layer(rng, [INT8] * 5, F, D)
    ids = np.array([[3, 0, 4]], np.int32)
    x = rng.standard_normal((1, D)).astype(np.float32)
    resident = run(x, ids, W, meta, F, D)
    stale, _ = q8_layer(rng, [INT8] * 4, F, D)
    buffer = stale.copy()
    slot_of = np.full(5, -1, np.int32)
    slot_of[[3, 0, 4]] = [2, 0, 3]
    buffer[[2, 0, 3]] = W[[3, 0, 4]]
    for got, want in zip(run(x, ids, buffer, meta, F, D, slot_of), resident):
        np.testing.assert_array_equal(got, want)
    slot_of[0] = -1
    h, part, y = run(x, ids, buffer, meta, F, D, slot_of)
    assert np.isnan(h[1]).all() and np.isnan(part[1]).all() and np.isnan(y[1]).all(), "slot -1 must be skipped"
    np.testing.assert_array_equal(y[[0, 2]], resident[2][[0, 2]])
    with pytest.raises(ValueError, match="slot_of must be"):
        launch_dp4a_gate_up(x, ids, buffer, meta, F, D, h, part, slot_of=slot_of.astype(np.int64))


def test_dp4a_launchers_refuse_bad_arrays():
    F, D = 48, 80
    W, meta = q8_layer(np.random.default_rng(1), [INT8] * 2, F, D)
    ids = np.zeros((1, 2), np.int32)
    h, part = np.zeros((2, F), np.float32), np.zeros((2, gate_up_parts(F)), np.float32)
    with pytest.raises(ValueError, match="x must be"):
        launch_dp4a_gate_up(np.zeros((2, D), np.float32), ids, W, meta, F, D, h, part)
    with pytest.raises(ValueError, match="part_max must be"):
        launch_dp4a_gate_up(np.zeros((1, D), np.float32), ids, W, meta, F, D, h, part[:, :-1].copy())
    with pytest.raises(ValueError, match="multiples of 16"):
        launch_dp4a_down(h, part, ids, W, meta, F, 72, np.zeros((2, 72), np.float32))
    with pytest.raises(ValueError, match="ids must be"):
        launch_dp4a_down(h, part, ids.reshape(-1), W, meta, F, D, np.zeros((2, D), np.float32))
    with pytest.raises(ValueError, match="at least one expert id"):
        launch_dp4a_gate_up(np.zeros((1, D), np.float32), np.zeros((1, 0), np.int32), W, meta, F, D, h[:0], part[:0])
