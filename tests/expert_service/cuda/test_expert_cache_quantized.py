"""The cuda expert cache on 8-bit and mixed-dtype experts (GPU only): int8, fp8 with 128x128 block scales, and a
mixed model (fp8, int8, bfloat16 and float32 experts; its layers have different strides), and int8 experts with an
int8 LM head.

Slots hold the blocks' bytes as stored and the kernels find each expert's dtype through its meta row, so the
cached path runs the same kernel per row whatever the number of slots: bitwise equal at 1, 2 and 3 slots, graphs
bitwise equal to eager passes. Against the resident engine on the same model (moe_q8 by slot or grouped, and
dequantised groups for cuBLAS above 64 tokens) the check is the fp32 tolerance, against the cpu backend the
8-bit one (test_quantized.py), with the same greedy tokens everywhere.
"""

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.cuda.staging import GRAPH_BUCKETS
from expert_service.experts.cache import CacheStats
from tests.expert_service.cuda.test_expert_cache import LONG_PROMPTS, check_no_allocations_during_cached_steps
from tests.expert_service.cuda.test_quantized import EXACT_ACTIVATIONS, TOLERANCE, quantized_model
from tests.helpers import SESSION_PROMPTS, exact_plans, rel_error, run_session

pytestmark = pytest.mark.gpu

