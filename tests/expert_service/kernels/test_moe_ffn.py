"""moe_gate_up + launch_moe_down vs swiglu_mlp per expert in grouped order, for every weight dtype (simulator on tiny
shapes; Mixtral/Qwen3 sizes on a GPU). The reference uses the exact float32 values of the stored weights."""

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.moe import silu
from expert_service.experts.grouping import group_by_expert
from expert_service.kernels.moe_ffn import launch_moe_down, launch_moe_gate_up
from tests.helpers import STORAGE_DTYPES, expert_buffer, random_ids


def check(ids, n_exp, F, D, dtype, seed, rtol=1e-5):
    rng = np.random.default_rng(seed)
    n_tok, top_k = ids.shape
    W, mats = expert_buffer(rng, n_exp, F, D, dtype)
    x = rng.standard_normal((n_tok, D)).astype(np.float32)
    groups = group_by_expert(ids, n_exp)
    order = cuda.to_device(groups.order.astype(np.int32))
    offsets = cuda.to_device(groups.offsets.astype(np.int32))
    h = cuda.to_device(np.full((n_tok * top_k, F), np.nan, np.float32))
    y = cuda.to_device(np.full((n_tok * top_k, D), np.nan, np.float32))
    dW = cuda.to_device(W)
    launch_moe_gate_up(cuda.to_device(x), order, offsets, dW, F, D, h)
    launch_moe_down(h, order, offsets, dW, F, D, y)
    h, y = h.copy_to_host(), y.copy_to_host()
    assert np.isfinite(h).all() and np.isfinite(y).all()  # every element written, no padding read
    for e in groups.active_experts():
        lo, hi = groups.offsets[e], groups.offsets[e + 1]
        gate, up, down = mats[e]
        xe = x[groups.tokens_of(e)].astype(np.float64)
        ref_h = silu(xe @ gate.T) * (xe @ up.T)
        np.testing.assert_allclose(h[lo:hi], ref_h, rtol=rtol, atol=rtol * np.abs(ref_h).max())
        ref_y = h[lo:hi].astype(np.float64) @ down.T.astype(np.float64)
        np.testing.assert_allclose(y[lo:hi], ref_y, rtol=rtol, atol=rtol * np.abs(ref_y).max())


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_awkward_shapes(dtype):
    rng = np.random.default_rng(1)
    # 5 tokens x K=2 over 7 experts (some empty), D=36/F=20 (bf16: 8-byte words; two input chunks, token tiles)
    check(random_ids(rng, 5, 2, 7), 7, 20, 36, dtype, seed=2)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_odd_sizes_one_token(dtype):
    # one token, K=1, D and F odd (bf16 falls back to element loads)
    check(np.array([[2]], np.int32), 3, 13, 33, dtype, seed=3)


def test_all_tokens_on_one_expert_many_token_tiles():
    check(np.full((7, 1), 1, np.int32), 3, 8, 12, np.uint16, seed=4)


def test_rejects_small_stride():
    W = cuda.to_device(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError):
        launch_moe_gate_up(
            cuda.to_device(np.ones((1, 8), np.float32)),
            cuda.to_device(np.zeros(1, np.int32)),
            cuda.to_device(np.array([0, 1, 1], np.int32)),
            W,
            8,
            8,
            cuda.to_device(np.zeros((1, 8), np.float32)),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("n_exp,top_k,F,D", [(8, 2, 14336, 4096), (128, 8, 768, 2048)])
@pytest.mark.parametrize("n_tok", [1, 16, 64, 512])
def test_gpu_realistic(n_tok, n_exp, top_k, F, D):
    rng = np.random.default_rng(n_tok)
    check(random_ids(rng, n_tok, top_k, n_exp), n_exp, F, D, np.uint16, seed=n_tok, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gpu_other_dtypes_and_one_expert(dtype):
    check(np.full((64, 1), 5, np.int32), 8, 1000, 515, dtype, seed=9, rtol=1e-4)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_slot_indirection_in_waves_equals_full_residency(dtype):
    """The expert cache's use: weights in a [slots, stride] buffer, expert e at slot_of[e], a layer computed in
    two waves (experts outside a wave skipped, their rows left alone) -> bitwise the full-residency result."""
    rng = np.random.default_rng(5)
    n_exp, F, D = 6, 12, 20
    ids = random_ids(rng, 5, 2, n_exp)
    W, _ = expert_buffer(rng, n_exp, F, D, dtype)
    x = cuda.to_device(rng.standard_normal((5, D)).astype(np.float32))
    groups = group_by_expert(ids, n_exp)
    order = cuda.to_device(groups.order.astype(np.int32))
    offsets = cuda.to_device(groups.offsets.astype(np.int32))
    full_h, full_y = (cuda.to_device(np.full((10, n), np.nan, np.float32)) for n in (F, D))
    dW = cuda.to_device(W)
    launch_moe_gate_up(x, order, offsets, dW, F, D, full_h)
    launch_moe_down(full_h, order, offsets, dW, F, D, full_y)
    h, y = (cuda.to_device(np.full((10, n), np.nan, np.float32)) for n in (F, D))
    active = [int(e) for e in groups.active_experts()]
    for wave in (active[::2], active[1::2]):
        slots = np.zeros((3, W.shape[1]), W.dtype)
        slot_of = np.full(n_exp, -1, np.int32)
        for slot, e in enumerate(reversed(wave)):  # slots in another order than experts
            slots[slot], slot_of[e] = W[e], slot
        d_slots, d_slot_of = cuda.to_device(slots), cuda.to_device(slot_of)
        launch_moe_gate_up(x, order, offsets, d_slots, F, D, h, slot_of=d_slot_of)
        launch_moe_down(h, order, offsets, d_slots, F, D, y, slot_of=d_slot_of)
    np.testing.assert_array_equal(h.copy_to_host(), full_h.copy_to_host())
    np.testing.assert_array_equal(y.copy_to_host(), full_y.copy_to_host())
