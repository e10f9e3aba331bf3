"""The step message's byte budget: with random traffic (long prompts on a cached prefix, repetition penalties that send
its tokens, grammar masks, large logit_bias settings) every StepStreamRequest the scheduler's steps make stays under
the worker's limit and every request finishes; a cached prefix whose tokens cannot fit a step is used as far as
they do; a request whose smallest step cannot fit is refused in one line naming the field."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from common.config import WORKER_MAX_MESSAGE_BYTES
from common.pb import worker_pb2 as pb
from router_service import wire
from router_service.prefix_cache import PrefixCache
from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits
from router_service.step_size import StepSize
from tests.router_service.fake_worker import FakeWorker, harness, ids_request

ROUTER_LIMIT = 256 * 1024 * 1024
TRACEPARENT = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}  # what the router's span adds


def _request(rid: int, prompt: list[int], rng, vocab: int, **kw) -> ScheduledRequest:
    bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, vocab, int(rng.integers(0, 300)))}
    sampling = pb.SamplingParams(seed=rid, logit_bias=bias)
    return ScheduledRequest(
        rid, prompt, int(rng.integers(1, 5)), sampling=sampling, sampling_bytes=sampling.ByteSize(), **kw
    )


def _message(step, step_id: int, mask_words: int, constrained: set[int]) -> pb.StepStreamRequest:
    """The step as the batching loop sends it: a mask for each constrained request sampling in it."""
    sampling = [c.request_id for c in step.prefill_chunks if c.is_last] + list(step.decode_ids)
    masks = {rid: bytes(4 * mask_words) for rid in sampling if rid in constrained}
    message = wire.step_request(step, step_id, masks=masks)
    message.trace_context.update(TRACEPARENT)
    return message


def _run(seed: int, size: StepSize, vocab: int) -> tuple[list[int], int]:
    """Random traffic scheduled step by step (each answered before the next): the sizes of the messages, and how
    many requests were refused as too large for any step."""
    rng = np.random.default_rng(seed)
    block = size.kv_block_size
    s = Scheduler(SchedulerLimits(32, int(rng.integers(1024, 8192)), block, 8192), PrefixCache(block, b"m"), size)
    system = [int(t) for t in rng.integers(0, vocab, int(rng.integers(500, 2000)))]
    constrained: set[int] = set()
    sizes, refused, rid = [], 0, 0
    for step_id in range(1, 2000):
        for _ in range(int(rng.integers(0, 6)) if rid < 60 else 0):
            rid += 1
            tail = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 400)))]
            prompt = system + tail if rng.random() < 0.7 else tail
            penalty, masked = bool(rng.random() < 0.5), bool(rng.random() < 0.3)
            req = _request(rid, prompt, rng, vocab, penalized=penalty, sends_prefix_tokens=penalty, constrained=masked)
            if size.problem(req) is not None:
                refused += 1
                continue
            s.add(req)
            constrained |= {rid} if masked else set()
        step = s.schedule()
        if step.is_empty and not s.requests and rid >= 60:
            return sizes, refused
        sizes.append(_message(step, step_id, -(-vocab // 32), constrained).ByteSize())
        outputs = [
            RequestOutput(c.request_id, int(rng.integers(0, vocab)) if c.is_last else None) for c in step.prefill_chunks
        ]
        s.update(step, outputs + [RequestOutput(i, int(rng.integers(0, vocab))) for i in step.decode_ids])
    raise AssertionError(f"{len(s.requests)} requests never finished")


@pytest.mark.parametrize("seed", range(8))
def test_every_step_message_stays_under_the_workers_limit_and_every_request_finishes(seed):
    rng = np.random.default_rng(1000 + seed)
    vocab, block = int(rng.choice([300, 32000, 152064])), int(rng.choice([4, 16]))
    unbounded, _ = _run(seed, StepSize(mask_bytes=8 + -(-vocab // 32) * 4, kv_block_size=block), vocab)
    limit = max(8192, int(max(unbounded) * rng.uniform(0.3, 0.7)))
    assert max(unbounded) > limit, "the traffic was meant to pass the limit in some step"
    sizes, refused = _run(seed, StepSize.of(limit, ROUTER_LIMIT, vocab, block), vocab)
    assert max(sizes) <= limit
    assert refused < 60


def _drive(s: Scheduler, limit: int, vocab: int) -> list:
    """Steps until every request finished, each message under `limit`; the first chunks sent."""
    first_chunks = []
    for step_id in range(1, 400):
        step = s.schedule()
        if step.is_empty and not s.requests:
            return first_chunks
        assert _message(step, step_id, -(-vocab // 32), set()).ByteSize() <= limit
        first_chunks += [c for c in step.prefill_chunks if c.is_first]
        s.update(step, [RequestOutput(c.request_id, 3 if c.is_last else None) for c in step.prefill_chunks])
    raise AssertionError("the requests never finished")


def test_a_penalised_request_starts_on_as_much_of_its_cached_prefix_as_a_step_can_carry():
    """A 4,000-token cached prefix is 12 KB of tokens a repetition penalty sends: past an 8 KiB limit, the request
    starts on fewer cached blocks and computes the rest again."""
    rng = np.random.default_rng(5)
    limit, vocab, block = 8 * 1024, 32000, 16
    size = StepSize.of(limit, ROUTER_LIMIT, vocab, block)
    s = Scheduler(SchedulerLimits(8, 512, block, 1024), PrefixCache(block, b"m"), size)
    prefix = [int(t) for t in rng.integers(0, vocab, 4000)]
    s.add(ScheduledRequest(1, prefix + [1], 1, sampling=pb.SamplingParams()))
    _drive(s, limit, vocab)  # request 1 computes the prefix, cached from then on
    s.add(ScheduledRequest(2, prefix + [2], 1, sampling=pb.SamplingParams(), penalized=True, sends_prefix_tokens=True))
    (penalised,) = _drive(s, limit, vocab)
    assert 0 < len(penalised.prefix_block_ids) < len(prefix) // block
    assert len(penalised.prefix_token_ids) == len(penalised.prefix_block_ids) * block


@pytest.mark.parametrize(
    "changes, field",
    [({"constrained": True}, "parameters.constraint"), ({"logit_bias": 300}, "parameters")],
)
def test_a_request_whose_smallest_step_cannot_fit_is_named(changes, field):
    rng = np.random.default_rng(len(field))
    size = StepSize.of(2048, ROUTER_LIMIT, 152064, 16)
    bias = {int(t): 1.0 for t in rng.integers(0, 152064, changes.get("logit_bias", 0))}
    sampling = pb.SamplingParams(logit_bias=bias)
    req = ScheduledRequest(
        1, [5, 6], 2, sampling=sampling, sampling_bytes=sampling.ByteSize(), constrained="constrained" in changes
    )
    problem = size.problem(req)
    assert problem is not None and problem[0] == field
    assert "2048 bytes" in problem[1] and "--max-message-bytes" in problem[1] and "\n" not in problem[1]
    assert size.problem(ScheduledRequest(1, [5, 6], 2, sampling=pb.SamplingParams())) is None


def test_an_older_worker_is_held_to_the_default_limit_and_the_router_to_its_own():
    assert StepSize.of(0, ROUTER_LIMIT, 300, 4).limit == WORKER_MAX_MESSAGE_BYTES
    router_bound = StepSize.of(0, 4096, 300, 4)
    assert router_bound.limit == 4096 and "--worker-max-message-bytes" in router_bound.limit_source


class SmallLimitWorker(FakeWorker):
    """A fake worker that reports a receive limit of `limit` bytes."""

    def __init__(self, limit: int, **kw):
        super().__init__(**kw)
        self.limit = limit

    async def Info(self, request, context):
        info = await super().Info(request, context)
        info.max_message_bytes = self.limit
        return info


def test_the_router_refuses_a_request_no_step_to_the_worker_could_carry_and_serves_the_rest():
    async def main():
        async with harness(SmallLimitWorker(2048)) as (router, fake, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(ids_request([5, 6], max_new_tokens=2, logit_bias={t: 1.0 for t in range(3, 203)}))
            ok = await stub.Generate(ids_request([5, 6], max_new_tokens=2))
            return refused.value, ok, router.batching_loop.num_active

    refused, ok, active = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("parameters: its sampling settings") and "\n" not in refused.details()
    assert ok.generated_tokens == 2 and active == 0


def test_bytes_reserved_for_the_late_masks_come_out_of_the_steps_budget():
    size = StepSize.of(8192, ROUTER_LIMIT, 300, 4)
    s = Scheduler(SchedulerLimits(8, 64, 4, 64), step_size=size)
    s.add(ScheduledRequest(1, [5, 6, 7], 2, sampling=pb.SamplingParams()))
    assert s.schedule(reserved_bytes=size.max_bytes).is_empty  # the late masks take the whole message
    assert s.schedule().num_scheduled_tokens == {1: 3}


def test_a_burst_of_frees_past_the_limit_goes_over_steps_that_run_nothing_until_it_is_out():
    """Hundreds of requests on the worker cancelled at once: their frees alone pass a 4 KiB limit. They go over as
    many steps as they need, none of which runs work (the worker must free the blocks before a step may use them)."""
    rng = np.random.default_rng()
    limit, n = 4096, int(rng.integers(530, 900))  # their ids alone: over 4 KiB
    size = StepSize.of(limit, ROUTER_LIMIT, 300, 4)
    s = Scheduler(SchedulerLimits(1024, 1 << 20, 4, 1 << 16), step_size=size)
    for rid in range(1, n + 1):
        s.add(ScheduledRequest(rid, [int(rng.integers(0, 300))], 1, sampling=pb.SamplingParams()))
    for step_id in range(1, 1000):  # their first chunks, a few dozen a step, none answered yet (pipelined)
        step = s.schedule()
        if step.is_empty:
            break
        assert _message(step, step_id, 10, set()).ByteSize() <= limit
    assert all(s.requests[rid].is_on_worker for rid in range(1, n + 1))
    for rid in range(1, n + 1):
        s.finish(rid, FinishReason.CANCELLED)
    s.add(ScheduledRequest(n + 1, [5, 6], 1, sampling=pb.SamplingParams()))
    freed: set[int] = set()
    while freed != set(range(1, n + 1)):
        step = s.schedule()
        assert _message(step, 1, 10, set()).ByteSize() <= limit
        assert not freed & step.free_ids and (step.is_empty or freed | step.free_ids == set(range(1, n + 1)))
        freed |= step.free_ids
    assert s.requests[n + 1].is_on_worker or s.schedule().num_scheduled_tokens == {n + 1: 2}


def test_an_admission_needing_more_evictions_than_a_step_carries_makes_its_room_over_several():
    """A 4 KiB limit carries ~350 block ids: a request whose room needs 600 cached blocks evicted would wait for ever
    (and the queue behind it) if they had to ride its first step; they go ahead of it, a step's worth at a time."""
    rng = np.random.default_rng()
    limit, block, blocks = 4096, 1, int(rng.integers(600, 900))
    s = Scheduler(
        SchedulerLimits(8, 8192, block, blocks), PrefixCache(block, b"m"), StepSize.of(limit, ROUTER_LIMIT, 300, block)
    )
    filler = [int(t) for t in rng.integers(0, 300, blocks - 2)]
    s.add(ScheduledRequest(1, filler, 1, sampling=pb.SamplingParams()))
    _drive(s, limit, 300)  # its blocks stay cached, unreferenced: all but one must go for the next request
    assert s.prefix_cache is not None and s.prefix_cache.num_evictable_blocks > 350
    s.add(ScheduledRequest(2, [int(t) for t in rng.integers(0, 300, blocks - 1)], 1, sampling=pb.SamplingParams()))
    s.add(ScheduledRequest(3, [5, 6], 1, sampling=pb.SamplingParams()))
    _drive(s, limit, 300)


