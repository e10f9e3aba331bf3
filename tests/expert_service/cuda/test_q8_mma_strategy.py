"""Where Q8_MMA (the grouped tensor-core kernel on 8-bit experts) is chosen (no GPU): only for layers whose every
expert is int8 / fp8 with bf16 dense weights and D, F multiples of 16; between the CudaOptions thresholds, which
differ for few-expert layers; the workspace holds its sorted rows exactly when a step can take it; a decoder
refuses options that reach a strategy its workspace lacks. W8A8 (CudaOptions.q8_activations): which layers and tiles
take it, its workspace rows, and the refusal to switch it on without them."""

from types import SimpleNamespace

import numpy as np
import pytest

from common.models import config_from_hf
from expert_service.cuda import moe_grouped_mma, moe_strategy
from expert_service.cuda.decoder import CudaDecoder
from expert_service.cuda.moe_grouped_mma import W8A8Kind, every_layer_w8a8, grouped_tile, w8a8_kind
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
from expert_service.kernels.expert_quant import CODE_BF16, CODE_FP8, CODE_INT8, SCALE_BLOCK, SCALE_CHANNEL, SCALE_NONE
from expert_service.kernels.moe_align import max_rows, max_tiles
from expert_service.kernels.moe_gemm_q8mma import choose_config as choose_q8_config
from expert_service.kernels.moe_gemm_w8a8 import config_for as w8a8_config
from expert_service.kernels.moe_gemm_wgmma import choose_config as choose_wgmma_config
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


def decoder_laid_out_for_defaults(cfg):
    """A decoder of an all-8-bit bf16-dense model, 512-token steps, its workspace laid out for the default options."""
    d = CudaDecoder.__new__(CudaDecoder)
    d.config, d.cached, d.max_tokens = cfg, None, 512
    d.weights = SimpleNamespace(dtype=np.dtype(np.uint16), quantized=True, all_8bit=True)
    d.workspace_strategies = d.strategies.reachable(CudaOptions(), False)
    d.workspace_w8a8_min_rows = CudaOptions().w8a8_min_rows  # the defaults run W8A8 where it applies
    d.model = SimpleNamespace(attention_8bit=None)
    return d


def test_set_options_refuses_strategies_the_workspace_lacks():
    d = decoder_laid_out_for_defaults(config(128))
    with pytest.raises(ValueError, match=r"^cuda_options: .*\(cublas_per_expert\)"):
        d.set_options(CudaOptions(q8_mma_max_tokens=100))


def test_set_options_refuses_what_the_8bit_attention_buffers_cannot_run_before_changing_anything():
    d = decoder_laid_out_for_defaults(config(128))
    asked = []
    why = "cuda_options: attention_8bit_dense_rows 8 needs the widening scratch"
    d.model = SimpleNamespace(attention_8bit=SimpleNamespace(refusal=lambda o: asked.append(o) or why))
    d.drop_graphs = lambda: pytest.fail("graphs dropped before the refusal")
    options = CudaOptions(attention_8bit_dense_rows=8)
    with pytest.raises(ValueError, match="^cuda_options: attention_8bit_dense_rows 8 needs the widening scratch$"):
        d.set_options(options)
    assert asked == [options]


# ---- W8A8 (CudaOptions.q8_activations) ----
INT8_CH, FP8_CH, FP8_BLOCK = (CODE_INT8, SCALE_CHANNEL), (CODE_FP8, SCALE_CHANNEL), (CODE_FP8, SCALE_BLOCK)


@pytest.mark.parametrize(
    "kinds,F,D,want",
    [
        ((INT8_CH,), 256, 128, W8A8Kind(CODE_INT8, False)),
        ((FP8_CH,), 256, 128, W8A8Kind(CODE_FP8, False)),
        ((FP8_BLOCK,), 256, 128, W8A8Kind(CODE_FP8, True)),
        ((INT8_CH, FP8_BLOCK), 256, 128, None),  # one launch, one 8-bit type: mixed layers keep the widening kernel
        (((CODE_BF16, SCALE_NONE),), 256, 128, None),
        ((INT8_CH,), 192, 128, None),  # a 128-feature step must cover F and D whole
        ((INT8_CH,), 256, 64, None),
    ],
)
def test_w8a8_kind_takes_one_8bit_kind_of_whole_steps(kinds, F, D, want):
    assert w8a8_kind(kinds, F, D, 4096) == want
    assert want is None or w8a8_kind(kinds, F, D, 4096, 40) == want._replace(min_rows=40)
    assert w8a8_kind(kinds, F, D, 4104) is None  # blocks not 16-byte aligned


