"""The grouped MoE GEMM for 8-bit experts on warpgroup MMA vs the numpy references, through
test_moe_gemm_q8mma's checks (moe_reference_q8: the kernel's roundings; expert_quant's exact expert_ffn within
bf16 tolerance). GPU only (wgmma has no simulator). Layers mix int8 and fp8 experts with both scale schemes;
output buffers start as NaN; ragged routing; input dims that end mid scale block and output rows that cross
scale-block rows; a layer whose 128x128 blocks carry gains 3-25x apart (a step reading a neighbouring block's
scale is far outside tolerance). The refusals run anywhere."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels import expert_quant as q
from expert_service.kernels.moe_gemm_q8wgmma import CONFIGS, launch_q8wgmma_down, launch_q8wgmma_gate_up
from tests.expert_service.kernels.test_moe_gemm_q8mma import KINDS, check
from tests.helpers import random_ids

LAUNCHERS = (launch_q8wgmma_gate_up, launch_q8wgmma_down)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    "n_tok,top_k,n_exp,F,D",
    [
        (300, 2, 8, 384, 512),  # mixtral-like ratios
        (200, 8, 40, 128, 256),  # many experts, few rows each
        (45, 3, 5, 320, 192),  # partial scale blocks on both matrices' inputs, F not a multiple of 128
        (700, 2, 8, 256, 1024),  # several M tiles an expert
        (40, 2, 4, 64, 320),  # one K step in down (fewer steps than primed stages), D not a multiple of 256
    ],
)
def test_gpu_configs(name, n_tok, top_k, n_exp, F, D):
    rng = np.random.default_rng(n_tok + F)
    kinds = [KINDS[e % len(KINDS)] for e in range(n_exp)]
    check(random_ids(rng, n_tok, top_k, n_exp), kinds, F, D, CONFIGS[name], seed=n_tok, launchers=LAUNCHERS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_block_scales_far_apart(name):
    ids = np.array([[0, 1], [1, 2], [2, 0], [1, 0], [2, 1], [0, 2], [1, 2]] * 20, np.int32)
    kinds = [(q.CODE_FP8, q.SCALE_BLOCK), (q.CODE_FP8, q.SCALE_BLOCK), (q.CODE_INT8, q.SCALE_CHANNEL)]
    check(ids, kinds, 192, 320, CONFIGS[name], seed=4, gains=True, launchers=LAUNCHERS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_skewed_routing(name):
    n_tok = 257
    ids = np.stack([np.zeros(n_tok, np.int32), 2 + np.arange(n_tok, dtype=np.int32) % 4], axis=1)
    check(ids, [KINDS[e % len(KINDS)] for e in range(16)], 128, 256, CONFIGS[name], seed=7, launchers=LAUNCHERS)


def test_rejects_dims_that_are_not_whole_steps():
    W = cuda.to_device(np.zeros((2, 4096), np.uint8))
    meta = cuda.to_device(np.zeros((2, q.META_WIDTH), np.int32))
    one = cuda.to_device(np.zeros(1, np.int32))
    cfg = CONFIGS["w64"]
    xs = cuda.to_device(np.zeros((cfg.block_m, 80), np.uint16))
    h = cuda.to_device(np.zeros((cfg.block_m, 64), np.uint16))
    with pytest.raises(ValueError, match="multiples of 64"):
        launch_q8wgmma_gate_up(xs, one, one, W, meta, 64, 80, h, config=cfg)