def test_a_limit_too_small_for_any_step_is_named_not_a_request_field_it_lacks():
    """At a 1,100-byte limit (the config allows 1,024) the margin leaves no room for any first step: the refusal
    names the limit, not a grammar mask or routing plan the request does not have."""
    size = StepSize.of(int(np.random.default_rng().integers(1024, 1150)), ROUTER_LIMIT, 300, 4)
    problem = size.problem(ScheduledRequest(1, [5, 6], 2, sampling=pb.SamplingParams(seed=3), sampling_bytes=2))
    assert problem is not None and problem[0] == "parameters" and "--max-message-bytes" in problem[1]
    assert "mask" not in problem[1] and "routing plan" not in problem[1] and "sampling settings" not in problem[1]


def test_an_admission_sizes_its_first_chunk_once(monkeypatch):
    """The admission's check that a first chunk fits finds how many tokens do; the chunk is cut to that count, not
    found again by a second bisection over the same room (on cached blocks too)."""
    size, calls = StepSize.of(8192, ROUTER_LIMIT, 300, 4), []
    fit = StepSize.tokens_that_fit

    def counted(self, *args):
        calls.append(args)
        return fit(self, *args)

    s = Scheduler(SchedulerLimits(8, 64, 4, 64), PrefixCache(4, b"m"), size)
    s.add(ScheduledRequest(1, list(range(1, 14)), 1, sampling=pb.SamplingParams()))
    _drive(s, 8192, 300)  # its 3 full blocks stay cached
    monkeypatch.setattr(StepSize, "tokens_that_fit", counted)
    for rid in (2, 3, 4):
        s.add(ScheduledRequest(rid, list(range(1, 14)) + [rid] * 30, 1, sampling=pb.SamplingParams()))
    step = s.schedule()
    chunks = [(c.request_id, c.start, len(c.token_ids)) for c in step.prefill_chunks]
    assert chunks == [(2, 12, 31), (3, 12, 31), (4, 12, 2)]  # each on the 3 cached blocks; the last cut to 64 tokens
    assert len(calls) == 3
