"""How large an expert-cache step runs in grouped waves (no GPU): up to moe_ffn.GROUPED_MAX_TOKENS by default, every
step moe_align can sort with CudaOptions.cached_mma_large on bf16 layers whose waves take the tensor-core kernel
(larger steps otherwise read the waves back at a host break for per-expert cuBLAS, CACHED_CUBLAS); the sorted rows
are laid out for that size, and set_options refuses the option on a decoder laid out without it."""

from types import SimpleNamespace

import numpy as np
import pytest

from common.models import config_from_hf
from expert_service.cuda.decoder import CudaDecoder
from expert_service.cuda.moe_cached import dense_scratch_needed
from expert_service.cuda.moe_strategy import (
    ON_DEVICE,
    MoeStrategy,
    cached_grouped_tokens,
    choose_strategy,
    reachable_strategies,
)
from expert_service.cuda.workspace import layout_workspace
from expert_service.engine.cuda_options import EXPERIMENTAL, CudaOptions
from expert_service.kernels.moe_align import MAX_ASSIGNMENTS, max_rows
from expert_service.kernels.moe_ffn import GROUPED_MAX_TOKENS
from expert_service.kernels.moe_gemm_mma import choose_config
from expert_service.tools.tiny_model import tiny_hf_config

GROUPED, CUBLAS = MoeStrategy.CACHED_GROUPED, MoeStrategy.CACHED_CUBLAS
BF16, F32 = np.dtype(np.uint16), np.dtype(np.float32)
LARGE = CudaOptions(cached_mma_large=True)
SMALL = CudaOptions(cached_mma_large=False)  # large cached steps on per-expert cuBLAS (CACHED_CUBLAS)


def config(E: int = 16, K: int = 4):
    return config_from_hf({**tiny_hf_config("qwen3_moe"), "num_experts": E, "num_experts_per_tok": K})


def test_shipped_on_by_default():
    assert "cached_mma_large" not in EXPERIMENTAL and CudaOptions().cached_mma_large is True


