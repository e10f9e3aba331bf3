"""Prefix caching of generated tokens: the router registers the full blocks a running request's decodes wrote
(prompt tail and generated tokens) with the step feeding their last position (the worker registers them once it
launched that step), so a chat's next turn, which resends the answer, starts on them. Against the worker's pool model of test_prefix_cache.py:
random traffic with continuations of finished requests, cancels, sequence errors and refused steps keeps both
views equal and leaves nothing behind; a worker that does not cache generated blocks is never asked to."""

import random

import pytest

from router_service.prefix_cache import PrefixCache
from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits
from tests.router_service.test_prefix_cache import BLOCK, WorkerModel, _check, refuse


def make(blocks=48, caches_generated=True):
    return Scheduler(SchedulerLimits(6, 12, BLOCK, blocks), PrefixCache(BLOCK, b"model", caches_generated))


class GeneratingWorker(WorkerModel):
    """The pool model, registering running sequences' blocks as the step asks once the step ran (each full,
    written by this step or an earlier one), and sampling random tokens so generated blocks differ."""

    def run(self, step, rng, error_rate=0.0) -> list[RequestOutput]:
        out = super().run(step, rng, error_rate)
        for rid, index, block_id in step.sequence_blocks:
            assert index < self.cached[rid] // BLOCK, "a block registered before its last position was written"
            assert self.pool.register(rid, index, (0, block_id))
        return [RequestOutput(o.request_id, rng.randrange(100), error=o.error) if o.token_id else o for o in out]


@pytest.mark.parametrize("seed", range(10))
def test_random_traffic_with_continuations_keeps_both_pools_equal(seed):
    rng = random.Random(seed)
    s, worker = make(), GeneratingWorker(48)
    finished: list[list[int]] = []  # prompt + output of requests that ended, for next turns
    outputs: dict[int, list[int]] = {}
    next_id, generated_ids, generated_hits = 1, set(), 0
    for _ in range(200):
        for _ in range(rng.choice([0, 0, 1, 2])):
            if finished and rng.random() < 0.6:  # a next turn: the conversation so far, and a new user turn
                prompt = rng.choice(finished) + [rng.randrange(100) for _ in range(rng.randrange(1, 5))]
            else:
                prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 10))]
            req = ScheduledRequest(next_id, prompt, rng.randrange(1, 9), cache_salt=rng.choice(["", "b"]))
            s.add(req)
            outputs[next_id], next_id = [], next_id + 1
        if s.requests and rng.random() < 0.05:
            s.finish(rng.choice(list(s.requests)), FinishReason.CANCELLED)
        step = s.schedule()
        for rid, index, _ in step.sequence_blocks:  # never a block of the prompt, and never one a hit brought
            assert index >= s.requests[rid].num_prompt_tokens // BLOCK
        if rng.random() < 0.04 and not step.is_empty:  # refused as a whole: nothing ran, nothing registered
            refuse(s, worker, step)
        else:
            before = {rid: list(s.requests[rid].prompt_ids) for rid in step.num_scheduled_tokens}
            for out in s.update(step, worker.run(step, rng, error_rate=0.03)):
                if out.token_id is not None:
                    outputs[out.request_id].append(out.token_id)
                if out.finish_reason is not None and out.finish_reason is not FinishReason.ERROR:
                    finished.append(before[out.request_id] + outputs[out.request_id])
        generated_ids |= {block_id for _, _, block_id in step.sequence_blocks}
        generated_hits += sum(1 for c in step.prefill_chunks if c.is_first and generated_ids & set(c.prefix_block_ids))
        _check(s, worker)
    while s.requests:
        step = s.schedule()
        s.update(step, worker.run(step, rng))
    worker.run(s.schedule(), rng)
    _check(s, worker)
    assert worker.pool.num_used_blocks == 0 and s.num_used_blocks == 0
    assert {b.block_id for b in s.prefix_cache.blocks.values()} == {k[1] for k in worker.pool.cached}
    assert worker.pool.num_free_blocks == s.num_free_blocks == 48 - s.prefix_cache.num_cached_blocks
    assert generated_hits > 0, "no next turn started on an answer's blocks"


def test_a_next_turn_starts_on_the_answers_blocks():
    """A 6-token prompt and 9 new tokens: positions 0-13 are fed (the last token never is), so blocks 1 and 2
    (prompt tail + answer, answer) are registered, each by the step feeding its last position. The next turn
    (prompt + answer + 2 tokens) starts on all three blocks; with a worker that does not cache generated blocks,
    on the prompt's one."""
    prompt = [5, 6, 7, 8, 9, 10]
    for caches_generated, hits in ((True, 3), (False, 1)):
        s, worker, rng = make(caches_generated=caches_generated), GeneratingWorker(48), random.Random(1)
        s.add(ScheduledRequest(1, prompt, 9))
        registered, answer = [], []
        while 1 in s.requests:
            step = s.schedule()
            fed = s.requests[1].num_scheduled_tokens  # this step's decode included
            for _, index, _ in step.sequence_blocks:
                assert (index + 1) * BLOCK == fed, "registered by the step feeding its last position"
                registered.append(index)
            answer += [o.token_id for o in s.update(step, worker.run(step, rng)) if o.token_id is not None]
        assert len(answer) == 9 and registered == ([1, 2] if caches_generated else [])
        s.add(ScheduledRequest(2, prompt + answer + [1, 2], 1))
        step = s.schedule()
        (chunk,) = step.prefill_chunks
        rest = (prompt + answer + [1, 2])[BLOCK * hits :]
        assert len(chunk.prefix_block_ids) == hits and chunk.start == BLOCK * hits
        assert chunk.token_ids == tuple(rest[: len(chunk.token_ids)])
        s.update(step, worker.run(step, rng))
        _check(s, worker)
