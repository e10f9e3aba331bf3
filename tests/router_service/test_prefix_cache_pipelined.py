"""The prefix cache with steps pipelined as the batching loop sends them (step t+1 scheduled before step t's answer
is back): a block is shared from the step after the one writing it, racing requests compute a prefix once, and a
failed registration is evicted only once the requests already on it left; random traffic keeps the router's and
the worker's pools equal."""

import collections
import dataclasses
import random

import pytest

from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest
from tests.router_service.test_prefix_cache import BLOCK, WorkerModel, _answers, _check, make


class PipelinedWorker(WorkerModel):
    """The worker model, plus what the engine does with a sequence it cannot run: a new one on a block that was never
    registered (UNKNOWN_PREFIX_BLOCK; at depth 2 only because its registering step was refused, at 3 or more also
    because the chunk to register it failed alone behind a refused step), or a later chunk or decode of one it never
    started."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.refused_ids: set[int] = set()  # block ids of refused steps: never registered

    def refuse(self, step) -> None:
        for rid in step.free_ids:
            self.pool.free(rid)
            self.cached.pop(rid, None)
        for block_id in step.evict_block_ids:
            self.pool.evict((0, block_id))
        self.refused_ids |= {b for c in step.prefill_chunks for b in c.cache_block_ids if b}

    def run(self, step, rng, error_rate=0.0) -> list[RequestOutput]:
        def runnable(rid, chunk=None) -> bool:
            if chunk is not None and chunk.is_first:
                missing = {b for b in chunk.prefix_block_ids if (0, b) not in self.pool.cached}
                # the router offers only registered blocks, or ones a refused step was to register
                assert missing <= self.refused_ids, f"sequence {rid} starts on unregistered blocks {missing}"
                return not missing
            return rid in self.cached

        chunks = [c for c in step.prefill_chunks if runnable(c.request_id, c)]
        decodes = tuple(rid for rid in step.decode_ids if runnable(rid))
        skipped = {c.request_id for c in step.prefill_chunks} - {c.request_id for c in chunks}
        skipped |= set(step.decode_ids) - set(decodes)
        ran = super().run(dataclasses.replace(step, prefill_chunks=tuple(chunks), decode_ids=decodes), rng, error_rate)
        return ran + [RequestOutput(rid, None, error="UNKNOWN") for rid in skipped]


def _drive(s, worker, rng, steps, traffic, refuse_rate=0.0, error_rate=0.0):
    """Two steps in flight: schedule step t+1, then apply step t's answer."""
    in_flight: collections.deque = collections.deque()
    for i in range(steps):
        traffic(i)
        in_flight.append(s.schedule())
        if len(in_flight) < 2:
            continue
        step = in_flight.popleft()
        if refuse_rate and rng.random() < refuse_rate and not step.is_empty:
            worker.refuse(step)
            s.refused(step)
            for rid in step.num_scheduled_tokens:
                s.finish(rid, FinishReason.ERROR)
        else:
            s.update(step, worker.run(step, rng, error_rate))
        _check_ready(s, worker)
    while in_flight:
        step = in_flight.popleft()
        s.update(step, worker.run(step, rng))
        if s.requests or step.free_ids:
            in_flight.append(s.schedule())


def _check_ready(s, worker) -> None:
    """_check, but the blocks of the step in flight are not on the worker yet: only ready ones must be."""
    cache = s.prefix_cache
    assert s.num_free_blocks + sum(r.num_blocks for r in s.running) + cache.num_cached_blocks == 32
    assert s.num_free_blocks >= 0
    ready = {b.block_id for b in cache.blocks.values() if b.ready_step <= cache._step}
    assert ready - worker.refused_ids <= {k[1] for k in worker.pool.cached}


