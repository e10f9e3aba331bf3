"""Scheduler: token budget, chunked prefill, admission by KV blocks, join/leave between steps."""
import pytest

from router_service.scheduler import (FinishReason, Scheduler, SchedulerLimits, Sequence, Status, StepOutput)


def make(max_batch_size=8, max_batch_tokens=16, block=4, blocks=64):
    return Scheduler(SchedulerLimits(max_batch_size, max_batch_tokens, block, blocks))


def seq(rid, n_prompt=4, max_new=4, **kw):
    return Sequence(rid, list(range(1, n_prompt + 1)), max_new, **kw)


def tokens_for(plan, token=7):
    """What a worker would answer: a token for every last chunk and every decode."""
    out = [StepOutput(c.request_id, token if c.is_last else None) for c in plan.prefill_chunks]
    return out + [StepOutput(i, token) for i in plan.decode_ids]


def test_single_request_prefill_then_decode_until_length():
    s = make()
    s.add(seq(1, n_prompt=5, max_new=3))
    plan = s.schedule()
    assert plan.kind == "prefill" and plan.num_scheduled_tokens == {1: 5}
    assert plan.prefill_chunks[0].is_first and plan.prefill_chunks[0].is_last
    outs = s.update(plan, tokens_for(plan))
    assert outs == [StepOutput(1, 7, None, None)]
    plan = s.schedule()
    assert plan.kind == "decode" and plan.decode_ids == (1,)
    s.update(plan, tokens_for(plan))
    plan = s.schedule()
    outs = s.update(plan, tokens_for(plan))
    assert outs[0].finish_reason is FinishReason.LENGTH
    assert s.num_used_blocks == 0 and 1 not in s.sequences
    plan = s.schedule()  # the worker is told to free it, nothing runs
    assert plan.is_empty and plan.free_ids == {1} and plan.keep_ids == ()


def test_token_budget_chunks_long_prompt():
    s = make(max_batch_tokens=6)
    s.add(seq(1, n_prompt=14, max_new=2))
    chunks = []
    while True:
        plan = s.schedule()
        assert plan.num_tokens <= 6
        chunks += plan.prefill_chunks
        s.update(plan, tokens_for(plan))
        if chunks[-1].is_last:
            break
    assert [len(c.token_ids) for c in chunks] == [6, 6, 2]
    assert [c.is_first for c in chunks] == [True, False, False]
    assert sum((c.token_ids for c in chunks), ()) == tuple(range(1, 15))
    assert s.sequences[1].num_computed_tokens == 14 and s.sequences[1].output_ids == [7]


def test_decodes_first_then_prefill_fills_remaining_budget():
    s = make(max_batch_tokens=8)
    s.add(seq(1, n_prompt=3, max_new=10))
    s.add(seq(2, n_prompt=3, max_new=10))
    plan = s.schedule()
    s.update(plan, tokens_for(plan))
    s.add(seq(3, n_prompt=20, max_new=2))  # joins between steps
    plan = s.schedule()
    assert plan.kind == "prefill" and plan.decode_ids == (1, 2)
    assert plan.num_scheduled_tokens == {1: 1, 2: 1, 3: 6}
    assert plan.prefill_chunks[0].is_first and not plan.prefill_chunks[0].is_last


def test_max_batch_size():
    s = make(max_batch_size=2, max_batch_tokens=100)
    for rid in (1, 2, 3):
        s.add(seq(rid))
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {1, 2} and s.num_waiting == 1
    s.update(plan, tokens_for(plan))
    s.finish(1, FinishReason.CANCELLED)
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {2, 3}


def test_admission_by_free_blocks_and_head_of_line():
    s = make(max_batch_tokens=100, block=4, blocks=4)  # 16 tokens of KV
    s.add(seq(1, n_prompt=6, max_new=6))  # 12 tokens -> 3 blocks
    s.add(seq(2, n_prompt=4, max_new=4))  # 2 blocks: does not fit beside 1
    s.add(seq(3, n_prompt=1, max_new=1))  # would fit, but FIFO: not before 2
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {1} and s.num_free_blocks == 1
    s.update(plan, tokens_for(plan))
    s.finish(1, FinishReason.STOP_SEQUENCE)
    assert s.num_free_blocks == 4  # freed at once
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {2, 3} and plan.free_ids == {1}
    with pytest.raises(ValueError):
        s.add(seq(9, n_prompt=10, max_new=10))  # needs 5 blocks of 4


def test_cancel_while_queued_is_never_prefilled():
    s = make(max_batch_size=1)
    s.add(seq(1))
    s.add(seq(2))
    plan = s.schedule()
    s.finish(2, FinishReason.CANCELLED)
    s.update(plan, tokens_for(plan))
    for _ in range(5):
        plan = s.schedule()
        assert 2 not in plan.num_scheduled_tokens and 2 not in plan.free_ids
        s.update(plan, tokens_for(plan))


def test_cancel_during_step_output_is_dropped_and_freed():
    s = make()
    s.add(seq(1))
    s.add(seq(2))
    plan = s.schedule()
    s.finish(1, FinishReason.CANCELLED)  # the client left while the step ran
    outs = s.update(plan, tokens_for(plan))
    assert [o.request_id for o in outs] == [2]
    plan = s.schedule()
    assert plan.free_ids == {1} and plan.keep_ids == (2,) and plan.decode_ids == (2,)


def test_stop_tokens_eos_and_errors():
    s = make()
    s.add(seq(1, eos_token_ids=frozenset({7})))
    s.add(seq(2, stop_token_ids=frozenset({7})))
    s.add(seq(3))
    plan = s.schedule()
    outs = s.update(plan, [StepOutput(1, 7), StepOutput(2, 7), StepOutput(3, None, error="NON_FINITE_LOGITS")])
    assert [o.finish_reason for o in outs] == [FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.ERROR]
    assert outs[2].error == "NON_FINITE_LOGITS" and not s.sequences and s.num_used_blocks == 0


def test_queue_deadline_expires_waiting_only():
    s = make(max_batch_size=1)
    s.add(seq(1, queue_deadline=10.0))
    s.add(seq(2, queue_deadline=10.0))
    s.schedule(now=0.0)
    plan = s.schedule(now=11.0)
    assert plan.expired_ids == (2,) and 1 in s.sequences
    assert s.sequences[1].status is Status.RUNNING


def test_allocations_equal_frees_after_cancel_storm():
    import random
    rng = random.Random(0)
    s = make(max_batch_size=4, max_batch_tokens=10, block=2, blocks=40)
    next_id, live = 1, set()
    for step in range(300):
        if rng.random() < 0.5:
            s.add(seq(next_id, n_prompt=rng.randint(1, 12), max_new=rng.randint(1, 6)))
            live.add(next_id)
            next_id += 1
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            s.finish(victim, FinishReason.CANCELLED)
        plan = s.schedule()
        assert plan.num_tokens <= 10 and len(plan.num_scheduled_tokens) <= 4
        for o in s.update(plan, tokens_for(plan, token=rng.randint(0, 9))):
            pass
        live = set(s.sequences)
        assert s.num_used_blocks == sum(x.num_blocks for x in s.sequences.values())
    for rid in list(s.sequences):
        s.finish(rid, FinishReason.CANCELLED)
    assert s.num_free_blocks == 40
