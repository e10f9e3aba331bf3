"""The grouped MoE GEMM on warpgroup MMA (moe_align -> moe_gather_bf16 -> wgmma gate|up -> wgmma down with the
store combine) vs the numpy reference, through test_moe_gemm_mma's checks (the same tolerances: h one bf16 step,
y and the combined output from the kernel's own h at fp32-accumulation precision). GPU only (wgmma has no
simulator); every output buffer starts as NaN, routing is ragged (empty experts, one expert with every token),
and the sizes leave N tails in both matrices. The refusals run anywhere."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.moe_gemm_wgmma import (
    CONFIGS,
    applies,
    choose_config,
    launch_wgmma_down,
    launch_wgmma_gate_up,
)
from tests.expert_service.kernels.test_moe_gemm_mma import check
from tests.helpers import random_ids


def down_store(h, tile_expert, num_tiles, sorted_ids, W, F, D, out, combine, config, route_weights=None):
    assert combine == "store"
    launch_wgmma_down(h, tile_expert, num_tiles, sorted_ids, W, F, D, out, config=config)


LAUNCHERS = (launch_wgmma_gate_up, down_store)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n_tok,top_k,n_exp,F,D",
    [
        (300, 2, 8, 384, 512),  # ~75 rows an expert: partial M tiles
        (200, 8, 128, 192, 256),  # 128 experts, ~12 rows each; F leaves half a gate|up tile, D 256
        (40, 2, 4, 64, 320),  # one step of K in down (F = 64), D not a multiple of the 256-row tile
        (700, 2, 8, 1024, 1024),  # ~175 rows an expert: several M tiles each
    ],
)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_configs(name, n_tok, top_k, n_exp, F, D):
    rng = np.random.default_rng(n_tok + F)
    check(random_ids(rng, n_tok, top_k, n_exp), n_exp, F, D, CONFIGS[name], "store", seed=n_tok, launchers=LAUNCHERS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_skewed_routing(name):
    """An expert with every token (slot 0), experts with none (slot 1 only over experts 2..5 of 16)."""
    n_tok = 257
    ids = np.stack([np.zeros(n_tok, np.int32), 2 + np.arange(n_tok, dtype=np.int32) % 4], axis=1)
    check(ids, 16, 192, 384, CONFIGS[name], "store", seed=7, launchers=LAUNCHERS)


def test_applies_and_refuses_other_sizes():
    assert applies(768, 2048, 3 * 768 * 2048) and applies(14336, 4096, 3 * 14336 * 4096)
    assert not applies(100, 2048, 3 * 100 * 2048) and not applies(768, 2056, 3 * 768 * 2056)
    cfg = CONFIGS["w64"]
    with pytest.raises(ValueError, match="multiples of 64"):
        launch_wgmma_gate_up(
            cuda.to_device(np.zeros((64, 72), np.uint16)),
            cuda.to_device(np.zeros(1, np.int32)),
            cuda.to_device(np.zeros(1, np.int32)),
            cuda.to_device(np.zeros((1, 3 * 64 * 72), np.uint16)),
            64,
            72,
            cuda.to_device(np.zeros((64, 64), np.uint16)),
            config=cfg,
        )


def test_tile_choice():
    assert choose_config(512 * 2, 8) == CONFIGS["w128"]  # mixtral 1 x 512: 128 rows an expert
