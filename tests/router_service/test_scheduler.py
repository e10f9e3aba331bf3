"""Scheduler: token budget, chunked prefill, admission by KV blocks, join/leave between steps."""

import numpy as np
import pytest

from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits, Status


def make(max_batch_size=8, max_batch_tokens=16, block=4, blocks=64):
    return Scheduler(SchedulerLimits(max_batch_size, max_batch_tokens, block, blocks))


def req(rid, n_prompt=4, max_new=4, **kw):
    return ScheduledRequest(rid, list(range(1, n_prompt + 1)), max_new, **kw)


def tokens_for(step, token=7):
    """What a worker would answer: a token for every last chunk and every decode."""
    out = [RequestOutput(c.request_id, token if c.is_last else None) for c in step.prefill_chunks]
    return out + [RequestOutput(i, token) for i in step.decode_ids]


def test_single_request_prefill_then_decode_until_length():
    s = make()
    s.add(req(1, n_prompt=5, max_new=3))
    step = s.schedule()
    assert step.kind == "prefill" and step.num_scheduled_tokens == {1: 5}
    assert step.prefill_chunks[0].is_first and step.prefill_chunks[0].is_last
    outs = s.update(step, tokens_for(step))
    assert outs == [RequestOutput(1, 7, None, None)]
    step = s.schedule()
    assert step.kind == "decode" and step.decode_ids == (1,)
    s.update(step, tokens_for(step))
    step = s.schedule()
    outs = s.update(step, tokens_for(step))
    assert outs[0].finish_reason is FinishReason.LENGTH
    assert s.num_used_blocks == 0 and 1 not in s.requests
    step = s.schedule()  # the worker is told to free it, nothing runs
    assert step.is_empty and step.free_ids == {1}


def test_token_budget_chunks_long_prompt():
    s = make(max_batch_tokens=6)
    s.add(req(1, n_prompt=14, max_new=2))
    chunks = []
    while True:
        step = s.schedule()
        assert step.num_tokens <= 6
        chunks += step.prefill_chunks
        s.update(step, tokens_for(step))
        if chunks[-1].is_last:
            break
    assert [len(c.token_ids) for c in chunks] == [6, 6, 2]
    assert [c.is_first for c in chunks] == [True, False, False]
    assert sum((c.token_ids for c in chunks), ()) == tuple(range(1, 15))
    assert s.requests[1].num_computed_tokens == 14 and s.requests[1].output_ids == [7]


def test_decodes_first_then_prefill_fills_remaining_budget():
    s = make(max_batch_tokens=8)
    s.add(req(1, n_prompt=3, max_new=10))
    s.add(req(2, n_prompt=3, max_new=10))
    step = s.schedule()
    s.update(step, tokens_for(step))
    s.add(req(3, n_prompt=20, max_new=2))  # joins between steps
    step = s.schedule()
    assert step.kind == "prefill" and step.decode_ids == (1, 2)
    assert step.num_scheduled_tokens == {1: 1, 2: 1, 3: 6}
    assert step.prefill_chunks[0].is_first and not step.prefill_chunks[0].is_last


def test_step_carries_each_decode_input_token():
    """The routing planner reads decode tokens from the step: each is the token its request sampled last."""
    s = make()
    s.add(req(1, n_prompt=3, max_new=10))
    s.add(req(2, n_prompt=2, max_new=10))
    step = s.schedule()
    assert step.decode_token_ids == ()
    s.update(step, [RequestOutput(1, 40), RequestOutput(2, 41)])
    step = s.schedule()
    assert step.decode_ids == (1, 2) and step.decode_token_ids == (40, 41)
    s.update(step, [RequestOutput(1, 50), RequestOutput(2, 51)])
    assert s.schedule().decode_token_ids == (50, 51)


def test_max_batch_size():
    s = make(max_batch_size=2, max_batch_tokens=100)
    for rid in (1, 2, 3):
        s.add(req(rid))
    step = s.schedule()
    assert set(step.num_scheduled_tokens) == {1, 2} and s.num_waiting == 1
    s.update(step, tokens_for(step))
    s.finish(1, FinishReason.CANCELLED)
    step = s.schedule()
    assert set(step.num_scheduled_tokens) == {2, 3}


