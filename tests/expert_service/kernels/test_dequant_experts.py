"""dequant_experts vs expert_quant.dequantize: a group of the step's active experts (found from the grouping
offsets on the device) widened into dense scratch blocks, every kind of expert, bf16 and float32 scratch."""

import numpy as np
import pytest
from numba import cuda

from common import dtypes
from expert_service.kernels.dequant_experts import DequantInto, launch_dequant_experts
from tests.expert_service.kernels.test_moe_q8 import KINDS, mixed_layer


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_group_of_active_experts_matches_reference(dtype):
    F, D = 32, 144  # 144: a partial 128-column scale block
    rng = np.random.default_rng(3)
    kinds = KINDS + [KINDS[0]]
    W, meta, mats = mixed_layer(rng, kinds, F, D)
    counts = np.array([2, 1, 3, 0, 4, 1, 1], np.int32)  # experts 0, 1, 2, 4, 5, 6 active
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    active = np.flatnonzero(counts)
    first, group = 1, 5  # experts 1, 2, 4, 5, 6: every kind but per-channel fp8 (expert 3 has no tokens)
    out = cuda.to_device(np.full((group + 1, 3 * F * D), 0xFFFF if dtype == np.uint16 else np.nan, dtype))
    launch_dequant_experts(cuda.to_device(W), cuda.to_device(meta), cuda.to_device(offsets), first, F, D, out[:group])
    got = out.copy_to_host()
    for j in range(group):
        want = np.concatenate([m.reshape(-1) for m in mats[active[first + j]]])
        values = dtypes.bf16_to_float32(got[j]) if dtype == np.uint16 else got[j]
        tol = 2.0**-8 if dtype == np.uint16 else 0.0  # bf16 rounding of q * scale
        np.testing.assert_allclose(values, want, rtol=tol, atol=0)
    assert (got[group] == 0xFFFF).all() if dtype == np.uint16 else np.isnan(got[group]).all()  # untouched


def test_group_past_the_active_experts_writes_nothing():
    F, D = 16, 32
    W, meta, _ = mixed_layer(np.random.default_rng(4), KINDS[:2], F, D)
    offsets = np.array([0, 1, 1], np.int32)  # one active expert
    out = cuda.to_device(np.full((2, 3 * F * D), np.nan, np.float32))
    launch_dequant_experts(cuda.to_device(W), cuda.to_device(meta), cuda.to_device(offsets), 0, F, D, out)
    got = out.copy_to_host()
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()


def test_a_prepared_launcher_widens_what_the_sliced_launch_does():
    """DequantInto, made once on a scratch half, widens (first, g) groups bit for bit as launch_dequant_experts
    on the half's first g rows, and leaves the rows past g untouched (one launcher serves every group)."""
    F, D = 16, 144
    rng = np.random.default_rng(8)
    W, meta, _ = mixed_layer(rng, KINDS + [KINDS[1]], F, D)
    counts = np.array([1, 0, 2, 1, 3, 1, 2], np.int32)[: meta.shape[0]]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    dW, dmeta, doffsets = cuda.to_device(W), cuda.to_device(meta), cuda.to_device(offsets)
    group = 3
    scratch = cuda.to_device(np.full((2 * group, 3 * F * D), 0xFFFF, np.uint16))
    into = DequantInto(dW, dmeta, doffsets, F, D, scratch[group : 2 * group])  # the second half
    for first, g in ((0, 3), (3, 2), (5, 1)):
        scratch.copy_to_device(np.full((2 * group, 3 * F * D), 0xFFFF, np.uint16))
        into(first, g)
        want = cuda.to_device(np.full((g, 3 * F * D), 0xFFFF, np.uint16))
        launch_dequant_experts(dW, dmeta, doffsets, first, F, D, want)
        got = scratch.copy_to_host()
        np.testing.assert_array_equal(got[group : group + g], want.copy_to_host())
        assert (got[:group] == 0xFFFF).all() and (got[group + g :] == 0xFFFF).all(), (first, g)
    with pytest.raises(AssertionError):
        into(0, group + 1)
