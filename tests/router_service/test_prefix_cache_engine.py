"""The router's scheduler and prefix cache driving the real engine (CPU, tiny model) in process, two steps in
flight as the router keeps them: fresh random traffic with shared prefixes, block-boundary and one-token prompts,
penalties (presence/frequency-only ones sent without their cached prefix's tokens) and seeded sampling, next turns
(a finished request's prompt and answer, and more), cancels mid-prefill and eviction pressure gives the same tokens
and log-probabilities with the cache on (generated blocks included) as with it off; a cached block's KV never
changes while it is cached (a shared block is never written), and every block comes back at the end."""

import random

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.prefix_blocks import sequence_block_registrations
from expert_service.engine.sampling import SamplingParams
from expert_service.engine.step import PrefillInput
from router_service.prefix_cache import PrefixCache
from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits

BLOCK = 4
NUM_BLOCKS = 30  # the router's pool: evictions under this traffic
ENGINE_BLOCKS = 64  # the worker's: room for a router given more
NEXT_TURN = 1000  # a next turn's request id: the first turn's + this


@pytest.fixture(scope="module")
def engine(tiny_model):
    config = EngineConfig(backend="cpu", kv_block_size=BLOCK, kv_cache_tokens=BLOCK * ENGINE_BLOCKS, max_batch_size=6)
    return build_engine(ModelDir.open(tiny_model), config)