@pytest.mark.parametrize(
    "options,dtype,quantized,expected",
    [
        (SMALL, BF16, False, GROUPED_MAX_TOKENS),
        (LARGE, BF16, False, MAX_ASSIGNMENTS // 4),
        (CudaOptions(cached_mma=False, cached_mma_large=True), BF16, False, GROUPED_MAX_TOKENS),  # moe_ffn's waves
        (LARGE, F32, False, GROUPED_MAX_TOKENS),  # the tensor-core kernel reads bf16 weights
        (LARGE, BF16, True, GROUPED_MAX_TOKENS),  # mixed layers (16-bit experts among 8-bit ones) keep moe_q8
    ],
)
def test_the_largest_grouped_step(options, dtype, quantized, expected):
    assert cached_grouped_tokens(config(), dtype, quantized, options) == expected


@pytest.mark.parametrize(
    "options,dtype,dims,expected",
    [
        (LARGE, BF16, (64, 96), MAX_ASSIGNMENTS // 2),  # every expert 8-bit: the 8-bit tensor-core waves (K = 2)
        (SMALL, BF16, (64, 96), GROUPED_MAX_TOKENS),
        (LARGE, F32, (64, 96), GROUPED_MAX_TOKENS),  # the kernel's activations are bf16
        (LARGE, BF16, (64, 40), GROUPED_MAX_TOKENS),  # F not a multiple of 16: no 8-bit tile kernel
    ],
)
def test_8bit_experts_take_the_tensor_core_waves_where_q8_mma_applies(options, dtype, dims, expected):
    D, F = dims
    cfg = config_from_hf({**tiny_hf_config("qwen3_moe"), "hidden_size": D, "moe_intermediate_size": F})
    assert cached_grouped_tokens(cfg, dtype, True, options, all_8bit=True) == expected


def test_8bit_waves_are_laid_out_and_warm_up_their_tile_configs():
    """An all-8-bit cached engine lays out the sorted rows and the tile -> slot map, and warms every tile config
    of moe_gemm_q8mma its waves take (choose_q8_config, not the bf16 kernel's)."""
    from expert_service.cuda.moe_strategy import q8_mma_tokens, warmup_tokens
    from expert_service.kernels.moe_gemm_q8mma import choose_config as choose_q8_config

    K, E, T = 2, 8, 2048
    cfg = config(E, K)
    q8 = q8_mma_tokens(cfg, True, True, LARGE)
    big = cached_grouped_tokens(cfg, BF16, True, LARGE, all_8bit=True)
    layout = layout_workspace(
        cfg,
        BF16,
        T,
        8,
        64,
        len(cfg.moe_layers),
        cached=True,
        quantized=True,
        q8_mma=q8,
        cached_mma=True,
        cached_grouped=big,
    )
    assert "mma_tile_slot" in layout and layout["mma_sorted_ids"][0][0] >= max_rows(
        T * K, E, choose_q8_config(T * K, E).block_m
    )
    sizes = warmup_tokens(T, K, E, True, LARGE, quantized=True, q8_mma=q8, cached_grouped=big, cached_mma=True)
    assert {choose_q8_config(t * K, E) for t in sizes if t >= 2} >= {choose_q8_config(t * K, E) for t in range(2, T)}


def test_every_step_size_takes_the_waves_with_the_option():
    K, E = 4, 16
    big = cached_grouped_tokens(config(E, K), BF16, False, LARGE)
    for T in (2, GROUPED_MAX_TOKENS, GROUPED_MAX_TOKENS + 1, 512, 2048):
        expected = GROUPED if T <= GROUPED_MAX_TOKENS else CUBLAS
        assert choose_strategy(T, K, E, True, True) is expected
        assert choose_strategy(T, K, E, True, True, cached_grouped=big) is GROUPED
    assert GROUPED in ON_DEVICE and CUBLAS not in ON_DEVICE  # captured whole: no host break left in the step
    assert reachable_strategies(2048, K, E, True, True, cached_grouped=big) == {GROUPED}
    assert choose_strategy(GROUPED_MAX_TOKENS + 1, K, E, False, True, cached_grouped=big) is not GROUPED  # resident


def test_the_sorted_rows_are_laid_out_for_the_largest_step():
    cfg, T = config(), 512
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    layouts = {
        name: layout_workspace(cfg, BF16, T, 8, 64, len(cfg.moe_layers), cached=True, cached_mma=True, cached_grouped=g)
        for name, g in (("default", GROUPED_MAX_TOKENS), ("large", cached_grouped_tokens(cfg, BF16, False, LARGE)))
    }
    rows = layouts["large"]["mma_sorted_ids"][0][0]
    assert rows >= max_rows(T * K, E, choose_config(T * K, E).block_m)
    assert layouts["default"]["mma_sorted_ids"][0][0] < rows
    assert layouts["large"]["mma_xs"][0] == (rows, cfg.hidden_size) and layouts["large"]["mma_h"][0][0] == rows


def decoder(options: CudaOptions, laid_out: CudaOptions, max_tokens: int = 256, all_8bit: bool = False):
    d = CudaDecoder.__new__(CudaDecoder)
    d.config, d.max_tokens = config(), max_tokens
    d.weights = SimpleNamespace(dtype=BF16, quantized=all_8bit, all_8bit=all_8bit)
    laid_out_grouped = d.strategies.cached_grouped(laid_out)
    d.cached = SimpleNamespace(
        slots=SimpleNamespace(slots_per_layer=4),
        mma_supported=True,
        mma_possible=True,
        quantized=all_8bit,  # CachedExperts makes CACHED_CUBLAS's 8-bit scratch only where a step can take it
        dense=object() if dense_scratch_needed(all_8bit, max_tokens, laid_out_grouped) else None,
    )
    d.cached.make_dense_scratch = lambda: setattr(d.cached, "dense", d.cached.dense or object())
    d.model = SimpleNamespace(
        options=options, use_options=lambda o: setattr(d.model, "options", o), attention_8bit=None
    )
    d.workspace_strategies = d.strategies.reachable(laid_out, True) | {
        GROUPED,
        CUBLAS,
    }  # as CudaDecoder.__init__ lays out
    d.workspace_cached_grouped = laid_out_grouped
    d.drop_graphs = lambda: None
    return d


def test_the_8bit_dense_scratch_is_made_only_where_a_step_takes_per_expert_cublas():
    assert not dense_scratch_needed(False, 4096, GROUPED_MAX_TOKENS)  # bf16 slots are read as they are
    assert dense_scratch_needed(True, GROUPED_MAX_TOKENS + 1, GROUPED_MAX_TOKENS)
    assert not dense_scratch_needed(True, 4096, MAX_ASSIGNMENTS // 2)  # the 8-bit waves take every step
    assert not dense_scratch_needed(True, GROUPED_MAX_TOKENS, GROUPED_MAX_TOKENS)


def test_set_options_makes_the_8bit_scratch_when_it_turns_to_per_expert_cublas():
    """An all-8-bit cached engine laid out with the 8-bit waves for every step holds no dense scratch; options that
    send large steps back to CACHED_CUBLAS (cached_mma_large off) make it in set_options, between steps."""
    d = decoder(LARGE, LARGE, all_8bit=True)
    assert d.cached.dense is None and d._strategy(GROUPED_MAX_TOKENS + 1) is GROUPED
    d.set_options(LARGE)
    assert d.cached.dense is None
    d.set_options(SMALL)
    assert d.cached.dense is not None and d._strategy(GROUPED_MAX_TOKENS + 1) is CUBLAS
    small = decoder(SMALL, SMALL, all_8bit=True)  # laid out for per-expert cuBLAS: the scratch is there at once
    assert small.cached.dense is not None


def test_set_options_names_a_scratch_the_device_could_not_give():
    d = decoder(LARGE, LARGE, all_8bit=True)

    def full():
        raise MemoryError("out of device memory")

    d.cached.make_dense_scratch = full
    with pytest.raises(ValueError) as error:
        d.set_options(SMALL)
    assert "one-expert dense scratch the device could not give (MemoryError)" in str(error.value)
    assert "\n" not in str(error.value) and d.options == LARGE  # the old options stay


def test_decoder_steps_follow_the_option():
    assert decoder(SMALL, SMALL)._strategy(GROUPED_MAX_TOKENS + 1) is CUBLAS
    assert decoder(LARGE, LARGE)._strategy(GROUPED_MAX_TOKENS + 1) is GROUPED
    assert not decoder(LARGE, LARGE).blocks_host(200) and decoder(SMALL, SMALL).blocks_host(200)


def test_set_options_refuses_the_option_without_its_rows_and_takes_it_back_off():
    d = decoder(SMALL, SMALL)
    with pytest.raises(ValueError) as error:
        d.set_options(LARGE)
    assert "cached_grouped" in str(error.value) and "\n" not in str(error.value)
    d = decoder(LARGE, LARGE)
    d.set_options(SMALL)  # off: large steps take per-expert cuBLAS on the same rows
    assert d.options == SMALL and d._strategy(GROUPED_MAX_TOKENS + 1) is CUBLAS
    d.set_options(LARGE)  # and back on: laid out with it
    assert d.options == LARGE and d._strategy(GROUPED_MAX_TOKENS + 1) is GROUPED


def test_warmup_loads_every_tile_config_the_large_waves_take():
    """With the option, a cached step's tensor-core waves take the tile config of its size (choose_config): the
    warm-up runs the smallest step of each, so serving without graphs compiles nothing either."""
    from expert_service.cuda.moe_strategy import warmup_tokens

    K, E, T = 2, 8, 2048  # mixtral-like: few experts, so large steps reach the widest tiles
    big = cached_grouped_tokens(config(E, K), BF16, False, LARGE)
    sizes = warmup_tokens(T, K, E, True, LARGE, cached_grouped=big, cached_mma=True)
    needed = {choose_config(t * K, E) for t in range(2, T + 1)}
    assert {choose_config(t * K, E) for t in sizes if t >= 2} >= needed
    if len(needed) > 1:  # (the CUDA simulator has one tile config for every size)
        without = warmup_tokens(T, K, E, True, LARGE)  # the resident walk alone misses some of them
        assert {choose_config(t * K, E) for t in without if t >= 2} < needed


def test_an_engine_of_small_steps_takes_the_option_without_new_rows():
    """Steps of at most GROUPED_MAX_TOKENS already run in waves: its rows fit either way, so set_options accepts it."""
    d = decoder(SMALL, SMALL, max_tokens=GROUPED_MAX_TOKENS)
    d.set_options(LARGE)
    assert d.options == LARGE
