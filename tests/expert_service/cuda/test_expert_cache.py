"""The expert cache on the cuda backend (GPU only): the slot map, copies and waves decided on the device, cached
steps replayed as CUDA graphs, prefetch on a side stream.

The cached path runs every step of two or more tokens through the same expert kernels (grouped kernels up to 64
tokens, per-expert cuBLAS above), and these sessions' steps all have two or more (two or three prompts), so their
outputs are bitwise equal at every number of slots (one-token steps, whose strategy depends on the slot count, are
test_expert_cache_gemv.py's), and a replayed graph launches what the
eager pass launched, so graphs and eager passes are bitwise equal too; the resident path picks other kernels by
step size (all-experts GEMMs, a different reduction order), so against it, and against the cpu backend, the check
is the fp32 tolerance and identical greedy tokens.
"""

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.cuda.staging import GRAPH_BUCKETS
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.experts.cache import CacheStats
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import SESSION_PROMPTS, bf16_tiny, exact_plans, rel_error, run_session

pytestmark = pytest.mark.gpu

LONG_PROMPTS = SESSION_PROMPTS + (np.arange(90) * 7 % 250 + 3,)  # a 121-token step: per-expert cuBLAS (fp32)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe"])
def family_model(request, tmp_path_factory):
    return ModelDir.open(make_tiny(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=1))


def _check_accounting(stats, traces, block, K):
    """Counts come from the device: the padding tokens of a bucket route too (identical tokens, so at most K more
    experts per layer than the real tokens need)."""
    for s, trace in zip(stats, traces):
        real = sum(len(np.unique(ids)) for ids in trace.expert_ids.values())
        assert real <= s.hits + s.misses <= real + K * len(trace.expert_ids)
        assert s.bytes_copied == (s.misses + s.prefetches_issued) * block
        assert s.stall_seconds == 0.0  # not measured: the host never waits on a copy


@pytest.mark.parametrize("prompts", [SESSION_PROMPTS, LONG_PROMPTS], ids=["short", "long"])
def test_every_cache_size_bitwise_equal_and_close_to_resident(family_model, prompts):
    ref_logits, ref_tokens, ref_stats, traces, _ = run_session(family_model, backend="cuda", prompts=prompts)
    assert all(s is None for s in ref_stats)
    cpu_logits, cpu_tokens = run_session(family_model, backend="cpu", prompts=prompts)[:2]
    assert ref_tokens == cpu_tokens
    K = family_model.config.num_experts_per_tok
    first = None
    for slots in (1, 2, 3):
        logits, tokens, stats, _, engine = run_session(
            family_model, backend="cuda", prompts=prompts, expert_cache_slots=slots, prefetch="none"
        )
        bucket = next(b for b in GRAPH_BUCKETS if b >= len(prompts))  # the decodes replay their batch bucket
        assert engine.decoder.cached is not None and bucket in engine.decoder.graphs
        assert tokens == ref_tokens == cpu_tokens
        for a, b, c in zip(logits, ref_logits, cpu_logits):
            assert rel_error(a, b) <= 1e-4 and rel_error(a, c) <= 1e-4
        if first is None:
            first = logits
        assert all(np.array_equal(a, b) for a, b in zip(logits, first)), f"{slots} slots differ from 1 slot"
        _check_accounting(stats, traces, engine.slot_plan.expert_block_bytes, K)
        assert sum(stats, CacheStats()).prefetches_issued == 0
        if slots == 1:  # one slot: every replayed decode step misses, and serves its misses mid-step
            assert all(s.misses > 0 for s in stats[2:])
        engine.decoder.close()


def test_graph_replay_equals_eager_pass(family_model):
    """The same cached session with and without CUDA graphs (decode buckets and prefill token buckets): bitwise."""
    for prompts in (SESSION_PROMPTS, LONG_PROMPTS):
        runs = []
        for graphs in (True, False):
            logits, tokens, stats, _, engine = run_session(
                family_model, backend="cuda", prompts=prompts, expert_cache_slots=2, cuda_graphs=graphs
            )
            assert bool(engine.decoder.graphs) == graphs
            runs.append((logits, tokens, [(s.hits, s.misses, s.prefetches_issued) for s in stats]))
            engine.decoder.close()
        (a, ta, sa), (b, tb, sb) = runs
        assert ta == tb and sa == sb and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("prefetch", ["plan", "lookahead", "plan,lookahead"])
