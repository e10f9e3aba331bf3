"""The expert cache: bookkeeping with a fake copy engine, then the CPU backend's budgeted path on tiny models
(outputs bitwise equal to full residency at every cache size), then the stats through gRPC."""

import numpy as np
import pytest

from common.errors import ConfigError
from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.experts.cache import CacheStats, ExpertCache
from expert_service.experts.host_copy import HostCopyEngine
from expert_service.experts.slots import GIB, SlotPlan, plan_slots
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import SESSION_PROMPTS, BackgroundWorker, exact_plans, run_session

NBYTES = 1000


def resident(cache: ExpertCache, layer: int, expert: int) -> bool:
    """Held by a slot, ready or with its copy pending."""
    return expert in cache.layers[layer].slot_of


class FakeCopies:
    """A copy stream: copies land in issue order, when someone waits on one (or `land_all`)."""

    def __init__(self):
        self.issued: list[tuple[int, int, int]] = []
        self.landed = 0
        self.contents: dict[tuple[int, int], int] = {}  # (layer, slot) -> expert whose bytes are there

    def copy(self, layer, expert, slot):
        self.issued.append((layer, expert, slot))
        return _Handle(self, len(self.issued))

    def land(self, upto: int) -> None:
        for layer, expert, slot in self.issued[self.landed : upto]:
            self.contents[(layer, slot)] = expert
        self.landed = max(self.landed, upto)

    def land_all(self) -> None:
        self.land(len(self.issued))


class _Handle:
    def __init__(self, copies: FakeCopies, index: int):
        self.copies, self.index = copies, index

    def result(self):
        self.copies.land(self.index)


def make_cache(slots=2, experts=4, layers=(0, 1)):
    copies = FakeCopies()
    return ExpertCache(layers, experts, slots, NBYTES, copies), copies


def run_layer(cache, copies, layer, experts, meddle=None):
    """Streams the layer like the decoder does; every expert must find its own bytes in its slot even after
    every copy issued meanwhile has landed (a copy into an in-use slot would show up here)."""
    used = []
    for e, slot in cache.stream(layer, experts):
        if meddle:
            meddle()
        copies.land_all()
        assert copies.contents[(layer, slot)] == e, f"expert {e} read slot {slot} holding another expert"
        used.append(e)
    return used


def test_hits_misses_and_lru_order():
    cache, copies = make_cache(slots=2)
    cache.begin_step()
    assert run_layer(cache, copies, 0, [0]) == [0]
    run_layer(cache, copies, 0, [1])
    run_layer(cache, copies, 0, [0])  # a hit: 0 becomes the most recently used
    run_layer(cache, copies, 0, [2])  # evicts 1, the least recently used
    stats = cache.end_step()
    assert resident(cache, 0, 0) and resident(cache, 0, 2) and not resident(cache, 0, 1)
    assert stats == CacheStats(hits=1, misses=3, bytes_copied=3 * NBYTES, stall_seconds=stats.stall_seconds)
    assert cache.total == stats


def test_lfu_keeps_the_expert_used_most_and_forgets_with_age():
    """lfu: a recent one-off does not evict the expert used most; halving every `half_life` uses lets a long-idle
    favourite go to one used more since."""
    copies = FakeCopies()
    cache = ExpertCache((0,), 4, 2, NBYTES, copies, policy="lfu")
    cache.begin_step()
    for e in (0, 0, 0, 1):  # 0 used three times, then 1 (the most recent)
        run_layer(cache, copies, 0, [e])
    run_layer(cache, copies, 0, [2])  # lru would evict 0; lfu evicts 1 (used once)
    assert resident(cache, 0, 0) and resident(cache, 0, 2) and not resident(cache, 0, 1)
    lru, lru_copies = make_cache(slots=2, experts=4, layers=(0,))
    lru.begin_step()
    for e in (0, 0, 0, 1, 2):
        run_layer(lru, lru_copies, 0, [e])
    assert not resident(lru, 0, 0)  # the same uses under lru
    policy = cache.policy
    for _ in range(policy.half_life * 4):  # 2 used many times since: 0's three uses age to nothing
        run_layer(cache, copies, 0, [2])
    run_layer(cache, copies, 0, [3])
    assert resident(cache, 0, 2) and resident(cache, 0, 3) and not resident(cache, 0, 0)


