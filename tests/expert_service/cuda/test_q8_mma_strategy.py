"""Where Q8_MMA (the grouped tensor-core kernel on 8-bit experts) is chosen (no GPU): only for layers whose every
expert is int8 / fp8 with bf16 dense weights and D, F multiples of 16; between the CudaOptions thresholds, which
differ for few-expert layers; the workspace holds its sorted rows exactly when a step can take it; a decoder
refuses options that reach a strategy its workspace lacks."""

from types import SimpleNamespace

import numpy as np
import pytest

from common.models import config_from_hf
from expert_service.cuda.decoder import CudaDecoder
from expert_service.cuda.moe_strategy import (
    GROUPED_MMA_MIN_EXPERTS,
    MoeStrategy,
    choose_strategy,
    q8_mma_tokens,
    reachable_strategies,
    warmup_tokens,
)
from expert_service.cuda.workspace import layout_workspace
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels.moe_gemm_q8mma import choose_config as choose_q8_config
from expert_service.tools.tiny_model import tiny_hf_config

Q8, MMA, CUBLAS = MoeStrategy.Q8, MoeStrategy.Q8_MMA, MoeStrategy.CUBLAS_PER_EXPERT


def config(E: int, D: int = 64, F: int = 96):
    hf = {**tiny_hf_config("qwen3_moe"), "num_experts": E, "hidden_size": D, "moe_intermediate_size": F}
    return config_from_hf(hf)


@pytest.mark.parametrize(
    "all_8bit,bf16,D,F", [(False, True, 64, 96), (True, False, 64, 96), (True, True, 72, 96), (True, True, 64, 40)]
)
def test_not_applicable(all_8bit, bf16, D, F):
    assert q8_mma_tokens(config(8, D, F), all_8bit, bf16, CudaOptions()) is None
    assert choose_strategy(16, 2, 8, False, bf16, True, None) is Q8


def test_thresholds_by_expert_count():
    opts = CudaOptions(q8_mma_min_tokens=3, q8_mma_max_tokens=900, q8_mma_max_tokens_few_experts=40)
    assert q8_mma_tokens(config(8), True, True, opts) == (3, 40)
    assert q8_mma_tokens(config(GROUPED_MMA_MIN_EXPERTS), True, True, opts) == (3, 900)
    few = q8_mma_tokens(config(8), True, True, opts)
    got = {T: choose_strategy(T, 2, 8, False, True, True, few) for T in (1, 2, 3, 40, 41, 64, 65)}
    assert got == {1: Q8, 2: Q8, 3: MMA, 40: MMA, 41: Q8, 64: Q8, 65: CUBLAS}
    # the expert cache keeps its own strategies; dense models never take Q8_MMA
    assert choose_strategy(16, 2, 8, True, True, True, few) is MoeStrategy.CACHED_GROUPED
    assert choose_strategy(16, 2, 8, False, True, False, few) is not MMA


def test_defaults_cover_decode_and_prefill_of_many_experts():
    cfg = config(128)
    tokens = q8_mma_tokens(cfg, True, True, CudaOptions())
    assert reachable_strategies(4096, 8, 128, False, True, True, tokens) == {Q8, MMA}
    cfg8 = config(8)
    few = q8_mma_tokens(cfg8, True, True, CudaOptions())
    # few large experts: Q8_MMA up to 512-token steps (it beat dequantise + cuBLAS there on the H200), cuBLAS past
    assert reachable_strategies(512, 2, 8, False, True, True, few) == {Q8, MMA}
    assert reachable_strategies(2048, 2, 8, False, True, True, few) == {Q8, MMA, CUBLAS}
    assert choose_strategy(512, 2, 8, False, True, True, few) is MMA
    assert choose_strategy(513, 2, 8, False, True, True, few) is CUBLAS
    # warm-up takes the first step of each q8 tile config
    sizes = warmup_tokens(4096, 8, 128, True, CudaOptions(), True, tokens)
    first: dict = {}
    for T in range(2, 4097):
        first.setdefault(choose_q8_config(T * 8, 128), T)
    assert set(first.values()) <= set(sizes) and 2 in sizes


def test_workspace_holds_sorted_rows_only_when_reachable():
    cfg = config(128)
    args = (cfg, np.dtype(np.uint16), 512, 8, 16, 2)
    on = layout_workspace(*args, quantized=True, q8_mma=q8_mma_tokens(cfg, True, True, CudaOptions()))
    off = layout_workspace(*args, quantized=True, q8_mma=None)
    assert "mma_xs" in on and "mma_h" in on and "dequant" not in on and "expert_x" not in on
    assert "mma_xs" not in off and "dequant" in off
    assert on["mma_xs"][0][1] == cfg.hidden_size and on["mma_h"][0][1] == cfg.moe_intermediate_size


def test_set_options_refuses_strategies_the_workspace_lacks():
    cfg = config(128)
    d = CudaDecoder.__new__(CudaDecoder)
    d.config, d.cached, d.max_tokens = cfg, None, 512
    d.weights = SimpleNamespace(dtype=np.dtype(np.uint16), quantized=True, all_8bit=True)
    d.workspace_strategies = d._strategies(CudaOptions(), False)
    with pytest.raises(ValueError, match=r"^cuda_options: .*\(cublas_per_expert\)"):
        d.set_options(CudaOptions(q8_mma_max_tokens=100))