def test_w8a8_tile_on_hopper_only(monkeypatch):
    n, E, F, D = 96 * 8, 8, 256, 128
    assert grouped_tile(n, E, F, D, True, True, W8A8Kind(CODE_FP8, True)) == choose_q8_config(n, E)  # no sm_90 here
    monkeypatch.setattr(moe_grouped_mma, "hopper", lambda: True)
    assert grouped_tile(n, E, F, D, True, True, W8A8Kind(CODE_FP8, True)) == w8a8_config(True)
    assert grouped_tile(n, E, F, D, True, True, W8A8Kind(CODE_FP8, False)) == w8a8_config(False)
    assert grouped_tile(n, E, F, D, True, True, W8A8Kind(CODE_INT8, False)) == w8a8_config(False)
    assert grouped_tile(n, E, F, D, True, True, None) == choose_wgmma_config(n, E)
    assert grouped_tile(n, E, F, D, True, False, W8A8Kind(CODE_INT8, False)) == choose_q8_config(n, E)  # wgmma off
    assert grouped_tile(8, E, F, D, True, True, W8A8Kind(CODE_INT8, False)) == choose_q8_config(8, E)  # too few rows
    # from w8a8_min_rows: the 64-row tile under WGMMA_MIN_ROWS rows an expert, the 128-row one from there
    narrow, wide = w8a8_config(False, wide=False), w8a8_config(False)
    assert narrow.block_m == 64 and wide.block_m == 128
    assert grouped_tile(32 * 8, E, F, D, True, True, W8A8Kind(CODE_INT8, False, 32)) == narrow
    assert grouped_tile(31 * 8, E, F, D, True, True, W8A8Kind(CODE_INT8, False, 32)) == choose_q8_config(31 * 8, E)
    assert grouped_tile(n, E, F, D, True, True, W8A8Kind(CODE_INT8, False, 32)) == wide
    assert grouped_tile(32 * 8, E, F, D, True, True, W8A8Kind(CODE_FP8, True, 32)) == w8a8_config(True)
    assert w8a8_config(True).block_m == 64 and w8a8_config(True).threads == 256  # promoted
    assert w8a8_config(False).block_m == 128 and w8a8_config(False).threads == 512  # per channel: one set
    assert w8a8_config(True, wide=True) == w8a8_config(True)  # block scales: always narrow


def test_w8a8_workspace_rows_only_when_asked_and_reachable():
    cfg = config(8, D=128, F=256)  # K = 2: steps from 384 tokens have 96 rows an expert (the wgmma tiles)
    args = (cfg, np.dtype(np.uint16), 512, 8, 16, 2)
    tokens = q8_mma_tokens(cfg, True, True, CudaOptions())
    on = layout_workspace(*args, quantized=True, q8_mma=tokens, w8a8_min_rows=96)
    off = layout_workspace(*args, quantized=True, q8_mma=tokens)
    dense = layout_workspace(*args, quantized=False, w8a8_min_rows=96)
    assert "mma_q8_rows" not in off and "mma_q8_rows" not in dense
    rows = on["mma_sorted_ids"][0][0]
    assert on["mma_q8_rows"] == ((rows * 256,), np.dtype(np.uint8)) and on["mma_q8_scales"][0] == (rows,)
    # the 64-row tile of fp8 and int8's 128-row one: the sorted rows cover both at every such step size
    assert rows >= max(max_rows(T * 2, 8, bm) for T in range(384, 513) for bm in (64, 128))
    assert on["mma_tile_expert"][0][0] >= max(max_tiles(T * 2, 8, 64) for T in range(384, 513))


def test_set_options_refuses_w8a8_without_its_rows():
    d = decoder_laid_out_for_defaults(config(128))
    d.workspace_w8a8_min_rows = 0  # laid out with q8_activations off
    with pytest.raises(ValueError, match=r"^cuda_options: .*\(q8_mma\)"):
        d.set_options(CudaOptions(q8_activations=True))
    d.workspace_w8a8_min_rows = 96  # ... and for steps from 96 rows an expert: smaller ones were not laid out
    with pytest.raises(ValueError, match=r"^cuda_options: .*\(q8_mma\)"):
        d.set_options(CudaOptions(w8a8_min_rows=32))


