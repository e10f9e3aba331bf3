"""Where CACHED_GEMV (the expert cache's one-token step on the GEMV kernels through the slots) is chosen (no GPU):
one token whose K experts fit a layer's slots, with CudaOptions.cached_gemv on; the same choice in the decoder and
in the MoE block; the workspace layout does not depend on the option, so set_options may switch it."""

from types import SimpleNamespace

import numpy as np
import pytest

from common.models import config_from_hf
from expert_service.cuda.decoder import CudaDecoder
from expert_service.cuda.linear import GEMV_MAX_TOKENS
from expert_service.cuda.moe_strategy import (
    CAPTURABLE,
    GROUPED_MAX_TOKENS,
    ON_DEVICE,
    MoeStrategy,
    cached_gemv_slots,
    choose_strategy,
    reachable_strategies,
)
from expert_service.engine.cuda_options import CudaOptions
from expert_service.tools.tiny_model import tiny_hf_config

GEMV, GROUPED, CUBLAS = MoeStrategy.CACHED_GEMV, MoeStrategy.CACHED_GROUPED, MoeStrategy.CACHED_CUBLAS


def cache(slots: int):
    return SimpleNamespace(slots=SimpleNamespace(slots_per_layer=slots))


@pytest.mark.parametrize("quantized,bf16", [(False, False), (False, True), (True, True)])
def test_one_token_fitting_the_slots_takes_gemv(quantized, bf16):
    K, E = 8, 128
    for slots in (K, K + 1, E):
        assert choose_strategy(1, K, E, True, bf16, quantized, cache_slots=slots) is GEMV
    for slots in (0, 1, K - 1):  # one slot short of K: the experts may need two waves
        assert choose_strategy(1, K, E, True, bf16, quantized, cache_slots=slots) is GROUPED
    for T in (GEMV_MAX_TOKENS + 1, 2, GROUPED_MAX_TOKENS):  # more tokens: the grouped waves at any slot count
        assert choose_strategy(T, K, E, True, bf16, quantized, cache_slots=E) is GROUPED
    assert choose_strategy(GROUPED_MAX_TOKENS + 1, K, E, True, bf16, quantized, cache_slots=E) is CUBLAS
    # the resident path ignores the cache's slots
    assert choose_strategy(1, K, E, False, bf16, quantized, cache_slots=E) is not GEMV


def test_graph_capture_stays_whole():
    assert GEMV in ON_DEVICE and GEMV in CAPTURABLE


def test_the_option_and_the_slot_count_decide():
    assert CudaOptions().cached_gemv is True
    assert cached_gemv_slots(cache(24), CudaOptions()) == 24
    assert cached_gemv_slots(cache(24), CudaOptions(cached_gemv=False)) == 0
    assert cached_gemv_slots(None, CudaOptions()) == 0


def decoder(options: CudaOptions, slots: int, max_tokens: int = 4):
    cfg = config_from_hf({**tiny_hf_config("qwen3_moe"), "num_experts": 16, "num_experts_per_tok": 4})
    d = CudaDecoder.__new__(CudaDecoder)
    d.config, d.cached, d.max_tokens = cfg, cache(slots), max_tokens
    d.weights = SimpleNamespace(dtype=np.dtype(np.float32), quantized=False, all_8bit=False)
    d.model = SimpleNamespace(options=options)
    return d


def test_decoder_strategy_follows_the_option_and_slots():
    assert decoder(CudaOptions(), slots=4)._strategy(1) is GEMV
    assert decoder(CudaOptions(), slots=3)._strategy(1) is GROUPED
    assert decoder(CudaOptions(cached_gemv=False), slots=4)._strategy(1) is GROUPED
    assert decoder(CudaOptions(), slots=4)._strategy(2) is GROUPED