def test_admission_by_free_blocks_and_head_of_line():
    s = make(max_batch_tokens=100, block=4, blocks=4)  # 16 tokens of KV
    s.add(req(1, n_prompt=6, max_new=6))  # 12 tokens -> 3 blocks
    s.add(req(2, n_prompt=4, max_new=4))  # 2 blocks: does not fit beside 1
    s.add(req(3, n_prompt=1, max_new=1))  # would fit, but FIFO: not before 2
    step = s.schedule()
    assert set(step.num_scheduled_tokens) == {1} and s.num_free_blocks == 1
    s.update(step, tokens_for(step))
    s.finish(1, FinishReason.STOP_SEQUENCE)
    assert s.num_free_blocks == 4  # freed at once
    step = s.schedule()
    assert set(step.num_scheduled_tokens) == {2, 3} and step.free_ids == {1}
    with pytest.raises(ValueError):
        s.add(req(9, n_prompt=10, max_new=10))  # needs 5 blocks of 4


def test_cancel_while_queued_is_never_prefilled():
    s = make(max_batch_size=1)
    s.add(req(1))
    s.add(req(2))
    step = s.schedule()
    s.finish(2, FinishReason.CANCELLED)
    s.update(step, tokens_for(step))
    for _ in range(5):
        step = s.schedule()
        assert 2 not in step.num_scheduled_tokens and 2 not in step.free_ids
        s.update(step, tokens_for(step))


def test_cancel_during_step_output_is_dropped_and_freed():
    s = make()
    s.add(req(1))
    s.add(req(2))
    step = s.schedule()
    s.finish(1, FinishReason.CANCELLED)  # the client left while the step ran
    outs = s.update(step, tokens_for(step))
    assert [o.request_id for o in outs] == [2]
    step = s.schedule()
    assert step.free_ids == {1} and step.decode_ids == (2,)


def test_stop_tokens_eos_and_errors():
    s = make()
    s.add(req(1, eos_token_ids=frozenset({7})))
    s.add(req(2, stop_token_ids=frozenset({7})))
    s.add(req(3))
    step = s.schedule()
    outs = s.update(step, [RequestOutput(1, 7), RequestOutput(2, 7), RequestOutput(3, None, error="NON_FINITE_LOGITS")])
    assert [o.finish_reason for o in outs] == [FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.ERROR]
    assert outs[2].error == "NON_FINITE_LOGITS" and not s.requests and s.num_used_blocks == 0


def test_queue_deadline_expires_waiting_only():
    s = make(max_batch_size=1)
    s.add(req(1, queue_deadline=10.0))
    s.add(req(2, queue_deadline=10.0))
    s.schedule(now=0.0)
    step = s.schedule(now=11.0)
    assert step.expired_ids == (2,) and 1 in s.requests
    assert s.requests[1].status is Status.RUNNING


def test_allocations_equal_frees_after_cancel_storm():
    import random

    rng = random.Random(0)
    s = make(max_batch_size=4, max_batch_tokens=10, block=2, blocks=40)
    next_id, live = 1, set()
    for _ in range(300):
        if rng.random() < 0.5:
            s.add(req(next_id, n_prompt=rng.randint(1, 12), max_new=rng.randint(1, 6)))
            live.add(next_id)
            next_id += 1
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            s.finish(victim, FinishReason.CANCELLED)
        step = s.schedule()
        assert step.num_tokens <= 10 and len(step.num_scheduled_tokens) <= 4
        for _ in s.update(step, tokens_for(step, token=rng.randint(0, 9))):
            pass
        live = set(s.requests)
        assert s.num_used_blocks == sum(x.num_blocks for x in s.requests.values())
    for rid in list(s.requests):
        s.finish(rid, FinishReason.CANCELLED)
    assert s.num_free_blocks == 40


def test_prompt_scoring_requests_take_at_most_max_batch_size_prompt_tokens_a_step():
    """prompt_logprobs makes every prompt position a logits row on the worker: at most max_batch_size a step,
    shared by the scoring requests; admission stays FIFO (a scoring request waiting for budget holds the queue)."""
    s = make(max_batch_size=4, max_batch_tokens=32)
    for rid in (1, 2):
        s.add(req(rid, n_prompt=7, scores_prompt=True))
    s.add(req(3, n_prompt=9))
    steps = []
    while any(r.is_prefilling for r in s.requests.values()):
        step = s.schedule()
        steps.append({c.request_id: len(c.token_ids) for c in step.prefill_chunks})
        s.update(step, tokens_for(step))
    assert steps[0] == {1: 4} and steps[1] == {1: 3, 2: 1, 3: 9}  # 2 waits for budget, 3 behind it
    assert all(sum(n for rid, n in st.items() if rid in (1, 2)) <= 4 for st in steps)
    assert sum(st.get(1, 0) for st in steps) == 7 and sum(st.get(2, 0) for st in steps) == 7