def test_lfu_counts_uses_not_predictions():
    """A prediction is not a use (as on the device): an expert predicted every step but never computed does not
    outlive one the steps computed; nor does a prediction of a resident expert count it twice."""
    copies = FakeCopies()
    cache = ExpertCache((0,), 4, 2, NBYTES, copies, policy="lfu")
    for _ in range(2):  # expert 0: two uses
        cache.begin_step()
        run_layer(cache, copies, 0, [0])
        cache.end_step()
    for _ in range(3):  # expert 1: predicted three steps running, never used
        cache.begin_step()
        cache.prefetch(0, [1])
        cache.end_step()
    cache.begin_step()
    run_layer(cache, copies, 0, [2])  # the miss evicts the expert never used
    cache.end_step()
    assert resident(cache, 0, 0) and resident(cache, 0, 2) and not resident(cache, 0, 1)


def test_a_policy_without_a_device_implementation_is_refused_on_the_cuda_backend_in_one_line(family_model, monkeypatch):
    """A cached cuda engine with a policy the slot-map kernel does not implement is refused at build (every policy
    has one today: the test narrows the list to check the guard)."""
    import expert_service.backends as backends
    from expert_service.experts.slots import SlotPlan

    monkeypatch.setattr(backends, "cuda_status", lambda: (True, "a GPU for the test"))
    monkeypatch.setattr(backends, "DEVICE_POLICIES", ("lru",))
    config = EngineConfig(backend="cuda", expert_cache_slots=1, expert_cache_policy="lfu")
    with pytest.raises(ConfigError) as error:
        backends.make_decoder(family_model, config, SlotPlan(1, 4, 2, 1024, 0))
    assert str(error.value).startswith("expert_cache_policy: 'lfu' runs on the cpu backend only")
    assert "\n" not in str(error.value)


def test_the_device_policy_names_are_the_slot_maps():
    """The names the backend builder lets through for the cuda backend are exactly those the slot-map kernel maps."""
    from expert_service.cuda.expert_slots import POLICY_ARGUMENTS
    from expert_service.experts.cache import DEVICE_POLICIES, POLICIES

    assert set(DEVICE_POLICIES) == set(POLICY_ARGUMENTS) and set(DEVICE_POLICIES) <= set(POLICIES)


def test_batch_union_loads_each_expert_once():
    cache, copies = make_cache(slots=4)
    cache.begin_step()
    run_layer(cache, copies, 1, [3, 3, 1, 3, 1])
    stats = cache.end_step()
    assert (stats.hits, stats.misses, len(copies.issued)) == (0, 2, 2)


def test_waves_put_residents_first_and_account_each_expert_once():
    cache, copies = make_cache(slots=2)
    cache.begin_step()
    run_layer(cache, copies, 0, [3])
    cache.end_step()
    cache.begin_step()
    used = run_layer(cache, copies, 0, [0, 1, 2, 3])  # 4 experts through 2 slots: two waves
    stats = cache.end_step()
    assert used[0] == 3 and sorted(used) == [0, 1, 2, 3]
    assert stats.hits + stats.misses == 4 and (stats.hits, stats.misses) == (1, 3)
    assert stats.bytes_copied == stats.misses * NBYTES


def test_acquire_beyond_free_slots_is_refused():
    cache, _ = make_cache(slots=2)
    cache.begin_step()
    with pytest.raises(ValueError, match="waves"):
        cache.acquire(0, [0, 1, 2])


def test_prefetch_never_evicts_experts_in_use():
    cache, copies = make_cache(slots=2)
    cache.begin_step()
    slots = cache.acquire(0, [0, 1])
    assert cache.prefetch(0, [2, 3]) == 0 and len(copies.issued) == 2  # no room: nothing issued
    copies.land_all()
    assert {copies.contents[(0, s)] for s in slots.values()} == {0, 1}
    cache.release(0)
    # With one spare slot the prefetch takes exactly that one, not the slot in use.
    cache, copies = make_cache(slots=3)
    cache.begin_step()
    slots = cache.acquire(0, [0, 1])
    assert cache.prefetch(0, [2, 3]) == 1
    copies.land_all()
    assert {copies.contents[(0, s)] for s in slots.values()} == {0, 1} and resident(cache, 0, 2)


def test_adversarial_prefetch_during_waves_cannot_corrupt_weights():
    cache, copies = make_cache(slots=2, experts=8)
    cache.begin_step()
    # Every step of the stream, predict exactly the experts the layer is about to need, and some more.
    run_layer(cache, copies, 0, range(8), meddle=lambda: cache.prefetch(0, [7, 6, 5, 4, 3, 2, 1, 0]))
    stats = cache.end_step()
    assert stats.hits + stats.misses == 8
    assert stats.bytes_copied == (stats.misses + stats.prefetches_issued) * NBYTES