# (family, experts, LM head: None for the dense dtype; an 8-bit head is dense, resident whatever the cache holds)
CASES = [
    ("mixtral", "int8", None),
    ("mixtral", "fp8-block128", None),
    ("qwen3_moe", "mixed", None),
    ("qwen3_moe", "int8", "int8"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: "-".join(v for v in p if v))
def model(request, tmp_path_factory):
    family, variant, head = request.param
    root = tmp_path_factory.mktemp(f"{family}-{variant}")
    model = ModelDir.open(quantized_model(root, family, variant, head=head))
    assert (model.head_format and model.head_format.dtype) == head
    return model


def _check_accounting(model, stats, traces):
    """Each copy moves its layer's stride; padding tokens route too (at most K more experts per layer)."""
    K = model.config.num_experts_per_tok
    strides = [model.expert_strides[layer] for layer in model.config.moe_layers]
    for s, trace in zip(stats, traces):
        real = sum(len(np.unique(ids)) for ids in trace.expert_ids.values())
        assert real <= s.hits + s.misses <= real + K * len(trace.expert_ids)
        copies = s.misses + s.prefetches_issued
        assert min(strides) * copies <= s.bytes_copied <= max(strides) * copies
        if len(set(strides)) == 1:
            assert s.bytes_copied == copies * strides[0]


@pytest.mark.parametrize("prompts", [SESSION_PROMPTS, LONG_PROMPTS], ids=["short", "long"])
def test_every_cache_size_bitwise_equal_and_matches_resident_and_cpu(model, prompts):
    exact = dict(cuda_options=EXACT_ACTIVATIONS)  # held to the exact cpu backend
    ref_logits, ref_tokens, ref_stats, traces, resident = run_session(model, backend="cuda", prompts=prompts, **exact)
    assert all(s is None for s in ref_stats) and resident.decoder.weights.quantized
    resident.decoder.close()
    cpu_logits, cpu_tokens = run_session(model, backend="cpu", prompts=prompts)[:2]
    assert ref_tokens == cpu_tokens
    first = None
    for slots in (1, 2, 3):
        logits, tokens, stats, _, engine = run_session(
            model, backend="cuda", prompts=prompts, expert_cache_slots=slots, prefetch="none", **exact
        )
        bucket = next(b for b in GRAPH_BUCKETS if b >= len(prompts))  # the decodes replay their batch bucket
        assert engine.decoder.cached is not None and bucket in engine.decoder.graphs
        assert tokens == ref_tokens == cpu_tokens, f"{slots} slots"
        for a, b, c in zip(logits, ref_logits, cpu_logits):
            assert np.all(np.isfinite(a)) and rel_error(a, b) <= 1e-4 and rel_error(a, c) <= TOLERANCE
        first = logits if first is None else first
        assert all(np.array_equal(a, b) for a, b in zip(logits, first)), f"{slots} slots differ from 1 slot"
        _check_accounting(model, stats, traces)
        if slots == 1:  # one slot: every replayed decode step misses, and serves its misses mid-step
            assert all(s.misses > 0 for s in stats[2:])
        engine.decoder.close()


def test_graph_replay_equals_eager_pass(model):
    for prompts in (SESSION_PROMPTS, LONG_PROMPTS):
        runs = []
        for graphs in (True, False):
            logits, tokens, stats, _, engine = run_session(
                model, backend="cuda", prompts=prompts, expert_cache_slots=2, cuda_graphs=graphs
            )
            assert bool(engine.decoder.graphs) == graphs
            runs.append((logits, tokens, [(s.hits, s.misses, s.prefetches_issued) for s in stats]))
            engine.decoder.close()
        (a, ta, sa), (b, tb, sb) = runs
        assert ta == tb and sa == sb and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_prefetch_changes_only_counters(model):
    """Right plans and wrong ones (every id shifted) with lookahead: the copies land in slots the waves read,
    the outputs stay bitwise those of no prefetch."""
    base = run_session(model, backend="cuda", expert_cache_slots=1, prefetch="none")
    E = model.config.num_experts
    right = exact_plans(base[3], E)
    wrong = exact_plans([type(t)(expert_ids={k: (v + 1) % E for k, v in t.expert_ids.items()}) for t in base[3]], E)
    for plans in (right, wrong):
        logits, tokens, stats, traces, engine = run_session(
            model, plans, backend="cuda", expert_cache_slots=1, prefetch="plan,lookahead"
        )
        assert tokens == base[1] and all(np.array_equal(a, b) for a, b in zip(logits, base[0]))
        _check_accounting(model, stats, traces)
        total = sum(stats, CacheStats())
        assert 0 < total.prefetches_issued and total.prefetches_used <= total.prefetches_issued
        engine.decoder.close()


@pytest.mark.serial
def test_no_device_allocations_during_cached_quantized_steps(tmp_path, monkeypatch):
    model = ModelDir.open(quantized_model(tmp_path, "qwen3_moe", "mixed"))
    check_no_allocations_during_cached_steps(model, monkeypatch).decoder.close()


@pytest.fixture(scope="module", params=["int8", "mixed-8bit"])
def all_8bit_model(request, tmp_path_factory):
    """bf16 dense weights with every expert 8-bit (int8; int8 and fp8 of both scale schemes): the models whose
    cached waves run on moe_gemm_q8mma."""
    root = tmp_path_factory.mktemp(f"mixtral-{request.param}-bf16")
    return ModelDir.open(quantized_model(root, "mixtral", request.param, dense="bfloat16"))


@pytest.mark.parametrize("prompts", [SESSION_PROMPTS, LONG_PROMPTS], ids=["short", "long"])
def test_8bit_tensor_core_waves_equal_the_resident_engine(all_8bit_model, prompts):
    """Every expert 8-bit: the cache's grouped waves (and, with cached_mma_large, its prompt step of 150 tokens) run
    moe_gemm_q8mma through tile -> slot maps, the kernel the resident engine's steps of 2 tokens or more take
    (Q8_MMA), each tile computed the same way whatever the wave: logits bitwise the resident engine's at 1, 2 and
    3 slots, with graphs and eagerly; moe_q8's waves (cached_mma off, fp32 activations) on the prompt step within
    the bf16 tolerance (later steps may follow other greedy tokens: the two round differently)."""
    from expert_service.cuda.moe_strategy import MoeStrategy
    from expert_service.engine.cuda_options import CudaOptions

    T = sum(len(p) for p in prompts)
    ref_logits, ref_tokens, _, _, resident = run_session(all_8bit_model, backend="cuda", prompts=prompts)
    assert resident.decoder._strategy(T) is MoeStrategy.Q8_MMA
    resident.decoder.close()
    slow = run_session(
        all_8bit_model,
        backend="cuda",
        prompts=prompts,
        expert_cache_slots=2,
        prefetch="none",
        cuda_options=CudaOptions(cached_mma=False),
    )
    assert not slow[4].decoder.cached.mma_possible
    slow[4].decoder.close()
    for slots, graphs in ((1, True), (2, True), (3, True), (2, False)):
        logits, tokens, stats, _, engine = run_session(
            all_8bit_model, backend="cuda", prompts=prompts, expert_cache_slots=slots, cuda_graphs=graphs
        )
        assert engine.decoder.cached.mma_possible and engine.decoder._strategy(T) is MoeStrategy.CACHED_GROUPED
        assert stats[0].misses > 0  # the prompt step's experts were fetched mid-step
        assert tokens == ref_tokens, f"{slots} slots, graphs={graphs}"
        assert all(np.array_equal(a, b) for a, b in zip(logits, ref_logits)), f"{slots} slots, graphs={graphs}"
        assert rel_error(logits[0], slow[0][0]) <= 1e-2
        engine.decoder.close()
