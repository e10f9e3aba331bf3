"""The MoE strategy choice for bf16 layers of few experts (mixtral-like) on the wgmma kernel: pure host logic."""

import pytest

from common.models import config_from_hf
from expert_service.cuda import moe_strategy
from expert_service.cuda.moe_grouped_mma import WGMMA_MIN_ROWS
from expert_service.cuda.moe_strategy import (
    GROUPED_MMA_MIN_EXPERTS,
    MoeStrategy,
    choose_strategy,
    few_expert_mma_tokens,
    reachable_strategies,
)
from expert_service.cuda.workspace import layout_workspace
from expert_service.engine.cuda_options import CudaOptions
from expert_service.tools.tiny_model import tiny_hf_config

S = MoeStrategy
K, E = 2, 8  # Mixtral's routing
FIRST = WGMMA_MIN_ROWS * E // K  # the first step with WGMMA_MIN_ROWS rows an expert on average (384)


def test_few_experts_take_grouped_mma_inside_the_window_only():
    assert [choose_strategy(T, K, E, False, True) for T in (FIRST, 1024, 2048)] == [S.CUBLAS_PER_EXPERT] * 3
    window = [choose_strategy(T, K, E, False, True, few_expert_mma=1024) for T in (FIRST - 1, FIRST, 1024, 1025)]
    assert window == [S.CUBLAS_PER_EXPERT, S.GROUPED_MMA, S.GROUPED_MMA, S.CUBLAS_PER_EXPERT]
    assert choose_strategy(2, K, E, False, True, few_expert_mma=1024) is S.GROUPED_MMA  # sparse steps, as before
    assert choose_strategy(64, K, E, False, True, few_expert_mma=1024) is S.ALL_EXPERTS  # below FIRST: unchanged
    assert choose_strategy(1024, K, E, False, False, few_expert_mma=1024) is S.CUBLAS_PER_EXPERT  # fp16 / fp32
    assert choose_strategy(1024, K, E, True, True, few_expert_mma=1024) is S.CACHED_CUBLAS  # the cache decides
    many = GROUPED_MMA_MIN_EXPERTS
    assert choose_strategy(4096, 8, many, False, True, few_expert_mma=0) is S.GROUPED_MMA  # many experts: always


def test_reachable_strategies_keep_cublas_above_the_window():
    assert {S.GROUPED_MMA, S.CUBLAS_PER_EXPERT} <= reachable_strategies(2048, K, E, False, True, few_expert_mma=512)
    # steps of 65 .. FIRST - 1 tokens keep per-expert cuBLAS whatever the window
    assert S.CUBLAS_PER_EXPERT in reachable_strategies(2048, K, E, False, True, few_expert_mma=2048)
    above = {choose_strategy(T, K, E, False, True, few_expert_mma=2048) for T in range(FIRST, 2049)}
    assert above == {S.GROUPED_MMA}


def mixtral(**overrides):
    return config_from_hf({**tiny_hf_config("mixtral"), **overrides})


@pytest.mark.parametrize("hopper", [True, False])
def test_the_window_needs_bf16_few_experts_wgmma_and_an_sm90_device(monkeypatch, hopper):
    monkeypatch.setattr(moe_strategy, "hopper", lambda: hopper)
    config = mixtral(hidden_size=64, intermediate_size=128, num_local_experts=E)
    on = CudaOptions(grouped_mma_max_tokens_few_experts=1024)
    assert few_expert_mma_tokens(config, True, on) == (1024 if hopper else 0)
    assert few_expert_mma_tokens(config, True, CudaOptions()) == (1024 if hopper else 0)  # the shipped default
    assert few_expert_mma_tokens(config, True, CudaOptions(grouped_mma_max_tokens_few_experts=0)) == 0  # off
    assert few_expert_mma_tokens(config, False, on) == 0  # not bf16
    assert (
        few_expert_mma_tokens(config, True, CudaOptions(grouped_mma_max_tokens_few_experts=1024, wgmma_experts=False))
        == 0
    )
    assert few_expert_mma_tokens(mixtral(hidden_size=64, intermediate_size=136), True, on) == 0  # F % 64
    many = mixtral(hidden_size=64, intermediate_size=128, num_local_experts=GROUPED_MMA_MIN_EXPERTS)
    assert few_expert_mma_tokens(many, True, on) == 0  # GROUPED_MMA already at every size


def test_workspace_of_the_window_holds_both_paths():
    import numpy as np

    config = mixtral(hidden_size=64, intermediate_size=128, num_local_experts=E)
    bf16 = np.dtype(np.uint16)
    layout = layout_workspace(config, bf16, 2048, 16, 16, len(config.moe_layers), few_expert_mma=512)
    assert layout["mma_xs"][0][0] >= 2048 * K and "expert_gate_up" in layout  # GROUPED_MMA and per-expert cuBLAS


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_the_option_refuses_what_is_not_a_token_count(value):
    with pytest.raises(ValueError, match="cuda_options.grouped_mma_max_tokens_few_experts"):
        CudaOptions(grouped_mma_max_tokens_few_experts=value)


def test_blocks_host_asks_the_size_and_its_bucket(monkeypatch):
    """A decode of 300 sequences runs unpadded (per-expert cuBLAS, a host break) although its prefill bucket, 384,
    would take the window's GROUPED_MMA: the decoder must still report that the step waits for the host."""
    from types import SimpleNamespace

    import numpy as np

    from expert_service.cuda.decoder import CudaDecoder

    monkeypatch.setattr(moe_strategy, "hopper", lambda: True)
    d = CudaDecoder.__new__(CudaDecoder)
    d.config = mixtral(hidden_size=64, intermediate_size=128, num_local_experts=E)
    d.cached, d.max_tokens = None, 512
    d.weights = SimpleNamespace(dtype=np.dtype(np.uint16), quantized=False, all_8bit=False)
    d.model = SimpleNamespace(options=CudaOptions(grouped_mma_max_tokens_few_experts=512))
    assert d._prefill_bucket(300) == 384 and d._strategy(384) is S.GROUPED_MMA
    assert d._strategy(300) is S.CUBLAS_PER_EXPERT and d.blocks_host(300)
    assert not d.blocks_host(480)  # 480 and its bucket 512 both take the window