def test_prefetch_is_used_later_and_predictions_do_not_evict_each_other():
    cache, copies = make_cache(slots=2)
    cache.begin_step()
    assert cache.prefetch(1, [2]) == 1
    assert cache.prefetch(1, [3, 0]) == 1  # the slot holding the first prediction stays
    assert resident(cache, 1, 2) and resident(cache, 1, 3) and not resident(cache, 1, 0)
    run_layer(cache, copies, 1, [2, 0])  # 2: a used prefetch; 0: a miss evicting the unused 3
    stats = cache.end_step()
    assert (stats.prefetches_issued, stats.prefetches_used, stats.hits, stats.misses) == (2, 1, 1, 1)
    assert stats.bytes_copied == 3 * NBYTES
    cache.begin_step()  # a prefetch already resident issues nothing
    assert cache.prefetch(1, [2, 0]) == 0
    assert cache.end_step().prefetches_issued == 0


# --- the CPU backend ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe"])
def family_model(request, tmp_path_factory):
    return ModelDir.open(make_tiny(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=1))


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_every_cache_size_equals_full_residency_bitwise(family_model, slots):
    ref_logits, ref_tokens, ref_stats, traces, _ = run_session(family_model)
    assert all(s is None for s in ref_stats)  # all resident: no cache logic ran
    logits, tokens, stats, _, engine = run_session(family_model, expert_cache_slots=slots, prefetch="none")
    assert tokens == ref_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, ref_logits))
    if slots == 4:
        assert engine.decoder.cache is None and all(s is None for s in stats)
        return
    for step_stats, trace in zip(stats, traces):  # accounting adds up, per step
        uses = sum(len(np.unique(ids)) for ids in trace.expert_ids.values())
        assert step_stats.hits + step_stats.misses == uses
        assert step_stats.bytes_copied == step_stats.misses * engine.slot_plan.expert_block_bytes
        assert step_stats.prefetches_issued == 0


@pytest.mark.parametrize("prefetch", ["plan", "lookahead", "plan,lookahead"])
def test_prefetch_changes_only_counters(family_model, prefetch):
    ref_logits, ref_tokens, _, traces, _ = run_session(family_model)
    plans = exact_plans(traces)
    for slots in (1, 2):
        logits, tokens, stats, _, engine = run_session(family_model, plans, expert_cache_slots=slots, prefetch=prefetch)
        assert tokens == ref_tokens and all(np.array_equal(a, b) for a, b in zip(logits, ref_logits))
        block = engine.slot_plan.expert_block_bytes
        for s, trace in zip(stats, traces):
            assert s.hits + s.misses == sum(len(np.unique(ids)) for ids in trace.expert_ids.values())
            assert s.bytes_copied == (s.misses + s.prefetches_issued) * block
        total = sum(stats, CacheStats())
        assert total.prefetches_used <= total.prefetches_issued
        # lookahead predicts the next MoE layer: none after the last (tiny qwen2_moe has one MoE layer)
        assert total.prefetches_issued > 0 or (prefetch == "lookahead" and len(family_model.config.moe_layers) == 1)
        if "plan" in prefetch:  # the plan is the exact routing: its predictions get used
            assert total.prefetches_used > 0


def test_plan_prefetch_turns_misses_into_hits(family_model):
    _, _, _, traces, _ = run_session(family_model)
    plans = exact_plans(traces)
    none = sum(run_session(family_model, plans, expert_cache_slots=2, prefetch="none")[2], CacheStats())
    plan = sum(run_session(family_model, plans, expert_cache_slots=2, prefetch="plan")[2], CacheStats())
    assert plan.prefetches_used > 0 and plan.misses < none.misses


def test_only_steps_whose_experts_fit_the_slots_prefetch_by_default(family_model):
    """A step prefetches while tokens x top-k <= slots: one-token decodes with K slots do, a prefill chunk and a
    two-sequence decode do not (their own routing fills the slots); prefetch_large_steps brings those back."""
    K = family_model.config.num_experts_per_tok
    prompt = (SESSION_PROMPTS[0],)
    _, ref_tokens, _, traces, _ = run_session(family_model, prompts=prompt)
    plans = exact_plans(traces)
    for source in ("plan", "lookahead"):
        _, tokens, stats, _, _ = run_session(
            family_model, plans, prompts=prompt, expert_cache_slots=K, prefetch=source, prefetch_large_steps=False
        )
        assert tokens == ref_tokens
        assert stats[0].prefetches_issued == 0  # the prompt's chunk
        if source == "plan" or len(family_model.config.moe_layers) > 1:
            assert sum(stats[1:], CacheStats()).prefetches_issued > 0  # its one-token decodes
    two = [
        run_session(
            family_model,
            exact_plans(run_session(family_model)[3]),
            expert_cache_slots=K,
            prefetch="plan",
            prefetch_large_steps=large,
        )[2]
        for large in (False, True)
    ]
    assert sum(two[0], CacheStats()).prefetches_issued == 0
    assert sum(two[1], CacheStats()).prefetches_issued > 0


