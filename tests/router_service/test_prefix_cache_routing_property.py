"""Prefix caching beside the routing table's plans, the expert cache and 8-bit experts: the router's scheduler and
prefix index drive the real cpu engine in process (as in test_prefix_cache_engine.py) over seeded random
shared-prefix traffic, on a sample of {bf16, int8, fp8-block128 experts} x {expert cache off, 1..E-1 slots with each
prefetch source and policy} x {routing exact (no plan, the router's plans, the worker's own table lookup), lut} x
{a table traced by router-gen's code, a random valid one}; chunked prefill, penalties, seeded sampling and scored
prompts; two steps in flight (decodes fed the step ahead's argmax), one when the router sends plans. Each case runs
the traffic with prefix caching on and off:

- tokens are equal, and so are log-probabilities to float rounding (equal to resident experts' too);
- every step computes exactly the tokens the scheduler sent it: a chunk never holds a token of its cached prefix,
  the routing plan covers the step's tokens and no others, and the layers route exactly those tokens (under lut,
  to the table's experts for them); so a run with the cache on routes its hit tokens fewer than one with it off;
- the expert cache's counters add up: each step's hits + misses are the distinct experts it routed to per layer,
  the totals are the steps' sums, bytes copied are the copied blocks' own sizes, no more prefetches used than issued."""

import random

import numpy as np
import pytest

from common.model_format import ModelDir
from common.routing_table import RoutingTable, model_digest, write_routing_table
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from expert_service.experts.cache import CacheStats
from expert_service.tools.convert import convert
from expert_service.tools.routing_gen import generate
from expert_service.tools.tiny_model import make_tiny, write_tiny_checkpoint
from router_service.prefix_cache import PrefixCache
from router_service.routing import RoutingPlanner, step_token_ids
from router_service.scheduler import RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits
from tests.helpers import cpu_engine
from tests.router_service.test_prefix_cache_engine import prefill_inputs

BLOCK = 4
NUM_BLOCKS = 22  # small enough that cached prefixes are evicted along the way
BATCH = dict(max_batch_size=6, max_batch_tokens=7)  # 7: prompts are prefilled in chunks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing_property")
    bf16 = convert(write_tiny_checkpoint(tmp / "hf", seed=3), tmp / "bf16", dtype="bfloat16", progress=False)
    return {
        "bf16": ModelDir.open(bf16),
        "int8": ModelDir.open(make_tiny(tmp / "int8", seed=3, expert_dtype="int8")),
        "fp8": ModelDir.open(make_tiny(tmp / "fp8", seed=3, expert_dtype="fp8")),
    }