def test_prefetch_changes_only_counters(family_model, prefetch):
    base = run_session(family_model, backend="cuda", expert_cache_slots=1, prefetch="none")
    plans = exact_plans(base[3], family_model.config.num_experts)
    for slots in (1, 2):
        ref = base if slots == 1 else run_session(family_model, backend="cuda", expert_cache_slots=2, prefetch="none")
        logits, tokens, stats, traces, engine = run_session(
            family_model, plans, backend="cuda", expert_cache_slots=slots, prefetch=prefetch
        )
        assert tokens == ref[1] and all(np.array_equal(a, b) for a, b in zip(logits, ref[0]))
        _check_accounting(stats, traces, engine.slot_plan.expert_block_bytes, family_model.config.num_experts_per_tok)
        total = sum(stats, CacheStats())
        assert total.prefetches_used <= total.prefetches_issued
        if "plan" in prefetch:
            assert total.prefetches_used > 0
        engine.decoder.close()


def test_only_passes_whose_experts_fit_the_slots_prefetch_by_default(family_model):
    """As on the cpu backend: with K slots a one-token decode prefetches, the prompt's chunk and a two-sequence
    decode do not (a static choice per token bucket, so replayed graphs keep it), and the outputs stay the resident
    engine's."""
    K = family_model.config.num_experts_per_tok
    prompt = (SESSION_PROMPTS[0],)
    ref_logits, ref_tokens, _, traces, _ = run_session(family_model, backend="cuda", prompts=prompt)
    plans = exact_plans(traces, family_model.config.num_experts)
    for source in ("plan", "plan,lookahead"):
        logits, tokens, stats, _, engine = run_session(
            family_model,
            plans,
            backend="cuda",
            prompts=prompt,
            expert_cache_slots=K,
            prefetch=source,
            prefetch_large_steps=False,
        )
        assert tokens == ref_tokens and all(rel_error(a, b) <= 1e-4 for a, b in zip(logits, ref_logits))
        assert stats[0].prefetches_issued == 0 and sum(stats[1:], CacheStats()).prefetches_used > 0
        engine.decoder.close()
    plans = exact_plans(run_session(family_model, backend="cuda")[3], family_model.config.num_experts)
    two = run_session(
        family_model, plans, backend="cuda", expert_cache_slots=K, prefetch="plan", prefetch_large_steps=False
    )
    assert sum(two[2], CacheStats()).prefetches_issued == 0
    two[4].decoder.close()


@pytest.mark.parametrize("prefetch", ["none", "plan,lookahead"])
def test_lfu_changes_only_which_slots(family_model, prefetch):
    """The frequency-aware policy on the device: other victims, the same outputs bit for bit (a slot holds the
    expert's bytes wherever it sits), counts that add up."""
    lru = run_session(family_model, backend="cuda", expert_cache_slots=1, prefetch=prefetch)
    plans = exact_plans(lru[3], family_model.config.num_experts)
    for slots in (1, 2):
        ref = lru if slots == 1 else run_session(family_model, backend="cuda", expert_cache_slots=2, prefetch=prefetch)
        logits, tokens, stats, traces, engine = run_session(
            family_model, plans, backend="cuda", expert_cache_slots=slots, prefetch=prefetch, expert_cache_policy="lfu"
        )
        assert tokens == ref[1] and all(np.array_equal(a, b) for a, b in zip(logits, ref[0]))
        _check_accounting(stats, traces, engine.slot_plan.expert_block_bytes, family_model.config.num_experts_per_tok)
        assert int(engine.decoder.cached.slots.freq.copy_to_host()[:, :-1].sum()) > 0  # lfu counted the uses
        engine.decoder.close()


def test_adversarial_plans_cannot_corrupt_weights(family_model):
    """Plans that name the wrong experts for every layer prefetch into slots the waves are about to use:
    the copy stream waits for the compute stream's last use of a slot, so the outputs stay exact."""
    ref = run_session(family_model, backend="cuda", expert_cache_slots=1, prefetch="none")
    E = family_model.config.num_experts
    wrong = [{layer: (ids + 1) % E for layer, ids in trace.expert_ids.items()} for trace in ref[3]]
    plans = exact_plans([type(t)(expert_ids=w) for t, w in zip(ref[3], wrong)], E)
    for slots in (1, 2):
        logits, tokens, *_ = run_session(
            family_model, plans, backend="cuda", expert_cache_slots=slots, prefetch="plan,lookahead"
        )
        assert tokens == ref[1] and all(np.array_equal(a, b) for a, b in zip(logits, ref[0]))