def test_set_options_switches_cached_gemv_either_way():
    """The layout is CACHED_GROUPED's whatever the option: a decoder laid out with it on accepts it off, and back
    (max_tokens 1: a decoder whose every step could take the GEMV)."""
    for first in (True, False):
        d = decoder(CudaOptions(cached_gemv=first), slots=16, max_tokens=1)
        d.workspace_strategies = d.strategies.reachable(d.options, True)
        assert d.workspace_strategies == {GROUPED}
        assert d.strategies.reachable(CudaOptions(cached_gemv=not first), True) <= d.workspace_strategies
    assert reachable_strategies(1, 4, 16, True, False) == {GROUPED}


def test_int8_activations_follow_the_option_and_the_layer_kinds():
    """DeviceMoe.int8_activations (the resident moe_q8 steps and the cache's one-token ones): only with
    q8_decode_activations on, only on layers whose experts are all int8 per channel."""
    from expert_service.cuda.moe import DeviceMoe
    from expert_service.kernels.expert_quant import CODE_FP8, CODE_INT8, SCALE_BLOCK, SCALE_CHANNEL

    int8 = (CODE_INT8, SCALE_CHANNEL)
    moe = DeviceMoe.__new__(DeviceMoe)
    kinds = {0: (int8,), 1: (int8, (CODE_FP8, SCALE_BLOCK)), 2: ((CODE_FP8, SCALE_CHANNEL),)}  # 3: a bf16 layer
    moe.weights = SimpleNamespace(expert_kinds=kinds)
    moe.options = CudaOptions(q8_decode_activations=True)
    assert [moe.int8_activations(i) for i in range(4)] == [True, False, False, False]
    moe.options = CudaOptions()
    assert not any(moe.int8_activations(i) for i in range(4))


def test_cached_gemv_on_int8_activations_reads_the_slots_of_wave_0(monkeypatch):
    """CachedExperts._gemv with int8_activations: moe_q8_dp4a's two launches, both through wave 0's slot map, with
    the layer's meta rows and K rows of the part-max buffer; without it an 8-bit layer keeps moe_q8."""
    from expert_service.cuda import moe_cached
    from expert_service.cuda.moe_cached import CachedExperts

    calls = []
    for name in ("launch_dp4a_gate_up", "launch_dp4a_down", "launch_q8_gate_up", "launch_q8_down"):
        monkeypatch.setattr(moe_cached, name, lambda *a, _n=name, **kw: calls.append((_n, a, kw)))
    K, F, D = 4, 32, 48
    cached = CachedExperts.__new__(CachedExperts)
    cached.config = SimpleNamespace(num_experts_per_tok=K, moe_intermediate_size=F, hidden_size=D)
    part_max, gate, wave0, meta = np.zeros((8, 3)), np.zeros((K, F)), np.arange(16), object()
    cached.ws = SimpleNamespace(moe_gate=gate, moe_gate_part_max=part_max)
    cached.slots = SimpleNamespace(wave_slots=lambda layer, wave: wave0 if (layer, wave) == (5, 0) else None)
    cached.weights = SimpleNamespace(expert_meta={5: meta}, expert_kinds={5: ((1, 1),)})
    cached.stream, cached.quantized = "stream", True
    x, ids, buffer, out = object(), object(), object(), object()
    cached._gemv(5, x, ids, buffer, out, int8_activations=True)
    assert [c[0] for c in calls] == ["launch_dp4a_gate_up", "launch_dp4a_down"]
    (_, up, up_kw), (_, down, down_kw) = calls
    for kw in (up_kw, down_kw):
        assert kw["stream"] == "stream" and kw["slot_of"] is wave0 and set(kw) == {"stream", "slot_of"}
    assert all(a is b for a, b in zip(up[:4], (x, ids, buffer, meta))) and up[4:6] == (F, D)
    assert all(a.base is b and len(a) == K for a, b in ((up[6], gate), (up[7], part_max), (down[0], gate)))
    assert down[1].base is part_max and len(down[1]) == K and down[5:7] == (F, D)
    assert all(a is b for a, b in zip(down[2:5] + down[7:], (ids, buffer, meta, out)))
    calls.clear()
    cached._gemv(5, x, ids, buffer, out)
    assert [c[0] for c in calls] == ["launch_q8_gate_up", "launch_q8_down"]