def w8a8_moe(cfg, kinds):
    """A DeviceMoe of an all-8-bit bf16-dense model whose one MoE layer has these expert kinds."""
    from expert_service.cuda.moe import DeviceMoe

    moe = DeviceMoe.__new__(DeviceMoe)
    layer = cfg.moe_layers[0]
    moe.config, moe.cached, moe.bf16 = cfg, None, True
    moe.weights = SimpleNamespace(
        dtype=np.dtype(np.uint16),
        quantized=True,
        all_8bit=True,
        experts={layer: SimpleNamespace(shape=(8, 4096), dtype=np.dtype(np.uint8))},  # as the layer's uint8 blocks
        expert_kinds={layer: kinds},
        w8a8_layers=every_layer_w8a8(
            cfg.moe_intermediate_size, cfg.hidden_size, {layer: 0}, {layer: kinds}, {layer: 4096}
        ),
    )
    moe.options = CudaOptions()
    return moe, layer


def test_runs_w8a8_labels_the_steps_that_take_it(monkeypatch):
    """DeviceMoe.runs_w8a8 (bench/engine.py labels steps with it): only with the option on (the default), an sm_90
    device, a Q8_MMA step of w8a8_min_rows+ rows an expert (32 by default: 128+ tokens here) and a layer of one
    8-bit kind."""
    cfg = config(8, D=128, F=256)  # K = 2: Q8_MMA from 2 tokens up to 512; the wgmma tile from 384
    moe, layer = w8a8_moe(cfg, (INT8_CH,))
    assert not moe.runs_w8a8(layer, 400)  # no sm_90 here
    monkeypatch.setattr(moe_grouped_mma, "hopper", lambda: True)
    monkeypatch.setattr(moe_strategy, "hopper", lambda: True)
    assert moe.runs_w8a8(layer, 400) and moe.runs_w8a8(layer, 512)
    assert moe.runs_w8a8(layer, 200) and moe.runs_w8a8(layer, 128)  # 50 and 32 rows an expert: the 64-row tile
    assert not moe.runs_w8a8(layer, 127)  # under 32 rows an expert: the mma.sync tile
    moe.options = CudaOptions(w8a8_min_rows=96)
    assert moe.runs_w8a8(layer, 384) and not moe.runs_w8a8(layer, 383)
    moe.options = CudaOptions()
    # every layer runs W8A8: Q8_MMA's few-expert bound is lifted, large steps take it too
    assert moe.runs_w8a8(layer, 513) and moe.runs_w8a8(layer, 4096)
    moe.options = CudaOptions(q8_activations=False)
    assert not moe.runs_w8a8(layer, 400)
    moe.options = CudaOptions(q8_activations=True, wgmma_experts=False)
    assert not moe.runs_w8a8(layer, 400)
    moe, layer = w8a8_moe(cfg, (INT8_CH, FP8_BLOCK))
    assert not moe.runs_w8a8(layer, 400)  # two 8-bit kinds in one layer
    assert moe.q8_mma == (2, 512)  # ... keep the bound: past it, dequantise + cuBLAS beats widening


def test_w8a8_everywhere_lifts_the_few_expert_bound(monkeypatch):
    cfg = config(8, D=128, F=256)
    moe, layer = w8a8_moe(cfg, (FP8_BLOCK,))
    assert moe.q8_mma == (2, 512)  # no sm_90 here
    monkeypatch.setattr(moe_strategy, "hopper", lambda: True)
    assert moe.q8_mma == (2, CudaOptions().q8_mma_max_tokens)
    moe.options = CudaOptions(q8_activations=False)
    assert moe.q8_mma == (2, 512)
    moe.options = CudaOptions(wgmma_experts=False)
    assert moe.q8_mma == (2, 512)
    assert q8_mma_tokens(cfg, True, True, CudaOptions(), w8a8=True) == (2, 1 << 20)


def test_every_layer_w8a8_needs_each_layer_resident_and_of_one_kind():
    F, D, one = 256, 128, {3: (FP8_BLOCK,), 5: (INT8_CH,)}
    resident, strides = {3: 0, 5: 0}, {3: 4096, 5: 4096}
    assert every_layer_w8a8(F, D, resident, one, strides)  # one kind a layer (layers may differ)
    assert not every_layer_w8a8(F, D, {3: 0}, one, strides)  # layer 5 behind the expert cache
    assert not every_layer_w8a8(F, D, resident, one, {3: 4096, 5: 4100})  # blocks not 16-byte aligned
    assert not every_layer_w8a8(F, D, resident, {**one, 5: (INT8_CH, FP8_CH)}, strides)  # two kinds in a layer
    assert not every_layer_w8a8(192, D, resident, one, strides)  # F not whole 128-feature steps
    assert not every_layer_w8a8(F, D, {}, {}, {})  # no 8-bit layer at all