@pytest.mark.parametrize("prefetch", ["none", "plan,lookahead"])
def test_pipelined_waves_equal_waves_in_turn(family_model, prefetch):
    """Waves of half the slots whose copies run on the copy stream one wave ahead (the default) against waves of
    every slot in turn on the compute stream, and against one slot: bitwise equal, graphs and eager, with misses
    served mid-step (the grouped steps, two or three prompts, take the waves; the long prompts' per-expert path
    and the one-token path do not pipeline)."""
    from expert_service.engine.cuda_options import CudaOptions

    ref = run_session(family_model, backend="cuda", expert_cache_slots=1, prefetch="none")
    plans = exact_plans(ref[3], family_model.config.num_experts) if "plan" in prefetch else None
    for slots in (2, 3):
        for pipelined in (True, False):
            for graphs in (True, False):
                options = CudaOptions(pipelined_waves=pipelined)
                logits, tokens, stats, _, engine = run_session(
                    family_model,
                    plans,
                    backend="cuda",
                    expert_cache_slots=slots,
                    prefetch=prefetch,
                    cuda_options=options,
                    cuda_graphs=graphs,
                )
                assert tokens == ref[1] and all(np.array_equal(a, b) for a, b in zip(logits, ref[0])), (
                    f"{slots} slots, pipelined={pipelined}, graphs={graphs}"
                )
                total = sum(stats, CacheStats())  # copies mid-step: demand misses, or prefetches the plan made
                assert total.misses + total.prefetches_issued > len(family_model.config.moe_layers)
                engine.decoder.close()


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def bf16_model(request, tmp_path_factory):
    """The tensor-core kernel reads bf16 weights: the tiny models converted to bf16."""
    return ModelDir.open(bf16_tiny(tmp_path_factory.mktemp(request.param + "_bf16"), request.param, 1))


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "in_turn"])
def test_tensor_core_waves(bf16_model, pipelined):
    """CudaOptions.cached_mma: the grouped waves on the tensor-core kernel through tile -> slot maps. Bitwise the
    same at 1, 2 and 3 slots and with graphs or eager (each tile computed by the same kernel whatever the waves);
    against moe_ffn's waves (fp32 activations) the prompt step's logits within the bf16 tolerance the resident
    engine is held to (its x and h rows are rounded to bf16)."""
    from expert_service.engine.cuda_options import CudaOptions

    on_moe_ffn = CudaOptions(cached_mma=False)
    ref = run_session(bf16_model, backend="cuda", expert_cache_slots=2, prefetch="none", cuda_options=on_moe_ffn)
    first = None
    for slots, graphs in ((1, True), (2, True), (3, True), (2, False)):
        options = CudaOptions(cached_mma=True, pipelined_waves=pipelined)
        logits, _, _, _, engine = run_session(
            bf16_model, backend="cuda", expert_cache_slots=slots, cuda_options=options, cuda_graphs=graphs
        )
        assert engine.decoder.cached.mma_possible
        assert rel_error(logits[0], ref[0][0]) <= 1e-2
        first = logits if first is None else first
        assert all(np.array_equal(a, b) for a, b in zip(logits, first)), f"{slots} slots, graphs={graphs}"
        engine.decoder.close()


# three prompts of 150 tokens in all: one step above moe_ffn.GROUPED_MAX_TOKENS (64), where cached steps read the
# waves back for per-expert cuBLAS unless CudaOptions.cached_mma_large runs them in tensor-core waves
LONG_PROMPTS = (np.arange(60) % 250 + 3, (np.arange(50) * 7) % 250 + 3, (np.arange(40) * 11) % 250 + 3)


