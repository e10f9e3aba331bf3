"""The expert cache's one-token steps on the GEMV kernels (CACHED_GEMV, GPU only), on fp32 tiny models and on 8-bit
and mixed experts.

A session of one one-token prompt runs every step at T = 1. With at least K slots a layer (K: experts per token)
each step's experts fit one wave and take CACHED_GEMV: the resident engine's one-token kernels (the GEMV expert
kernels, or moe_q8 by slot) on the slot buffer, so its outputs equal the resident engine's bitwise, misses served
mid-step included (exactly K slots: LRU churn). One slot short of K takes the grouped waves (CACHED_GROUPED), another
summation order: there the check is the tolerance the cached-vs-resident comparisons use (test_expert_cache.py) and
the same greedy tokens; with CudaOptions.cached_gemv off, K slots take the grouped waves too, bitwise equal to K-1
slots. Graph replays equal eager passes bitwise.
"""

from dataclasses import replace

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.cuda.moe_strategy import MoeStrategy
from expert_service.engine.cuda_options import CudaOptions
from expert_service.experts.cache import CacheStats
from expert_service.kernels.expert_quant import CODE_INT8, SCALE_CHANNEL
from expert_service.tools.tiny_model import make_tiny
from tests.expert_service.cuda.test_quantized import quantized_model
from tests.helpers import rel_error, run_session

pytestmark = pytest.mark.gpu

ONE_TOKEN = (np.array([17]),)  # prefill and decodes are all one-token steps
CASES = ["mixtral", "qwen3_moe", "qwen2_moe", "mixtral-int8", "qwen3_moe-mixed"]


@pytest.fixture(scope="module", params=CASES)
def model(request, tmp_path_factory):
    family, _, variant = request.param.partition("-")
    path = tmp_path_factory.mktemp(request.param)
    if variant:
        return ModelDir.open(quantized_model(path, family, variant))
    return ModelDir.open(make_tiny(path / "m", family=family, seed=1))


def session(model, slots: int, **overrides):
    """(logits, tokens, stats, engine) of the one-token session; the engine's T = 1 strategy checked by the caller."""
    logits, tokens, stats, _, engine = run_session(
        model, backend="cuda", prompts=ONE_TOKEN, expert_cache_slots=slots, **overrides
    )
    return logits, tokens, stats, engine


def strategy(engine) -> MoeStrategy:
    return engine.decoder._strategy(1)


def bitwise(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("prefetch", ["none", "lookahead"])
def test_cached_gemv_equals_resident_gemv_bitwise(model, prefetch):
    K = model.config.num_experts_per_tok
    ref_logits, ref_tokens, ref_stats, _, resident = run_session(model, backend="cuda", prompts=ONE_TOKEN)
    assert all(s is None for s in ref_stats)
    resident_strategy = strategy(resident)
    assert resident_strategy in (MoeStrategy.GEMV, MoeStrategy.Q8), resident_strategy
    resident.decoder.close()
    for slots in (K, K + 1):
        logits, tokens, stats, engine = session(model, slots, prefetch=prefetch)
        assert strategy(engine) is MoeStrategy.CACHED_GEMV and 1 in engine.decoder.graphs
        assert tokens == ref_tokens and bitwise(logits, ref_logits), f"{slots} slots differ from resident"
        if slots == K and prefetch == "none":  # every expert a step needs was planned into a slot it then read
            assert stats[0].misses > 0 and sum(s.misses for s in stats[1:]) > 0, "no churn after the first step"
        engine.decoder.close()


def test_across_strategies_same_tokens_within_tolerance(model):
    K = model.config.num_experts_per_tok
    fp32 = CudaOptions(q8_decode_activations=False)  # the grouped waves never run on int8 activations
    gemv_logits, gemv_tokens, _, engine = session(model, K, prefetch="none", cuda_options=fp32)
    assert strategy(engine) is MoeStrategy.CACHED_GEMV
    engine.decoder.close()
    grouped = []
    for slots, options in ((K - 1, fp32), (K, replace(fp32, cached_gemv=False))):
        logits, tokens, stats, engine = session(model, slots, prefetch="none", cuda_options=options)
        assert strategy(engine) is MoeStrategy.CACHED_GROUPED, (slots, options)
        assert tokens == gemv_tokens
        assert all(rel_error(a, b) <= 1e-4 for a, b in zip(logits, gemv_logits))
        assert sum(stats, CacheStats()).misses > 0
        grouped.append(logits)
        engine.decoder.close()
    assert bitwise(*grouped), "the grouped waves differ between K-1 and K slots"


def test_graph_replay_equals_eager_pass(model):
    K = model.config.num_experts_per_tok
    runs = []
    for graphs in (True, False):
        logits, tokens, stats, engine = session(model, K, cuda_graphs=graphs, prefetch="lookahead")
        assert strategy(engine) is MoeStrategy.CACHED_GEMV and bool(engine.decoder.graphs) == graphs
        runs.append((logits, tokens, [(s.hits, s.misses, s.prefetches_issued) for s in stats]))
        engine.decoder.close()
    (a, ta, sa), (b, tb, sb) = runs
    assert ta == tb and sa == sb and bitwise(a, b)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_int8_activations_cached_equal_resident_bitwise(model, graphs):
    """CudaOptions.q8_decode_activations: the resident one-token steps of a layer wholly int8 per channel run
    moe_q8_dp4a, and so do the cache's (through the slot map), so the two stay bitwise equal at K and K + 1 slots,
    misses served mid-step; layers of other encodings keep moe_q8 both ways. The option changes the outputs of
    int8 models only."""
    K = model.config.num_experts_per_tok
    on, off = CudaOptions(q8_decode_activations=True), CudaOptions(q8_decode_activations=False)
    ref_logits, ref_tokens, _, _, resident = run_session(
        model, backend="cuda", prompts=ONE_TOKEN, cuda_options=on, cuda_graphs=graphs
    )
    resident.decoder.close()
    plain_logits = run_session(model, backend="cuda", prompts=ONE_TOKEN, cuda_options=off)[0]
    int8 = any(kinds == ((CODE_INT8, SCALE_CHANNEL),) for kinds in resident.decoder.weights.expert_kinds.values())
    assert bitwise(ref_logits, plain_logits) != int8, "the option must change the outputs of int8 layers only"
    for slots in (K, K + 1):
        logits, tokens, stats, engine = session(model, slots, prefetch="none", cuda_options=on, cuda_graphs=graphs)
        assert strategy(engine) is MoeStrategy.CACHED_GEMV
        assert tokens == ref_tokens and bitwise(logits, ref_logits), f"{slots} slots differ from resident"
        assert sum(stats, CacheStats()).misses > 0
        engine.decoder.close()