def _traffic(seed: int, count: int):
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 250) for _ in range(n)] for n in (12, 17, 26)]
    out = []
    for _ in range(count):
        base = rng.choice(bases)
        if rng.random() < 0.1:
            prompt = [rng.randrange(3, 250)]
        else:
            cut = max(1, min(len(base), rng.randrange(1, len(base) // BLOCK + 1) * BLOCK + rng.choice([-1, 0, 1])))
            prompt = base[:cut] + [rng.randrange(3, 250) for _ in range(rng.choice([0, 0, 2, 5]))]
        roll = rng.random()
        if roll < 0.2:  # with a repetition penalty or without: only that one counts the (cached) prompt
            params = SamplingParams(logprobs=True, penalties=PenaltyParams(rng.choice([1.0, 1.3, 1.8]), 0.5, 0.3))
        elif roll < 0.35:
            params = SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30), logprobs=True)
        elif roll < 0.45:  # scored prompts neither hit nor cache, yet run beside requests that do
            params = SamplingParams(logprobs=True, prompt_logprobs=1, top_logprobs=2)
        else:
            params = SamplingParams(logprobs=True)
        out.append((prompt, rng.randrange(1, 6), params, rng.randrange(3)))  # (.., arrival step)
    return out


def prefill_inputs(step) -> list[PrefillInput]:
    """The step's chunks as the worker's wire makes them."""
    return [
        PrefillInput(
            c.request_id, np.asarray(c.token_ids), c.sampling if c.is_first else None, c.is_last,
            c.prefix_block_ids, c.cache_block_ids, c.prefix_token_ids, c.start,
        )
        for c in step.prefill_chunks
    ]  # fmt: skip


def sequence_blocks(engine, step) -> list:
    """The step's registrations of generated blocks as the worker checks them before it runs the step (its decodes
    counted); the caller registers them once the step ran."""
    rows = np.asarray(step.sequence_blocks, "<u8").reshape(-1, 3)
    fed, chunks = dict.fromkeys(step.decode_ids, 1), prefill_inputs(step)
    return sequence_block_registrations(engine.allocator, engine.sequences, rows, 0, lambda _: True, fed, chunks)


def _kv_of(engine, block: int) -> tuple[np.ndarray, np.ndarray]:
    kv = engine.decoder.kv
    return kv.k[:, block].copy(), kv.v[:, block].copy()


def _run(engine, traffic, prefix_caching: bool, cancel_seed: int | None, refuse_rate=0.0, num_blocks=NUM_BLOCKS):
    """Runs the traffic; with a cancel seed some requests are cancelled, and with refuse_rate some steps are refused
    as a whole by the worker (their requests fail, and so do those a step already sent started on their blocks).
    Returns (tokens and log-probabilities per request, None for one that did not complete; the scheduler)."""
    limits = SchedulerLimits(max_batch_size=6, max_batch_tokens=7, kv_block_size=BLOCK, num_kv_blocks=num_blocks)
    s = Scheduler(limits, PrefixCache(BLOCK, b"tiny", caches_generated=True) if prefix_caching else None)
    cancel_rng = random.Random(cancel_seed) if cancel_seed is not None else None
    results: dict[int, list] = {}
    snapshots: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # router block id -> its KV when first seen settled
    pending = list(enumerate(traffic, 1))
    prompts = {rid: list(prompt) for rid, (prompt, *_) in pending}
    in_flight: list = []  # (step, outputs) run on the engine, not yet applied to the scheduler
    steps, generated, on_generated = 0, set(), 0  # generated blocks' ids; requests that started on one
    while pending or s.requests or in_flight:
        steps += 1
        assert steps < 5000, "the traffic never drained"
        while pending and (pending[0][1][3] <= steps // 3 or not s.requests):
            rid, (prompt, n, params, _) = pending.pop(0)
            results[rid] = []
            scored = params.prompt_logprobs is not None
            s.add(
                ScheduledRequest(
                    rid,
                    list(prompt),
                    n,
                    sampling=params,
                    penalized=params.penalties.active,
                    sends_prefix_tokens=params.penalties.counts_prompt,
                    scores_prompt=scored,
                )
            )
        if cancel_rng is not None and s.requests and cancel_rng.random() < 0.08:
            victim = cancel_rng.choice(list(s.requests))
            s.finish(victim, FinishReason.CANCELLED)
            results[victim] = None
        step = s.schedule()
        engine.release(step.free_ids)
        for block_id in step.evict_block_ids:
            engine.allocator.evict((0, block_id))
            snapshots.pop(block_id, None)
        registrations = sequence_blocks(engine, step)
        generated |= {block_id for _, _, block_id in step.sequence_blocks}
        on_generated += sum(1 for c in step.prefill_chunks if c.is_first and generated & set(c.prefix_block_ids))
        outputs: list | None = []
        if not step.is_empty and cancel_rng is not None and cancel_rng.random() < refuse_rate:
            engine.refused(
                [PrefillInput(c.request_id, np.asarray(c.token_ids), None, c.is_last) for c in step.prefill_chunks]
            )
            outputs = None
        elif not step.is_empty:
            result = engine.step(prefill_inputs(step), step.decode_ids)
            outputs = [RequestOutput(o.request_id, o.token_id, o.logprob, error=o.error) for o in result.outputs]
            for o in result.outputs:  # the prompt's scores as the engine gives them, chunk by chunk
                if o.prompt is not None and results.get(o.request_id) is not None:
                    results[o.request_id] += [(None, float(x)) for x in o.prompt.logprobs]
        if outputs is not None:
            for rid, index, key in registrations:
                engine.allocator.register(rid, index, key)
        in_flight.append((step, outputs))
        # two steps in flight, as the router keeps them; all answered when nothing more can be scheduled
        while len(in_flight) == 2 or (in_flight and (not s.requests or step.is_empty)):
            done, out = in_flight.pop(0)
            if out is None:  # refused: the batching loop fails every request the step carried
                s.refused(done)
                for rid in done.num_scheduled_tokens:
                    s.finish(rid, FinishReason.ERROR)
                    results[rid] = None
                continue
            for o in s.update(done, out):
                assert not o.error or refuse_rate, o
                if o.error:
                    results[o.request_id] = None
                elif results.get(o.request_id) is not None:
                    results[o.request_id].append((o.token_id, o.logprob))
                    rid = o.request_id
                    if o.finish_reason is not None and rid < NEXT_TURN:  # the conversation goes on
                        answer = [t for t, _ in results[rid] if t is not None]
                        prompts[rid + NEXT_TURN] = prompts[rid] + answer + [5 + rid % 200, 9]
                        pending.insert(
                            0, (rid + NEXT_TURN, (prompts[rid + NEXT_TURN], 3, SamplingParams(logprobs=True), 0))
                        )
        cache = s.prefix_cache
        if cache is not None:
            for block in cache.blocks.values():  # every cached, settled block keeps the KV it was written with
                if block.block_id in cache._unsettled:
                    continue
                pool_block = engine.allocator.cached[(0, block.block_id)]
                k, v = _kv_of(engine, pool_block)
                first = snapshots.setdefault(block.block_id, (k, v))
                unchanged = np.array_equal(first[0], k) and np.array_equal(first[1], v)
                assert unchanged, f"cached block {block.block_id} was written while cached"
    step = s.schedule()  # the last frees
    engine.release(step.free_ids)
    for block_id in step.evict_block_ids:
        engine.allocator.evict((0, block_id))
    assert not engine.sequences and engine.allocator.num_used_blocks == 0 and s.num_used_blocks == 0
    cached = s.prefix_cache.num_cached_blocks if s.prefix_cache else 0
    assert engine.allocator.num_free_blocks - (ENGINE_BLOCKS - num_blocks) == s.num_free_blocks == num_blocks - cached
    for key in list(engine.allocator.cached):  # the next run starts on an empty cache
        engine.allocator.evict(key)
    s.on_generated = on_generated  # next turns that started on an answer's blocks
    return results, s


def _compare(cached: dict, plain: dict) -> int:
    compared = 0
    for rid, tokens in cached.items():
        if tokens is None:
            continue
        compared += 1
        assert [t for t, _ in tokens] == [t for t, _ in plain[rid]], rid
        np.testing.assert_allclose(
            [lp for _, lp in tokens], [lp for _, lp in plain[rid]], rtol=1e-4, atol=1e-5, equal_nan=True
        )
    return compared


@pytest.mark.parametrize("seed,refuse_rate", [(3, 0.0), (8, 0.0), (21, 0.08), (15, 0.08)])
def test_the_scheduler_on_the_engine_gives_equal_tokens_with_the_cache_on(engine, seed, refuse_rate):
    traffic = _traffic(seed, 40)
    cached, s = _run(engine, traffic, True, cancel_seed=seed, refuse_rate=refuse_rate)
    plain, _ = _run(engine, traffic, False, cancel_seed=None)
    assert _compare(cached, plain) >= 12
    assert s.prefix_cache.num_hit_tokens > 0 and s.prefix_cache.num_evicted > 0


@pytest.mark.parametrize("seed", [4, 9])
def test_next_turns_start_on_their_answers_blocks(engine, seed):
    """A pool large enough to keep a finished request's blocks until its next turn arrives: next turns start on
    the blocks its answer filled, with the same tokens as with the cache off."""
    traffic = _traffic(seed, 30)
    cached, s = _run(engine, traffic, True, cancel_seed=seed, num_blocks=ENGINE_BLOCKS)
    plain, _ = _run(engine, traffic, False, cancel_seed=None, num_blocks=ENGINE_BLOCKS)
    assert _compare(cached, plain) >= 30 and s.on_generated > 0