@pytest.mark.parametrize("prefetch", ["none", "lookahead"])
def test_large_cached_steps_in_tensor_core_waves(bf16_model, prefetch):
    """CudaOptions.cached_mma_large (the default): the 150-token prompt step runs its experts in grouped waves on the tensor-core
    kernel, captured whole (no host break: it does not block the host), instead of per-expert cuBLAS at a host
    break per layer. Its logits within the bf16 tolerance of the cuBLAS path's; bitwise the same at 1 and 2 slots
    and with graphs or eagerly (each tile computed by the same kernel whatever the waves)."""
    from expert_service.cuda.moe_strategy import MoeStrategy
    from expert_service.engine.cuda_options import CudaOptions

    T = sum(len(p) for p in LONG_PROMPTS)
    ref = run_session(
        bf16_model,
        backend="cuda",
        prompts=LONG_PROMPTS,
        expert_cache_slots=2,
        prefetch=prefetch,
        cuda_options=CudaOptions(cached_mma_large=False),
    )
    assert ref[4].decoder._strategy(T) is MoeStrategy.CACHED_CUBLAS
    ref[4].decoder.close()
    first = None
    for slots, graphs in ((2, True), (1, True), (2, False)):
        logits, _, stats, _, engine = run_session(
            bf16_model,
            backend="cuda",
            prompts=LONG_PROMPTS,
            expert_cache_slots=slots,
            prefetch=prefetch,
            cuda_options=CudaOptions(cached_mma_large=True),
            cuda_graphs=graphs,
        )
        assert engine.decoder._strategy(T) is MoeStrategy.CACHED_GROUPED and not engine.decoder.blocks_host(T)
        assert stats[0].misses > 0  # the prompt step's experts were fetched mid-step
        assert rel_error(logits[0], ref[0][0]) <= 1e-2
        first = logits if first is None else first
        assert all(np.array_equal(a, b) for a, b in zip(logits, first)), f"{slots} slots, graphs={graphs}"
        engine.decoder.close()


def test_tensor_core_waves_need_their_workspace(bf16_model, family_model):
    """Turning cached_mma on (the default) for a bf16 engine whose config laid it out without it is refused in one
    line, naming the strategy; for a float32 model (the kernel does not apply) it changes nothing and is accepted."""
    from expert_service.engine.cuda_options import CudaOptions

    without = CudaOptions(cached_mma=False)
    engine = run_session(bf16_model, backend="cuda", expert_cache_slots=2, prefetch="none", cuda_options=without)[4]
    with pytest.raises(ValueError, match="cached_grouped"):
        engine.decoder.set_options(CudaOptions())
    engine.decoder.close()
    engine = run_session(family_model, backend="cuda", expert_cache_slots=2, prefetch="none", cuda_options=without)[4]
    engine.decoder.set_options(CudaOptions())
    assert not engine.decoder.cached.mma_possible
    engine.decoder.close()


def check_no_allocations_during_cached_steps(model, monkeypatch):
    """Warms an engine with a 2-slot cache and plan + lookahead prefetch up, then runs prompts and decodes with
    `memalloc` watched: no device allocation and no change in free device memory. Returns the engine."""
    from cuda.bindings import driver as drv
    from numba.cuda.cudadrv import driver

    engine = build_engine(
        model,
        EngineConfig(
            backend="cuda", kv_block_size=4, expert_cache_slots=2, prefetch="plan,lookahead", prefetch_large_steps=True
        ),
    )
    plan = dict(engine.decoder.memory_plan())
    assert plan["expert_weights"] == 0 and plan["expert_slots"] > 0

    def steps(first_id):
        ids = [first_id + j for j in range(len(LONG_PROMPTS))]
        engine.step([PrefillInput(r, p, SamplingParams(), True) for r, p in zip(ids, LONG_PROMPTS)])
        for _ in range(3):
            engine.step(decode_ids=ids)
        engine.clear()

    engine.decoder.warmup()  # compiles every kernel the cached path launches, captures every bucket
    steps(0)
    free_before = drv.cuMemGetInfo()[1]
    calls = []
    original = driver.Context.memalloc
    monkeypatch.setattr(driver.Context, "memalloc", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    steps(10)
    assert calls == [], f"{len(calls)} device allocations during cached steps"
    assert drv.cuMemGetInfo()[1] == free_before
    return engine


@pytest.mark.serial
def test_no_device_allocations_during_cached_steps(family_model, monkeypatch):
    engine = check_no_allocations_during_cached_steps(family_model, monkeypatch)
    assert 4 in engine.decoder.graphs
    engine.decoder.close()


@pytest.mark.serial
def test_no_device_allocations_during_cached_tensor_core_waves(bf16_model, monkeypatch):
    """The default options on a bf16 model take the tensor-core waves (cached_mma), and they allocate nothing
    during steps either (their tile rows are in the workspace)."""
    engine = check_no_allocations_during_cached_steps(bf16_model, monkeypatch)
    assert engine.decoder.options.cached_mma and engine.decoder.cached.mma_possible
    engine.decoder.close()
