"""The grouped int8-activation kernels (moe_q8_dp4a_grouped) against moe_q8_dp4a's numpy reference, in the simulator
and on the GPU: the token rows quantized bitwise as quantize_row_reference; random int8 per-channel experts, T tokens
routed to K of them (one expert without tokens, one of another encoding whose rows stay untouched), partial token
tiles, outputs starting as NaN; h per position against the float64 SwiGLU of its quantized token, each block's
maximum against the kernel's own h (exactly), y from the kernel's own h; NaN or infinite tokens give NaN rows; the
refusals. On the GPU the rows are 65 chunks long, so the full steps and the partial one both run (the simulator's
short rows take only the partial step, to keep its run short)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.experts.grouping import group_by_expert
from expert_service.kernels import expert_quant as q
from expert_service.kernels.moe_q8_dp4a import dp4a_reference, gate_up_parts, quantize_row_reference
from expert_service.kernels.moe_q8_dp4a_grouped import (
    launch_dp4a_grouped_down,
    launch_dp4a_grouped_gate_up,
    launch_dp4a_quantize_tokens,
)
from expert_service.kernels.numeric import SIMULATOR
from tests.expert_service.kernels.test_moe_gemm_q8mma import q8_layer

WHERE = ["here", pytest.param("gpu", marks=pytest.mark.gpu)]
INT8, FP8 = (q.CODE_INT8, q.SCALE_CHANNEL), (q.CODE_FP8, q.SCALE_BLOCK)
SHAPE = (48, 80) if SIMULATOR else (1040, 1040)  # F, D
TOKENS = 5 if SIMULATOR else 16


def routing(rng, T: int, K: int, experts: list[int]) -> np.ndarray:
    return np.stack([rng.choice(experts, K, replace=False) for _ in range(T)]).astype(np.int32)


def run(x, ids, W, meta, F, D):
    T, K = ids.shape
    n = T * K
    groups = group_by_expert(ids, W.shape[0])
    order, offsets = (cuda.to_device(a.astype(np.int32)) for a in (groups.order, groups.offsets))
    dW, dmeta = cuda.to_device(W), cuda.to_device(meta)
    xq = cuda.to_device(np.full((T, D), 0xAB, np.uint8))
    x_scale = cuda.to_device(np.full(T, np.nan, np.float32))
    h = cuda.to_device(np.full((n, F), np.nan, np.float32))
    part = cuda.to_device(np.full((n, gate_up_parts(F)), np.nan, np.float32))
    y = cuda.to_device(np.full((n, D), np.nan, np.float32))
    launch_dp4a_quantize_tokens(cuda.to_device(x), xq, x_scale)
    launch_dp4a_grouped_gate_up(xq, x_scale, order, offsets, K, dW, dmeta, F, D, h, part)
    launch_dp4a_grouped_down(h, part, offsets, dW, dmeta, F, D, y)
    expert_of = np.repeat(np.arange(W.shape[0]), np.diff(groups.offsets))
    token_of = groups.order // K
    return dict(
        xq=xq.copy_to_host(), x_scale=x_scale.copy_to_host(), h=h.copy_to_host(), part=part.copy_to_host(),
        y=y.copy_to_host(), expert_of=expert_of, token_of=token_of,
    )  # fmt: skip


@pytest.mark.parametrize("where", WHERE)
def test_grouped_dp4a_matches_the_reference(where):
    F, D = SHAPE
    rng = np.random.default_rng(21)
    W, meta = q8_layer(rng, [INT8] * 5 + [FP8], F, D)
    ids = routing(rng, TOKENS, 2, [0, 1, 3, 4, 5])  # expert 2: no tokens; 5: fp8, not computed here
    x = rng.standard_normal((TOKENS, D)).astype(np.float32) * rng.uniform(0.1, 10, (TOKENS, 1)).astype(np.float32)
    got = run(x, ids, W, meta, F, D)
    for t in range(TOKENS):
        codes, s = quantize_row_reference(x[t])
        np.testing.assert_array_equal(got["xq"][t].view(np.int8), codes)
        assert got["x_scale"][t] == s
    mine = got["expert_of"] != 5
    assert np.isnan(got["h"][~mine]).all() and np.isnan(got["y"][~mine]).all(), "the fp8 expert's rows were written"
    assert np.isfinite(got["h"][mine]).all() and np.isfinite(got["y"][mine]).all(), "a routed row was not written"
    h, part = got["h"][mine], got["part"][mine]  # each block's largest |h| over its rows, exactly
    np.testing.assert_array_equal(part, np.abs(h).reshape(len(part), part.shape[1], -1).max(axis=2))
    for p in np.flatnonzero(mine):
        e, t = got["expert_of"][p], got["token_of"][p]
        h_ref, y_own = dp4a_reference(x[t : t + 1], [[e]], W, meta, F, D, h=got["h"][p : p + 1])
        np.testing.assert_allclose(got["h"][p], h_ref[0], rtol=1e-5, atol=1e-5 * np.abs(h_ref).max())
        np.testing.assert_allclose(got["y"][p], y_own[0], rtol=1e-5, atol=1e-5 * np.abs(y_own).max())


@pytest.mark.parametrize("where", WHERE)
def test_grouped_dp4a_nan_token_gives_nan_rows(where):
    F, D = SHAPE
    rng = np.random.default_rng(22)
    W, meta = q8_layer(rng, [INT8] * 3, F, D)
    ids = routing(rng, 3, 2, [0, 1, 2])
    x = rng.standard_normal((3, D)).astype(np.float32)
    for value in (np.nan, np.inf):
        x[1, 7] = value
        got = run(x, ids, W, meta, F, D)
        bad = got["token_of"] == 1
        assert np.isinf(got["x_scale"][1]) and np.isfinite(got["x_scale"][[0, 2]]).all()
        assert np.isnan(got["h"][bad]).all() and np.isnan(got["y"][bad]).all(), value
        assert np.isinf(got["part"][bad]).all() and np.isfinite(got["part"][~bad]).all()
        assert np.isfinite(got["h"][~bad]).all() and np.isfinite(got["y"][~bad]).all()


def test_grouped_dp4a_launchers_refuse_bad_arrays():
    F, D = 48, 80
    W, meta = q8_layer(np.random.default_rng(1), [INT8] * 2, F, D)
    x = np.zeros((3, D), np.float32)
    xq, x_scale = np.zeros((3, D), np.uint8), np.zeros(3, np.float32)
    order, offsets = np.zeros(6, np.int32), np.zeros(3, np.int32)
    h, part = np.zeros((6, F), np.float32), np.zeros((6, gate_up_parts(F)), np.float32)
    with pytest.raises(ValueError, match="x must be"):
        launch_dp4a_quantize_tokens(np.zeros((3, 72), np.float32), xq, x_scale)
    with pytest.raises(ValueError, match="xq must be"):
        launch_dp4a_quantize_tokens(x, np.zeros((3, D), np.int8), x_scale)
    with pytest.raises(ValueError, match="x must be"):  # one token's row, not [1, D]: named, not an unpacking error
        launch_dp4a_quantize_tokens(x[0].copy(), xq[:1], x_scale[:1])
    with pytest.raises(ValueError, match="xq must be"):  # flat: its length is no token count (order is not to blame)
        launch_dp4a_grouped_gate_up(xq.reshape(-1), x_scale, order, offsets, 2, W, meta, F, D, h, part)
    with pytest.raises(ValueError, match="not T=3 tokens x top_k=2"):
        launch_dp4a_grouped_gate_up(xq, x_scale, order[:5].copy(), offsets, 2, W, meta, F, D, h, part)
    with pytest.raises(ValueError, match="not T=6 tokens x top_k=2"):  # the workspace's rows, unsliced
        launch_dp4a_grouped_gate_up(
            np.zeros((6, D), np.uint8), np.zeros(6, np.float32), order, offsets, 2, W, meta, F, D, h, part
        )
    with pytest.raises(ValueError, match="offsets must be"):
        launch_dp4a_grouped_gate_up(xq, x_scale, order, offsets[:2].copy(), 2, W, meta, F, D, h, part)
    with pytest.raises(ValueError, match="y must be"):
        launch_dp4a_grouped_down(h, part, offsets, W, meta, F, D, np.zeros((6, 64), np.float32))