def test_step_prefetches_counts_the_steps_assignments():
    plan = SlotPlan(slots_per_layer=8, num_experts=32, num_moe_layers=4, expert_block_bytes=1, budget_bytes=0)
    assert [plan.step_prefetches(t, 2) for t in (1, 4, 5, 16)] == [True, True, False, False]
    assert plan.step_prefetches(16, 2, large_steps=True)
    assert not plan.step_prefetches(1, 9)  # one token routed to more experts than the slots


def test_slot_plan_from_budget_and_memory_plan(family_model):
    block = family_model.expert_block(family_model.config.moe_layers[0], 0)[2]
    layers = len(family_model.config.moe_layers)
    assert plan_slots(family_model, 0, 0).slots_per_layer == 4 and not plan_slots(family_model, 0, 0).is_cached
    assert plan_slots(family_model, 2.5 * layers * block / GIB, 0).slots_per_layer == 2
    assert plan_slots(family_model, 1.0, 3).slots_per_layer == 3  # explicit slots win
    engine = build_engine(family_model, EngineConfig(backend="cpu", expert_cache_slots=1))
    plan = dict(engine.decoder.memory_plan())
    assert family_model.dtype == "float32" and plan["expert_slots"] == layers * 1 * block  # float32 slots


def test_host_copy_widens_bf16_blocks_exactly(tmp_path):
    hf = make_tiny(tmp_path / "f32", family="mixtral", seed=2) / "hf"
    model = ModelDir.open(convert(hf, tmp_path / "bf16", dtype="bfloat16", progress=False))
    copier = HostCopyEngine(model, model.config.moe_layers, 1)
    layer = model.config.moe_layers[-1]
    copier.copy(layer, 3, 0).result()
    prefix = f"layers.{layer}.experts.3."
    for got, name in zip(copier.weights(layer, 0), ("gate_proj", "up_proj", "down_proj")):
        assert np.array_equal(got, model.tensor_f32(prefix + name))
    copier.close()


def test_config_checks(family_model):
    with pytest.raises(ConfigError, match="prefetch"):
        EngineConfig(prefetch="plan,psychic")
    with pytest.raises(ConfigError, match="expert_cache"):
        EngineConfig(expert_cache_slots=-1)
    for budget in (float("nan"), float("inf")):  # int(budget * GIB) would raise from plan_slots at build
        with pytest.raises(ConfigError, match="^expert_cache_gb"):
            EngineConfig(expert_cache_gb=budget)
    assert EngineConfig(prefetch="none").prefetch_sources == frozenset()


# --- through the worker ---------------------------------------------------------------------------------
def test_worker_reports_cache_stats_and_metrics(tiny_model):
    import grpc

    from common.pb import worker_pb2 as pb
    from common.pb import worker_pb2_grpc

    worker = BackgroundWorker(tiny_model, expert_cache_slots=1).start()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            info = stub.Info(pb.InfoRequest())
            assert info.expert_slots.cached and info.expert_slots.slots_per_layer == 1
            assert info.expert_slots.expert_block_bytes > 0 and info.expert_slots.prefetch == "plan"
            assert any(m.name == "expert_slots" and m.bytes > 0 for m in info.memory_plan)
            chunk = pb.PrefillChunk(
                request_id=1, token_ids=list(range(3, 20)), sampling=pb.SamplingParams(), is_last=True
            )
            response = stub.Prefill(pb.PrefillRequest(chunks=[chunk]))
            assert response.HasField("expert_cache")
            stats = response.expert_cache
            assert (
                stats.misses > 0
                and stats.bytes_copied
                == (stats.misses + stats.prefetches_issued) * info.expert_slots.expert_block_bytes
            )
            stub.Decode(pb.DecodeRequest(request_ids=[1]))
        metrics = worker.servicer.metrics
        misses = metrics.expert_cache_misses._value.get()
        assert misses >= stats.misses and metrics.expert_cache_copied_bytes._value.get() >= stats.bytes_copied
        assert metrics.expert_cache_prefetches_issued._value.get() >= stats.prefetches_issued
    finally:
        worker.stop()


def test_the_running_counters_count_every_cache_stats_field():
    from dataclasses import fields

    from expert_service.experts.cache import CacheStats, _Counters

    assert _Counters.__slots__ == tuple(f.name for f in fields(CacheStats))
