"""A request whose late-mask row the worker failed (its sequence released: NON_FINITE_LOGITS, MISSING_TOKEN_MASK)
fails alone: the router delivers that error before it sends the next message, so the message frees the request
and asks no mask for it (a late mask for a released sequence makes the worker refuse the whole message, and every
request in it would fail). Router side against a hand-operated worker, and end to end through the cpu worker with
one router stall past the worker's late-mask timeout."""

import asyncio

import pytest

from common.pb import router_pb2 as rpb
from expert_service.serving import step_stream
from expert_service.tools.tiny_model import EOS_ID as EOS
from tests.helpers import BackgroundWorker, running_router
from tests.router_service.manual_worker import b, decode_ids, free_ids, late_ids, start_loop, submit


def test_no_late_mask_for_a_request_the_worker_failed(tokenizer):
    async def main():
        loop, w = await start_loop(tokenizer, pipeline_depth=2)
        submit(loop, [b("x")], max_new_tokens=10, temperature=0, constraint=rpb.Constraint(regex="[a-z]{8}"))
        submit(loop, [b("y")], max_new_tokens=10, temperature=0, ignore_eos=True)  # an unconstrained neighbour
        first = await w.next_sent(0)  # both prompts
        second = await w.next_sent(1)  # both decode, request 1 with its input pending (its mask comes late)
        assert decode_ids(second) == [1, 2]
        w.answer(first, {1: b("a"), 2: b("z")})
        third = await w.next_sent(2)  # carries step 2's late mask for request 1
        assert late_ids(third) == [1]
        # the worker: request 1's logits were not finite in step 2; it is released there
        w.answer(second, {2: b("z")}, errors={1: "NON_FINITE_LOGITS"})
        fourth = await w.next_sent(3)
        await asyncio.sleep(0.01)
        await loop.stop()
        return fourth

    fourth = asyncio.run(main())
    assert 1 in free_ids(fourth)
    assert 1 not in late_ids(fourth), "a late mask for a request the worker failed (and this message frees)"


@pytest.fixture
def worker(tiny_model):
    w = BackgroundWorker(tiny_model).start()
    yield w
    w.stop()


def test_a_missed_late_mask_fails_only_its_own_request(worker, tiny_model, monkeypatch):
    monkeypatch.setattr(step_stream, "LATE_MASKS_TIMEOUT_S", 0.2)

    async def main():
        async with running_router(worker.address, model=str(tiny_model), pipeline_depth=2) as (router, stub):
            loop = router.batching_loop
            send, sends_with_late = loop._send, [0]

            async def stalling_send(step, late=None):
                if late:
                    sends_with_late[0] += 1
                    if sends_with_late[0] == 4:  # the router stalls once (GC, a busy event loop) past the timeout
                        await asyncio.sleep(0.6)
                await send(step, late)

            loop._send = stalling_send
            constrained = rpb.SamplingParameters(max_new_tokens=30, temperature=0)
            constrained.constraint.regex = "[a-z]{30}"
            plain = rpb.SamplingParameters(max_new_tokens=30, temperature=0, ignore_eos=True)
            a = stub.Generate(rpb.GenerateRequest(text="The", parameters=constrained))
            c = stub.Generate(rpb.GenerateRequest(text="And", parameters=plain))
            results = await asyncio.gather(a, c, return_exceptions=True)
            return results, sends_with_late[0]

    (a, c), n = asyncio.run(main())
    assert n >= 4, n
    # the constrained request may fail (its mask came too late); its unconstrained neighbour must not
    assert not isinstance(c, Exception), f"the unconstrained neighbour failed: {c.code()} {c.details()}"
    assert len(c.token_ids) == 30


def test_held_back_outputs_do_not_wait_through_an_arrival_wait(tokenizer):
    """The last constrained request ends (EOS) in the answered step while the step in flight waited for its late
    mask: its neighbour's output was held back for the next send, and with no constrained request left the loop
    fills the pipeline to depth 3, waiting for arrivals before the third step. The neighbour's output is delivered
    before that wait, not after it."""

    async def main():
        loop, w = await start_loop(tokenizer, pipeline_depth=3)
        held_at_wait = []
        wait = loop._pipeline.await_arrivals

        async def recording_wait():
            held_at_wait.append(len(loop._results._deferred))
            await wait()

        loop._pipeline.await_arrivals = recording_wait
        submit(loop, [b("x")], max_new_tokens=10, temperature=0, constraint=rpb.Constraint(regex="ab?"))
        submit(loop, [b("y")], max_new_tokens=10, temperature=0, ignore_eos=True)
        first = await w.next_sent(0)
        second = await w.next_sent(1)
        w.answer(first, {1: b("a"), 2: b("z")})
        third = await w.next_sent(2)  # step 2's late mask for request 1 (b or EOS), both decode again
        assert late_ids(third) == [1] and decode_ids(third) == [1, 2]
        w.answer(second, {1: EOS, 2: b("z")})  # request 1 ends; request 2's output is held for the next send
        fourth = await w.next_sent(3)
        fifth = await w.next_sent(4)  # depth 3 again: a third step behind, after an arrival wait
        await asyncio.sleep(0.01)
        await loop.stop()
        return fourth, fifth, held_at_wait

    fourth, fifth, held_at_wait = asyncio.run(main())
    assert 1 in free_ids(fourth) and not late_ids(fourth)
    assert decode_ids(fifth) == [2]
    assert held_at_wait and not any(held_at_wait), held_at_wait