@pytest.mark.parametrize("seed", range(12))
def test_pipelined_random_traffic_keeps_router_and_worker_pools_equal(seed):
    rng = random.Random(seed)
    s, worker = make(), PipelinedWorker(32)
    systems = [[rng.randrange(100) for _ in range(n)] for n in (7, 12, 17)]
    ids = iter(range(1, 10**6))

    def traffic(_):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(systems) + [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
            s.add(ScheduledRequest(next(ids), prompt, rng.randrange(1, 6), penalized=rng.random() < 0.1))
        if s.requests and rng.random() < 0.1:
            s.finish(rng.choice(list(s.requests)), FinishReason.CANCELLED)

    _drive(s, worker, rng, 200, traffic, refuse_rate=0.05, error_rate=0.05)
    worker.run(s.schedule(), rng)  # the last frees and evictions
    assert worker.pool.num_used_blocks == 0 and s.num_used_blocks == 0
    # quiescent: both sides hold exactly the same cached blocks (failed registrations evicted), the rest is free
    assert {b.block_id for b in s.prefix_cache.blocks.values()} == {k[1] for k in worker.pool.cached}
    assert s.prefix_cache.num_cached_blocks == len(s.prefix_cache.blocks)
    assert worker.pool.num_free_blocks == s.num_free_blocks == 32 - s.prefix_cache.num_cached_blocks
    assert s.prefix_cache.num_hit_tokens > 0


def test_racing_requests_compute_a_shared_prefix_once_and_start_the_step_after():
    s = make(blocks=64, max_batch_tokens=16)
    system = list(range(1, 17))  # 4 blocks
    for rid in range(1, 5):
        s.add(ScheduledRequest(rid, system + [100 + rid, 200 + rid], 2))
    first = s.schedule()
    assert [c.request_id for c in first.prefill_chunks] == [1]  # 16 tokens: the system prompt's 4 blocks
    ids = first.prefill_chunks[0].cache_block_ids
    assert len(ids) == 4 and all(ids)
    second = s.schedule()  # sent before the first step's answer: the blocks are on the worker by then
    chunks = {c.request_id: c for c in second.prefill_chunks}
    assert set(chunks) == {1, 2, 3, 4}
    for rid in (2, 3, 4):
        assert chunks[rid].prefix_block_ids == ids and chunks[rid].token_ids == (100 + rid, 200 + rid)
    assert sum(second.num_scheduled_tokens.values()) == 8  # the system prompt ran once, in the first step
    s.update(first, _answers(first))
    assert s.prefix_cache.num_hit_tokens == 0  # hits count once the worker ran the chunks on them
    s.update(second, _answers(second))
    assert s.prefix_cache.num_hit_tokens == 3 * 16


def test_a_block_is_not_shared_within_the_step_writing_it():
    s = make(blocks=64, max_batch_tokens=8)
    prompt = list(range(1, 14))  # blocks 0-2 cacheable
    s.add(ScheduledRequest(1, prompt, 2))
    s.schedule()  # 1 writes blocks 0 and 1
    s.add(ScheduledRequest(2, prompt, 2))
    step = s.schedule()  # 1 writes block 2 (a running request's chunk, scheduled before admissions)
    assert list(step.num_scheduled_tokens) == [1] and s.waiting[0].request_id == 2
    step = s.schedule()
    chunk = next(c for c in step.prefill_chunks if c.request_id == 2)
    assert len(chunk.prefix_block_ids) == 3 and chunk.token_ids == (13,)


def test_a_failed_registration_is_evicted_once_the_requests_on_it_left():
    s, worker, rng = make(blocks=64, max_batch_tokens=16), PipelinedWorker(64), random.Random(0)
    system = list(range(1, 13))  # 3 blocks
    s.add(ScheduledRequest(1, system + [90], 3))
    first = s.schedule()
    ids = first.prefill_chunks[0].cache_block_ids
    s.add(ScheduledRequest(2, system + [91], 3))
    second = s.schedule()
    assert next(c for c in second.prefill_chunks if c.request_id == 2).prefix_block_ids == ids
    worker.run(first, rng)  # registered on the worker, then the sequence failed (non-finite logits, say)
    s.update(first, [RequestOutput(1, None, error="NON_FINITE_LOGITS")])
    # no new hits on it: a third request computes the prefix again, under new ids
    s.add(ScheduledRequest(3, system + [92], 3))
    third = s.schedule()
    chunk3 = next(c for c in third.prefill_chunks if c.request_id == 3)
    assert chunk3.prefix_block_ids == () and len(set(chunk3.cache_block_ids) - set(ids) - {0}) == 3
    assert not set(ids) & set(third.evict_block_ids)  # 2 still runs on them: kept, still counted
    s.update(second, worker.run(second, rng))
    s.update(third, worker.run(third, rng))
    while s.requests.get(2) is not None:
        step = s.schedule()
        s.update(step, _answers(step))
        assert not set(ids) & set(step.evict_block_ids)
    step = s.schedule()
    assert set(ids) <= set(step.evict_block_ids)  # the last holder left: their room comes back
    assert s.prefix_cache.num_cached_blocks == len(s.prefix_cache.blocks)  # nothing detached is left
    worker.run(step, rng)
    _check(s, worker)
    assert not {(0, b) for b in ids} & set(worker.pool.cached)


def test_a_refused_registration_fails_only_the_requests_already_on_it():
    s, worker, rng = make(blocks=64, max_batch_tokens=16), PipelinedWorker(64), random.Random(0)
    system = list(range(1, 13))
    s.add(ScheduledRequest(1, system + [90], 3))
    first = s.schedule()
    s.add(ScheduledRequest(2, system + [91], 3))
    s.add(ScheduledRequest(3, [5, 6, 7], 3))
    second = s.schedule()
    worker.refuse(first)
    s.refused(first)
    s.finish(1, FinishReason.ERROR)
    outputs = {o.request_id: o for o in s.update(second, worker.run(second, rng))}
    assert outputs[2].error and not outputs[3].error  # 2 started on the refused blocks, 3 did not
    step = s.schedule()
    assert set(first.prefill_chunks[0].cache_block_ids) <= set(step.evict_block_ids)
    worker.run(step, rng)
    _check(s, worker)
    assert s.num_used_blocks == s.limits.blocks_for(3 + 3)  # 3 alone holds blocks


def test_a_failed_request_does_not_offer_the_blocks_its_later_steps_were_to_write():
    s, worker, rng = make(blocks=64, max_batch_tokens=2), PipelinedWorker(64), random.Random(0)
    system = list(range(1, 9))  # 2 blocks
    s.add(ScheduledRequest(1, system + [50], 1))
    while s.requests:  # cached: 1's system prompt blocks
        step = s.schedule()
        s.update(step, worker.run(step, rng))
    s.add(ScheduledRequest(2, system + [60, 61, 62, 63, 64, 65], 2))
    first = s.schedule()  # tokens 8-9: completes no block
    second = s.schedule()  # tokens 10-11 complete block 2: registered by a step behind a doomed one
    assert not any(first.prefill_chunks[0].cache_block_ids) and any(second.prefill_chunks[0].cache_block_ids)
    worker.refuse(first)
    s.refused(first)
    s.finish(2, FinishReason.ERROR)
    s.add(ScheduledRequest(3, system + [60, 61, 62, 63, 70], 2))
    third = s.schedule()
    s.update(second, worker.run(second, rng))  # the worker never knew 2: block 2 is not registered
    chunk = next(c for c in third.prefill_chunks if c.request_id == 3)
    assert len(chunk.prefix_block_ids) == 2  # computes block 2 itself instead of starting on it
    s.update(third, worker.run(third, rng))
    _check(s, worker)


def test_blocks_in_flight_stay_cached_when_the_router_fails_their_request():
    """A request the router ends with an error of its own (its deadline passed, its answer was too large) while a
    step writing its prompt blocks is in flight: the worker runs that step (the free comes with the next one), so
    the blocks are written and stay cached, as they do for a cancel. They were dropped, as if the worker had failed
    the sequence, and the next request with that prompt computed them again."""
    s, worker, rng = make(blocks=64, max_batch_tokens=4), PipelinedWorker(64), random.Random(0)
    prompt = list(range(1, 14))  # 3 blocks and a token
    s.add(ScheduledRequest(1, prompt, 2))
    first, second = s.schedule(), s.schedule()  # blocks 1 and 2, both in flight
    s.finish(1, FinishReason.ERROR)  # as BatchingLoop.fail does for a DeadlineExceeded
    s.update(first, worker.run(first, rng))
    s.update(second, worker.run(second, rng))
    s.add(ScheduledRequest(2, prompt, 2))
    step = s.schedule()
    chunk = next(c for c in step.prefill_chunks if c.request_id == 2)
    assert chunk.prefix_block_ids == (1, 2)
    s.update(step, worker.run(step, rng))
    _check(s, worker)


class EngineLikeWorker(PipelinedWorker):
    """The worker as the engine answers a step behind a refused one: a later chunk of a sequence it never started,
    or one starting past its own count (an earlier chunk was refused with its step), fails alone and registers
    nothing; the rest of the step runs. Any other start the router sends must be the worker's count."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.lost: set[int] = set()  # sequences with a chunk in a refused step
        self.failed_alone = 0

    def refuse(self, step) -> None:
        super().refuse(step)
        self.lost |= {c.request_id for c in step.prefill_chunks}

    def run(self, step, rng, error_rate=0.0) -> list[RequestOutput]:
        chunks, out = [], []
        for c in step.prefill_chunks:
            held = self.cached.get(c.request_id)
            if c.is_first or held == c.start:
                assert c.start == (held or 0) + len(c.prefix_block_ids) * BLOCK * c.is_first
                chunks.append(c)
                continue
            # never started (its first chunk refused, or failed alone), or held short of a refused chunk
            assert held is None or c.request_id in self.lost, f"{c.request_id}: starts at {c.start}, holds {held}"
            out.append(RequestOutput(c.request_id, None, error="UNKNOWN_SEQUENCE" if held is None else "EARLIER"))
            self.failed_alone += 1
        ran = super().run(dataclasses.replace(step, prefill_chunks=tuple(chunks)), rng, error_rate)
        return ran + out


@pytest.mark.parametrize("seed", range(8))
def test_chunks_behind_refusals_fail_alone_and_router_side_failures_leave_nothing_behind(seed):
    """Refused steps, the later chunks of their sequences in the steps behind them (which fail alone, the rest of
    those steps running), and requests failed or cancelled by the router while their registering steps are in
    flight: the pools agree and return to their start."""
    rng = random.Random(seed)
    s, worker = make(), EngineLikeWorker(32)
    systems = [[rng.randrange(100) for _ in range(n)] for n in (7, 12, 17, 25)]
    ids, in_flight = iter(range(1, 10**6)), collections.deque()

    def refuse(step):
        worker.refuse(step)
        s.refused(step)
        for rid in step.num_scheduled_tokens:
            s.finish(rid, FinishReason.ERROR)

    for _ in range(300):
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            prompt = rng.choice(systems) + [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
            s.add(ScheduledRequest(next(ids), prompt, rng.randrange(1, 6), cache_salt=rng.choice(["", "", "x"])))
        if s.requests and rng.random() < 0.2:
            s.finish(rng.choice(list(s.requests)), rng.choice([FinishReason.CANCELLED, FinishReason.ERROR]))
        in_flight.append(s.schedule())
        if len(in_flight) < 2:
            continue
        step = in_flight.popleft()
        if not step.is_empty and rng.random() < 0.05:
            refuse(step)
        else:
            s.update(step, worker.run(step, rng, 0.05))
        _check_ready(s, worker)
    while in_flight:
        step = in_flight.popleft()
        s.update(step, worker.run(step, rng))
        if s.requests or step.free_ids:
            in_flight.append(s.schedule())
    worker.run(s.schedule(), rng)
    cache = s.prefix_cache
    assert worker.failed_alone
    assert worker.pool.num_used_blocks == 0 and s.num_used_blocks == 0
    assert {b.block_id for b in cache.blocks.values()} == {k[1] for k in worker.pool.cached}
    assert worker.pool.num_free_blocks == s.num_free_blocks == 32 - cache.num_cached_blocks == 32 - len(cache.blocks)
    assert all(b.refs == 0 for b in cache.blocks.values()) and not cache._claims and not cache._unsettled


def test_a_refusal_on_a_refused_steps_blocks_keeps_the_prefix_before_them():
    """A sequence refused UNKNOWN_PREFIX_BLOCK because a refused step never registered the tail it started on
    (detached when that refusal came back): the older blocks before that tail, which the worker holds, stay
    cached; only a refusal no detached block explains (the worker lost blocks) takes every block it started on
    out of the index."""
    s, worker, rng = make(blocks=64, max_batch_tokens=16), PipelinedWorker(64), random.Random(0)
    system, tail = list(range(1, 9)), list(range(20, 28))  # 2 blocks each
    s.add(ScheduledRequest(1, system + [90], 1))
    while s.requests:  # cached and settled: the system prompt's blocks 1 and 2
        step = s.schedule()
        s.update(step, worker.run(step, rng))
    s.add(ScheduledRequest(2, system + tail + [91], 2))
    first = s.schedule()  # 2 registers its tail's blocks, 3 and 4
    s.add(ScheduledRequest(3, system + tail + [92], 2))
    second = s.schedule()
    assert next(c for c in second.prefill_chunks if c.request_id == 3).prefix_block_ids == (1, 2, 3, 4)
    worker.refuse(first)
    s.refused(first)
    s.finish(2, FinishReason.ERROR)
    answers = [dataclasses.replace(o, error="UNKNOWN_PREFIX_BLOCK") if o.error else o for o in worker.run(second, rng)]
    assert [o.error for o in s.update(second, answers)] == ["UNKNOWN_PREFIX_BLOCK"]
    s.add(ScheduledRequest(4, system + [93], 2))
    step = s.schedule()
    assert next(c for c in step.prefill_chunks if c.request_id == 4).prefix_block_ids == (1, 2)
    s.update(step, worker.run(step, rng))
    _check(s, worker)