def test_penalised_requests_on_the_worker_are_bounded_by_max_batch_size():
    """The worker holds max_batch_size penalty state slots: a penalised request waits until one is free."""
    s = make(max_batch_size=2, max_batch_tokens=64)
    for rid in (1, 2, 3):
        s.add(req(rid, penalized=True, max_new=2))
    s.add(req(4))
    step = s.schedule()
    assert set(step.num_scheduled_tokens) == {1, 2}  # 3 waits at the head: 4 is not let past it
    s.update(step, tokens_for(step))
    s.finish(1, FinishReason.CANCELLED)
    step = s.schedule()
    assert 3 in step.num_scheduled_tokens and sum(r.penalized for r in s.running) == 2


def test_prompt_scores_gather_by_chunk_and_come_with_the_first_token():
    from router_service.logprobs import Scored

    def scored(values):
        n = len(values)
        return Scored(
            np.array(values, np.float32),
            np.arange(n * 2, dtype=np.int32).reshape(n, 2),
            np.full((n, 2), -1.0, np.float32),
        )

    s = make(max_batch_tokens=3)
    s.add(req(1, n_prompt=5, scores_prompt=True))
    first = s.schedule()
    assert s.update(first, [RequestOutput(1, None, prompt=scored([np.nan, -1.0, -2.0]))]) == []
    second = s.schedule()
    out = s.update(second, [RequestOutput(1, 9, -0.5, prompt=scored([-3.0, -4.0]), top=scored([-0.5]))])
    assert out[0].token_id == 9 and out[0].top.logprobs.tolist() == [-0.5]
    assert np.isnan(out[0].prompt.logprobs[0]) and out[0].prompt.logprobs[1:].tolist() == [-1, -2, -3, -4]
    step = s.schedule()
    assert s.update(step, tokens_for(step))[0].prompt is None


@pytest.mark.parametrize("seed", range(6))
def test_each_chunk_starts_where_the_requests_tokens_sent_before_it_end(seed):
    """Pipelined (two steps out), with prefix caching, random prompts, budgets and refused steps: every chunk's
    start is the request's tokens sent before it, its cached prefix included, so the worker can tell a chunk
    behind a lost one."""
    from router_service.prefix_cache import PrefixCache

    rng = np.random.default_rng(seed)
    s = Scheduler(SchedulerLimits(6, int(rng.integers(3, 20)), 4, 256), PrefixCache(4, b"model"))
    system = [int(t) for t in rng.integers(1, 100, 9)]
    sent: dict[int, int] = {}
    in_flight = []
    for rid in range(1, 40):
        if rng.random() < 0.6:
            s.add(ScheduledRequest(rid, system + [int(t) for t in rng.integers(1, 100, rng.integers(1, 12))], 3))
        step = s.schedule()
        for chunk in step.prefill_chunks:
            if chunk.is_first:
                assert chunk.start == len(chunk.prefix_block_ids) * 4
            else:
                assert chunk.start == sent[chunk.request_id]
            sent[chunk.request_id] = chunk.start + len(chunk.token_ids)
        in_flight.append(step)
        if len(in_flight) == 2:
            done = in_flight.pop(0)
            if not done.is_empty and rng.random() < 0.15:
                s.refused(done)
                for request_id in done.num_scheduled_tokens:
                    s.finish(request_id, FinishReason.ERROR)
            else:
                s.update(done, tokens_for(done))
    assert s.prefix_cache.num_hit_tokens > 0 and any(start for start in sent.values())


@pytest.mark.parametrize("late_masks", [False, True])
def test_a_constrained_request_decodes_with_one_token_pending_only_when_its_masks_may_come_late(late_masks):
    """Pipelined as the batching loop runs it at depth 2: a step is scheduled while the one before is in flight.
    Without late masks a constrained request decodes every other step; with them every step, with one pending
    token (-1, its input still being sampled), never two."""
    rng = np.random.default_rng(int(late_masks))
    s = make()
    s.add(req(1, n_prompt=int(rng.integers(2, 9)), max_new=12, constrained=True, late_masks=late_masks))
    s.add(req(2, n_prompt=int(rng.integers(2, 9)), max_new=12))
    in_flight = [s.schedule()]
    decoded = []
    while s.requests:
        step = s.schedule()
        if 1 in s.requests:
            assert s.requests[1].num_pending_outputs <= 1 + late_masks
        decoded.append(1 in step.decode_ids)
        if 1 in step.decode_ids:
            pending = step.decode_token_ids[step.decode_ids.index(1)] == -1
            assert pending == late_masks or not in_flight[-1].num_scheduled_tokens.get(1)
        in_flight.append(step)
        done = in_flight.pop(0)
        s.update(done, tokens_for(done, int(rng.integers(10, 20))))
    runs = decoded[: decoded.index(False)] if False in decoded else decoded
    assert (len(runs) > 3) == late_masks  # every step in a row, or alternating