def _table(model: ModelDir, kind: str, top_k: int, seed: int) -> np.ndarray:
    """uint16 [L, V, top_k]: `colibri router-gen`'s code on a small random-id corpus, or random distinct experts."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    if kind == "traced":
        engine = build_engine(model, EngineConfig(backend="cpu", kv_block_size=BLOCK, kv_cache_tokens=1024))
        table, _, _ = generate(model, engine, rng.integers(3, 250, 600), top_k, holdout=0.0, sequence_length=60)
        return table
    scores = rng.random((len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts))
    return np.argsort(scores, axis=2)[:, :, :top_k].astype(np.uint16)


def _traffic(seed: int, count: int = 22):
    """(prompt, max_new_tokens, sampling, arrival step): three shared bases cut at or near block boundaries, random
    tails, whole repeats; greedy, penalised, seeded-sampled and prompt-scoring requests."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 250) for _ in range(n)] for n in (11, 16, 25)]
    out = []
    for _ in range(count):
        base = rng.choice(bases)
        cut = max(1, min(len(base), rng.randrange(1, len(base) // BLOCK + 1) * BLOCK + rng.choice([-1, 0, 1])))
        prompt = base[:cut] + [rng.randrange(3, 250) for _ in range(rng.choice([0, 0, 1, 3, 6]))]
        roll = rng.random()
        if roll < 0.15:
            params = SamplingParams(logprobs=True, penalties=PenaltyParams(1.5, 0.4, 0.2))
        elif roll < 0.3:
            params = SamplingParams(temperature=0.9, seed=rng.randrange(1 << 30), logprobs=True)
        elif roll < 0.38:  # neither hits nor caches, but runs beside requests that do
            params = SamplingParams(logprobs=True, prompt_logprobs=1)
        elif roll < 0.6:
            params = SamplingParams(logprobs=True)
        else:  # plain greedy: a step of only these may be overlapped, its successor's decodes fed on the device
            params = SamplingParams()
        out.append((prompt, rng.randrange(1, 6), params, rng.randrange(4)))
    return out


class StepRecorder:
    """Wraps the decoder's forward pass and copy engine: what each step computed, routed and cached."""

    def __init__(self, engine):
        self.engine, self.steps, self.copied = engine, [], []
        forward = engine.decoder.forward

        def recording_forward(batch, trace=None):
            logits = forward(batch, trace)
            self.steps.append((batch, trace))
            return logits

        engine.decoder.forward = recording_forward
        if engine.decoder.cache is not None:
            copy = engine.decoder.copy_engine.copy

            def recording_copy(layer, expert, slot):
                self.copied.append((layer, expert))
                return copy(layer, expert, slot)

            engine.decoder.copy_engine.copy = recording_copy

    def take(self):
        ((batch, trace),) = self.steps
        self.steps.clear()
        return batch, trace


def _check_step(engine, table, step, plan, batch, trace, computed: np.ndarray) -> None:
    """The step computed and routed exactly the tokens the scheduler sent (a cached prefix's none), its plan covers
    those tokens only, lut routes them to the table's experts, and the expert cache counted each expert once."""
    cfg = engine.model_config
    assert np.array_equal(batch.token_ids, computed)
    for layer in cfg.moe_layers:
        assert trace.expert_ids[layer].shape == (len(computed), cfg.num_experts_per_tok)
    if plan is not None:  # in the worker's order: chunks, then decodes
        assert np.array_equal(step_token_ids(step), computed)
        assert all(ids.shape[0] == len(computed) for ids in plan.expert_ids(cfg.num_experts, len(computed)).values())
    if engine.config.routing == "lut":
        expected = table.lookup(computed)
        for index, layer in enumerate(cfg.moe_layers):
            assert np.array_equal(np.sort(trace.expert_ids[layer], axis=1), np.sort(expected[index], axis=1))
    if engine.decoder.cache is not None:
        stats = trace.expert_cache
        distinct = sum(len(np.unique(trace.expert_ids[layer])) for layer in cfg.moe_layers)
        assert stats.hits + stats.misses == distinct, (stats, distinct)


def _run(engine, traffic, prefix_caching: bool, planner: RoutingPlanner | None, table: RoutingTable | None):
    """Runs the traffic (two steps in flight, or one when the router sends plans, as the batching loop does) and
    checks every step; returns (tokens and log-probabilities per request, tokens routed, the prefix index)."""
    recorder = StepRecorder(engine)
    limits = SchedulerLimits(kv_block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, **BATCH)
    s = Scheduler(limits, PrefixCache(BLOCK, b"tiny") if prefix_caching else None)
    cache = engine.decoder.cache
    depth = 1 if planner is not None else 2
    before = cache.total if cache is not None else None  # the engine's cache counts across runs
    results: dict[int, list] = {}
    prompts = {rid: p for rid, (p, *_) in enumerate(traffic, 1)}
    pending, in_flight, steps, routed, step_stats = list(enumerate(traffic, 1)), [], 0, 0, []
    engine_flight, launched_steps, collected = [], [], {}  # steps launched on the engine; answers taken early
    while pending or s.requests or in_flight:
        steps += 1
        assert steps < 3000, "the traffic never drained"
        while pending and (pending[0][1][3] <= steps // 3 or not s.requests):
            rid, (prompt, n, params, _) = pending.pop(0)
            results[rid] = []
            s.add(
                ScheduledRequest(
                    rid,
                    list(prompt),
                    n,
                    sampling=params,
                    penalized=params.penalties.active,
                    sends_prefix_tokens=params.penalties.repetition != 1.0,  # as the batching loop decides
                    scores_prompt=params.prompt_logprobs is not None,
                )
            )
        step = s.schedule()
        engine.release(step.free_ids)
        for block_id in step.evict_block_ids:
            engine.allocator.evict((0, block_id))
        launched = None
        if not step.is_empty:
            for c in step.prefill_chunks:  # a chunk holds the prompt after its cached prefix, never a cached token
                assert list(c.token_ids) == prompts[c.request_id][c.start : c.start + len(c.token_ids)]
                assert c.start >= len(c.prefix_block_ids) * BLOCK
                assert not c.is_first or c.start == len(c.prefix_block_ids) * BLOCK
            plan = planner.routing_plan(step) if planner is not None else None
            prefill = prefill_inputs(step)
            if not engine.can_launch:  # the step ahead is not overlappable: answered first, as the worker does
                ahead = engine_flight.pop(0)
                collected[id(ahead)] = engine.collect(ahead)
            launched = engine.launch(prefill, step.decode_ids, plan)
            engine_flight.append(launched)
            launched_steps.append((launched, plan, *recorder.take()))
        in_flight.append((step, launched_steps[-1] if launched else None))
        while len(in_flight) == depth or (in_flight and (not s.requests or step.is_empty)):
            done, record = in_flight.pop(0)
            outputs: list = []
            if record is not None:
                handle, plan, batch, trace = record
                # a decode's input is the token the step before sampled: the scheduler has it by now
                decode_inputs = [s.requests[rid].output_ids[-1] for rid in done.decode_ids]
                computed = np.concatenate(
                    [np.asarray(c.token_ids, np.int64) for c in done.prefill_chunks]
                    + [np.asarray(decode_inputs, np.int64)]
                )
                _check_step(engine, table, done, plan, batch, trace, computed)
                routed += len(computed)
                if cache is not None:
                    step_stats.append(trace.expert_cache)
                result = collected.pop(id(handle), None)
                if result is None:
                    assert engine_flight[0] is handle
                    result = engine.collect(engine_flight.pop(0))
                assert not any(o.error for o in result.outputs), result.outputs
                outputs = [RequestOutput(o.request_id, o.token_id, o.logprob, error=o.error) for o in result.outputs]
            for o in s.update(done, outputs):
                assert not o.error, o
                results[o.request_id].append((o.token_id, o.logprob))
    step = s.schedule()  # the last frees
    engine.release(step.free_ids)
    for block_id in step.evict_block_ids:
        engine.allocator.evict((0, block_id))
    assert not engine.sequences and engine.allocator.num_used_blocks == 0 and s.num_used_blocks == 0
    for key in list(engine.allocator.cached):  # the next run starts on an empty cache
        engine.allocator.evict(key)
    if cache is not None:
        total, counted = sum(step_stats, CacheStats()), cache.total
        assert (total.hits, total.misses, total.prefetches_issued, total.prefetches_used) == (
            counted.hits - before.hits,
            counted.misses - before.misses,
            counted.prefetches_issued - before.prefetches_issued,
            counted.prefetches_used - before.prefetches_used,
        )
        assert total.prefetches_used <= total.prefetches_issued
        assert total.bytes_copied == sum(engine.model.expert_block(*key)[2] for key in recorder.copied)
    return results, routed, s.prefix_cache


def _cases(count: int) -> list[tuple]:
    """A seeded sample of the combinations (the whole product would take minutes)."""
    rng = random.Random(2024)
    out = []
    for i in range(count):
        dtype = ("bf16", "int8", "fp8")[i % 3]
        slots = rng.choice([0, 1, 2, 3])
        prefetch = rng.choice(["none", "plan", "lookahead", "plan,lookahead"]) if slots else "none"
        policy = rng.choice(["lru", "lfu"])
        routing = "lut" if i % 4 == 3 else "exact"
        # exact: no plan, the router's plans (maybe wider than the top-k), or the worker's own table lookup
        source = "router" if routing == "lut" else rng.choice(["none", "router", "worker"])
        table = rng.choice(["traced", "random"])
        out.append((dtype, slots, prefetch, policy, routing, source, table, 100 + i))
    return out


@pytest.mark.parametrize(
    "dtype,slots,prefetch,policy,routing,source,table_kind,seed",
    _cases(12),
    ids=lambda v: str(v),
)
def test_prefix_caching_keeps_routing_plans_and_the_expert_cache_exact(
    models, tmp_path, dtype, slots, prefetch, policy, routing, source, table_kind, seed
):
    model = models[dtype]
    cfg = model.config
    top_k = cfg.num_experts_per_tok if routing == "lut" else random.Random(seed).choice([2, 3])
    table_ids = _table(model, table_kind, top_k, seed)
    table = RoutingTable(table_ids, cfg.num_experts, cfg.moe_layers)
    path = write_routing_table(tmp_path / "table.bin", table_ids, cfg.num_experts, model_digest(model.path))
    base = dict(backend="cpu", kv_block_size=BLOCK, kv_cache_tokens=BLOCK * NUM_BLOCKS, routing=routing, **BATCH)
    # prefetch in steps of every size, as run_session does: by default a step prefetches only while its tokens x
    # top-k fit the slots, which none of this traffic's does at one slot
    cache = dict(expert_cache_slots=slots, prefetch=prefetch, expert_cache_policy=policy, prefetch_large_steps=True)
    plan_table = str(path) if source == "worker" else "router"
    # its launch takes part in overlapped steps as the cuda backend's does: decodes fed the step ahead's argmax
    engine = cpu_engine(model, EngineConfig(**base, **cache, plan_table=plan_table), overlap=True)
    assert (engine.decoder.plan_lookup is not None) == (source == "worker" and slots > 0 and "plan" in prefetch)
    resident = cpu_engine(model, EngineConfig(**base), overlap=True)
    planner = RoutingPlanner(table) if source == "router" else None
    traffic = _traffic(seed)
    try:
        cached, routed_cached, index = _run(engine, traffic, True, planner, table)
        plain, routed_plain, _ = _run(engine, traffic, False, planner, table)
        reference, _, _ = _run(resident, traffic, False, planner, table)
    finally:
        engine.close()
        resident.close()
    assert index.num_hit_tokens > 0 and index.num_evicted > 0
    if slots and ("lookahead" in prefetch or ("plan" in prefetch and source != "none")):
        assert engine.decoder.cache.total.prefetches_issued > 0  # the prefetch ran beside the prefix cache
    # a cached prefix's tokens are not computed again, so they route nothing
    assert routed_plain - routed_cached == index.num_hit_tokens
    for rid, tokens in cached.items():
        assert [t for t, _ in tokens] == [t for t, _ in plain[rid]] == [t for t, _ in reference[rid]], (
            rid,
            traffic[rid - 1],
        )
        for other in (plain, reference):
            np.testing.assert_allclose(
                [lp for _, lp in tokens], [lp for _, lp in other[rid]], rtol=1e-4, atol=1e-5, equal_nan=True
            )
