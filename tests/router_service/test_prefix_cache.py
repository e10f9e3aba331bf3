"""The router's prefix cache inside the scheduler, against a model of the worker's pool (the real BlockAllocator
following the steps' instructions): random shared-prefix traffic with cancels, sequence errors and refused steps
keeps the two views equal, never over-admits, and leaves nothing behind."""

import random

import pytest

from common.errors import CapacityError
from expert_service.engine.kv_cache import BlockAllocator
from router_service.prefix_cache import PrefixCache, PrefixState
from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits

BLOCK = 4


def make(blocks=32, max_batch_tokens=12, max_batch_size=6):
    limits = SchedulerLimits(max_batch_size, max_batch_tokens, BLOCK, blocks)
    return Scheduler(limits, PrefixCache(BLOCK, b"model"))


class WorkerModel:
    """The worker's pool as the step stream drives it (one step at a time)."""

    def __init__(self, blocks):
        self.pool = BlockAllocator(blocks, BLOCK)
        self.cached: dict[int, int] = {}  # sequence -> tokens whose KV it holds

    def run(self, step, rng, error_rate=0.0) -> list[RequestOutput]:
        for rid in step.free_ids:
            self.pool.free(rid)
            self.cached.pop(rid, None)
        for block_id in step.evict_block_ids:
            self.pool.evict((0, block_id))
        out = []
        for chunk in step.prefill_chunks:
            rid = chunk.request_id
            if chunk.is_first:
                keys = [(0, b) for b in chunk.prefix_block_ids]
                self.pool.check_attach(keys)  # a stale id would raise: the router must never send one
                if keys:
                    self.pool.attach(rid, keys)
                self.cached[rid] = len(keys) * BLOCK
            start = self.cached[rid]
            self.pool.ensure_capacity(rid, start + len(chunk.token_ids))  # CapacityError: over-admitted
            assert len(chunk.cache_block_ids) == (start + len(chunk.token_ids)) // BLOCK - start // BLOCK
            for index, block_id in enumerate(chunk.cache_block_ids, start // BLOCK):
                if block_id:
                    assert self.pool.register(rid, index, (0, block_id))
            self.cached[rid] = start + len(chunk.token_ids)
            failed = rng.random() < error_rate
            out.append(RequestOutput(rid, None if not chunk.is_last or failed else 9, error="BOOM" if failed else ""))
        for rid in step.decode_ids:
            self.pool.ensure_capacity(rid, self.cached[rid] + 1)
            self.cached[rid] += 1
            out.append(RequestOutput(rid, 9))
        return out


def refuse(s: Scheduler, worker: WorkerModel, step) -> None:
    """The worker refused the step as a whole after its frees and evictions: the loop fails its requests."""
    for rid in step.free_ids:
        worker.pool.free(rid)
        worker.cached.pop(rid, None)
    for block_id in step.evict_block_ids:
        worker.pool.evict((0, block_id))
    s.refused(step)
    for rid in step.num_scheduled_tokens:
        s.finish(rid, FinishReason.ERROR)


def _check(s: Scheduler, worker: WorkerModel) -> None:
    cache = s.prefix_cache
    reserved = sum(r.num_blocks for r in s.running)
    total = s.num_free_blocks + reserved + cache.num_cached_blocks
    assert total == s.limits.num_kv_blocks
    assert s.num_free_blocks >= 0
    # every block the router offers is on the worker (the worker may hold more: registrations in flight)
    assert {b.block_id for b in cache.blocks.values()} <= {k[1] for k in worker.pool.cached}


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_keeps_router_and_worker_pools_equal(seed):
    rng = random.Random(seed)
    s, worker = make(), WorkerModel(32)
    systems = [[rng.randrange(100) for _ in range(n)] for n in (7, 12, 17)]
    next_id = 1
    for _ in range(160):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(systems) + [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
            s.add(
                ScheduledRequest(
                    next_id, prompt, rng.randrange(1, 6), cache_salt=rng.choice(["", "", "b"]),
                    penalized=rng.random() < 0.1,
                )
            )  # fmt: skip
            next_id += 1
        if s.requests and rng.random() < 0.1:
            s.finish(rng.choice(list(s.requests)), FinishReason.CANCELLED)
        step = s.schedule()
        if rng.random() < 0.05 and not step.is_empty:  # refused as a whole: nothing ran
            refuse(s, worker, step)
        else:
            s.update(step, worker.run(step, rng, error_rate=0.05))
        _check(s, worker)
    while s.requests:  # drain
        step = s.schedule()
        s.update(step, worker.run(step, rng))
    step = s.schedule()
    worker.run(step, rng)
    _check(s, worker)
    assert worker.pool.num_used_blocks == 0 and s.num_used_blocks == 0
    # quiescent: both sides hold exactly the same cached blocks, the rest of the pool is free on both
    assert {b.block_id for b in s.prefix_cache.blocks.values()} == {k[1] for k in worker.pool.cached}
    assert worker.pool.num_free_blocks == s.num_free_blocks == 32 - s.prefix_cache.num_cached_blocks
    assert s.prefix_cache.num_evicted > 0 and s.prefix_cache.num_hit_tokens > 0


def test_hits_skip_the_prompt_and_leave_its_last_token():
    s, worker, rng = make(), WorkerModel(32), random.Random(0)
    prompt = list(range(1, 13))  # exactly 3 blocks
    s.add(ScheduledRequest(1, prompt, 2))
    step = s.schedule()
    assert step.prefill_chunks[0].cache_block_ids == (1, 2, 3)
    s.update(step, worker.run(step, rng))
    s.add(ScheduledRequest(2, prompt, 2))
    step = s.schedule()
    chunk = next(c for c in step.prefill_chunks if c.request_id == 2)
    # the whole prompt is cached, yet its last block is recomputed: the last token's logits sample
    assert chunk.is_first and chunk.prefix_block_ids == (1, 2) and chunk.token_ids == tuple(prompt[8:])
    assert s.requests[2].num_cached_tokens == 8 and chunk.cache_block_ids == (0,)


def test_a_request_waits_for_the_prefix_a_running_one_computes():
    s = make(max_batch_tokens=4)
    prompt = list(range(1, 14))
    s.add(ScheduledRequest(1, prompt, 2))
    s.add(ScheduledRequest(2, prompt, 2))
    s.add(ScheduledRequest(3, [50, 51], 2))
    step = s.schedule()
    assert [c.request_id for c in step.prefill_chunks] == [1]
    assert [r.request_id for r in s.waiting] == [2, 3]  # 2 waits, keeping its place
    s.update(step, [RequestOutput(1, None)])  # its first block is cached now, the second is being computed
    step = s.schedule()
    assert s.waiting[0].request_id == 2 and 2 not in step.num_scheduled_tokens
    while 2 not in step.num_scheduled_tokens:
        s.update(step, _answers(step))
        step = s.schedule()
    assert s.requests[1].num_computed_tokens == 12  # admitted once all three of 1's blocks were cached
    chunk = next(c for c in step.prefill_chunks if c.request_id == 2)
    assert chunk.prefix_block_ids == (1, 2, 3) and chunk.token_ids == (13,)


def _answers(step):
    out = [RequestOutput(c.request_id, 9 if c.is_last else None) for c in step.prefill_chunks]
    return out + [RequestOutput(i, 9) for i in step.decode_ids]


def test_lookups_without_a_hit_and_salts():
    cache = PrefixCache(BLOCK, b"m")
    tokens = list(range(20))
    assert cache.hashes(tokens) == cache.hashes(tokens)
    assert cache.hashes(tokens)[0] != cache.hashes(tokens, "salt")[0]
    assert cache.hashes(tokens)[1] != PrefixCache(BLOCK, b"other").hashes(tokens)[1]
    assert len(cache.hashes(tokens[:7])) == 1
    assert cache.lookup(PrefixState(cache.hashes(tokens), may_hit=True), 20) == 0
    assert cache.lookup(PrefixState(cache.hashes(tokens), may_hit=False), 20) == 0


def test_worker_refuses_a_stale_prefix_and_over_admission():
    pool = BlockAllocator(4, BLOCK)
    with pytest.raises(KeyError):
        pool.check_attach([(0, 5)])
    pool.ensure_capacity(1, 8)
    assert pool.register(1, 0, (0, 7)) and pool.register(1, 0, (0, 7))  # again: a no-op
    assert not pool.register(1, 1, (0, 7))  # the id names another block
    pool.attach(2, [(0, 7)])
    pool.free(1)
    assert pool.num_used_blocks == 1 and pool.num_free_blocks == 3  # 2 still holds the shared block
    assert pool.evict((0, 7)) and pool.num_free_blocks == 3  # held: returns with its holder
    pool.free(2)
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    with pytest.raises(CapacityError):
        pool.ensure_capacity(3, 17)


def test_a_scored_prompt_neither_hits_nor_holds_others_up():
    s = make(max_batch_tokens=8)
    prompt = list(range(1, 14))
    s.add(ScheduledRequest(1, prompt, 2, scores_prompt=True))  # prompt_logprobs: at most 6 rows a step
    s.add(ScheduledRequest(2, prompt, 2))
    step = s.schedule()
    # 1 caches nothing, so 2 does not wait for it: both start at once, each computing the prompt
    assert step.num_scheduled_tokens == {1: 6, 2: 2}
    assert [c.cache_block_ids for c in step.prefill_chunks] == [(0,), ()]


def test_a_penalised_request_hits_and_sends_its_prefix_tokens_once_when_its_penalty_counts_them():
    """A repetition penalty counts the cached prefix's tokens: they go with the first chunk only, not with the later
    chunks of a prompt split by the step budget nor with any decode; a presence/frequency-only request (no prompt
    counted) sends none, and neither does an unpenalised one."""
    rng = random.Random()
    s, worker = make(max_batch_tokens=6), WorkerModel(64)
    cached_blocks = rng.randrange(2, 5)
    prompt = [rng.randrange(100) for _ in range(cached_blocks * BLOCK + rng.randrange(1, BLOCK))]
    s.add(ScheduledRequest(1, prompt, 1))
    while s.requests:
        step = s.schedule()
        s.update(step, worker.run(step, rng))
    repetition = ScheduledRequest(2, prompt + [7] * 9, 4, penalized=True, sends_prefix_tokens=True)
    s.add(repetition)
    s.add(ScheduledRequest(3, prompt + [8] * 9, 4, penalized=True))  # presence/frequency only
    s.add(ScheduledRequest(4, prompt + [9] * 9, 4))
    sent: dict[int, list[tuple[int, ...]]] = {2: [], 3: [], 4: []}  # each request's prefix tokens, step by step
    chunks_sent = 0
    while s.requests:
        step = s.schedule()
        for chunk in step.prefill_chunks:
            sent[chunk.request_id].append(chunk.prefix_token_ids)
            chunks_sent += 1
            assert chunk.prefix_block_ids or not chunk.is_first
        for rid in step.decode_ids:
            sent[rid].append(())
        s.update(step, worker.run(step, rng))
    assert chunks_sent > 3  # the budget split the prompts' rest
    assert sent[2][0] == tuple(prompt[: cached_blocks * BLOCK]) and not any(sent[2][1:])
    assert len(sent[2]) > 4 and not any(sent[3]) and not any(sent[4])


def _blocks_lost_by_the_worker():
    """A prompt's blocks cached by a finished request, then lost on the worker while the router's index keeps them."""
    s, worker, rng = make(), WorkerModel(32), random.Random(0)
    prompt = list(range(1, 15))
    s.add(ScheduledRequest(1, prompt, 2))
    step = s.schedule()
    s.update(step, worker.run(step, rng))
    s.finish(1, FinishReason.LENGTH)
    worker.pool.free(1)
    for key in list(worker.pool.cached):  # gone on the worker, still in the router's index
        worker.pool.evict(key)
    return s, worker, rng, prompt


def test_blocks_the_worker_lacks_leave_the_index_when_a_sequence_is_refused_on_them():
    """The worker lost cached blocks the router still offers (an authenticated ClearCache from another caller): the
    sequence started on them is refused UNKNOWN_PREFIX_BLOCK, and its blocks leave the index, so the next request
    computes the prefix again instead of being refused on the same stale ids for as long as they stay cached."""
    s, worker, rng, prompt = _blocks_lost_by_the_worker()
    s.add(ScheduledRequest(2, prompt, 2))
    step = s.schedule()
    assert step.prefill_chunks[0].prefix_block_ids == (1, 2, 3)
    outputs = s.update(step, [RequestOutput(2, None, error="UNKNOWN_PREFIX_BLOCK")])
    assert outputs[0].error == "UNKNOWN_PREFIX_BLOCK"
    assert not s.prefix_cache.blocks and s.prefix_cache.num_cached_blocks == 0
    s.add(ScheduledRequest(3, prompt, 2))
    step = s.schedule()
    chunk = step.prefill_chunks[0]
    assert chunk.prefix_block_ids == () and chunk.token_ids == tuple(prompt[:12])  # computed again ...
    assert chunk.cache_block_ids == (4, 5, 6) and set(step.evict_block_ids) == {1, 2, 3}  # ... and cached anew
    s.update(step, worker.run(step, rng))
    _check(s, worker)


def test_lost_blocks_leave_the_index_even_when_the_request_refused_on_them_is_gone():
    """The request refused on blocks the worker lost was cancelled (or its deadline passed) before that answer came:
    the answer still names the blocks (the step's chunk carries them), so they leave the index all the same."""
    s, worker, rng, prompt = _blocks_lost_by_the_worker()
    s.add(ScheduledRequest(2, prompt, 2))
    step = s.schedule()
    s.finish(2, FinishReason.CANCELLED)
    assert s.update(step, [RequestOutput(2, None, error="UNKNOWN_PREFIX_BLOCK")]) == []
    assert not s.prefix_cache.blocks
    s.add(ScheduledRequest(3, prompt, 2))
    assert s.schedule().prefill_chunks[0].prefix_block_ids == ()
