"""The pipelined step stream: step t+1 is on the worker before step t's result is back. A stop found one step
late costs at most one discarded token and nothing after a stop reaches the client; a cancel frees the
worker's KV within two steps; greedy output is identical with the pipeline on and off."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import VOCAB_SIZE
from tests.helpers import running_router
from tests.router_service.fake_worker import EOS, FakeWorker, burst_behind, harness, ids_request, wait_for


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_no_token_after_a_stop_is_delivered(depth):
    async def main():
        fake = FakeWorker(step_delay=0.002)
        async with harness(fake, pipeline_depth=depth) as (router, _, stub, _):
            # the fake worker counts up from the last token and emits EOS past the vocabulary's last id
            last = VOCAB_SIZE - 1
            eos = await stub.Generate(ids_request([last - 5], max_new_tokens=50))
            assert list(eos.token_ids) == [last - 4, last - 3, last - 2, last - 1, last, EOS]
            assert eos.stop_reason == rpb.STOP_REASON_EOS
            stop_id = await stub.Generate(ids_request([40], max_new_tokens=50, stop_token_ids=[44]))
            assert list(stop_id.token_ids) == [41, 42, 43, 44]
            length = await stub.Generate(ids_request([50], max_new_tokens=3))
            assert list(length.token_ids) == [51, 52, 53]
            streamed = [
                t async for m in stub.GenerateStream(ids_request([last - 3], max_new_tokens=50)) for t in m.token_ids
            ]
            assert streamed == [last - 2, last - 1, last, EOS]
            await wait_for(lambda: not fake.seqs)  # the discarded step has run and its sequence is freed
        return fake

    fake = asyncio.run(main())
    # With the pipeline on, the worker sampled depth - 1 tokens past each EOS/stop-id stop (discarded); never
    # more, and never past a length stop (the router knows it in advance).
    decodes_after_stop = fake.extra_samples
    assert decodes_after_stop == 3 * (depth - 1), decodes_after_stop


@pytest.mark.parametrize("depth", [2, 3])
def test_pipeline_keeps_the_next_steps_on_the_worker(depth):
    async def main():
        fake = FakeWorker(step_delay=0.005)
        async with harness(fake, pipeline_depth=depth) as (_, _, stub, _):
            await stub.Generate(ids_request([1], max_new_tokens=20))
        return fake

    fake = asyncio.run(main())
    assert fake.max_queued == depth, f"the router had {fake.max_queued} steps on the worker at once, not {depth}"


def test_cancel_between_pipelined_steps_frees_kv_within_two_steps():
    async def main():
        fake = FakeWorker(step_delay=0.01)
        async with harness(fake, pipeline_depth=2) as (router, _, stub, _):
            call = stub.GenerateStream(ids_request([1], max_new_tokens=200))
            async for _ in call:
                break
            call.cancel()
            await wait_for(lambda: router.batching_loop.num_active == 0)  # the router saw the cancel
            steps_at_cancel = fake.calls.count("StepStream")
            await wait_for(lambda: not fake.seqs)
            assert fake.calls.count("StepStream") - steps_at_cancel <= 2
            assert router.batching_loop.scheduler.num_used_blocks == 0

    asyncio.run(main())


def test_greedy_equal_with_pipeline_on_and_off(tiny_model):
    from tests.helpers import BackgroundWorker

    worker = BackgroundWorker(tiny_model).start()

    async def generate(depth):
        async with running_router(worker.address, pipeline_depth=depth) as (_, stub):
            requests = [
                rpb.GenerateRequest(
                    token_ids=rpb.TokenIds(ids=[3 + i, 40 + i, 7]),
                    parameters=rpb.SamplingParameters(max_new_tokens=12 + i),
                )
                for i in range(6)
            ]
            replies = await asyncio.gather(*(stub.Generate(r) for r in requests))
            return [list(r.token_ids) for r in replies]

    try:
        off, on = asyncio.run(generate(1)), asyncio.run(generate(2))
    finally:
        worker.stop()
    assert off == on and all(off)


def test_a_draining_worker_refusal_is_unavailable_to_the_client():
    """A worker that is shutting down refuses new sequences; the client gets UNAVAILABLE (retry elsewhere), not
    INTERNAL, and requests already running are unaffected."""

    async def main():
        fake = FakeWorker(step_delay=0.002)
        async with harness(fake) as (router, _, stub, _):
            running = stub.GenerateStream(ids_request([40], max_new_tokens=30))
            await running.read()
            fake.draining = True
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([50], max_new_tokens=3))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = []
            while (m := await running.read()) != grpc.aio.EOF:
                rest += m.token_ids
            assert len(rest) == 29

    asyncio.run(main())


@pytest.mark.parametrize("coalesce", [True, False])
def test_a_burst_of_arrivals_joins_one_pipelined_step(monkeypatch, coalesce):
    """Requests arriving while a step runs on the worker wait for the burst to pause, then all join the next step
    (without the wait, the next step is scheduled at once and the burst spills into the one after)."""
    from router_service import step_pipeline

    # a quiet period far longer than the 10 ms gaps: a loaded CI machine delayed one arrival past 50 ms and split
    # the burst; the window still ends the wait well inside the first step's second
    monkeypatch.setattr(step_pipeline, "ARRIVAL_QUIET_S", 0.3 if coalesce else 0.0)
    monkeypatch.setattr(step_pipeline, "ARRIVAL_WINDOW_S", 0.8)

    async def main():
        fake = FakeWorker(step_delay=1.0)  # the first step runs long enough for the whole burst to arrive
        async with harness(fake, pipeline_depth=2) as (router, _, stub, _):
            # 10 ms apart: far inside the quiet period and the first step
            return await burst_behind(stub, router.batching_loop, [7, 8, 9], gap_s=0.01)

    new_per_step = asyncio.run(main())
    # step 2 (the first one's decode) is scheduled while step 1 runs: with the burst, or before it
    assert new_per_step[:2] == ([1, 5] if coalesce else [1, 0])


def test_a_step_failed_during_the_arrival_wait_fails_its_batch_not_the_next_send(monkeypatch, caplog):
    """The worker fails the step in flight (INTERNAL) while the loop waits for a burst to pause: that answer is
    applied before anything else is sent, so the step's requests get the worker's failure (INTERNAL, not a
    retryable UNAVAILABLE from the send that would otherwise follow) and the failed receive is not left unread."""
    import gc
    import logging

    from router_service import step_pipeline

    monkeypatch.setattr(step_pipeline, "ARRIVAL_QUIET_S", 0.5)  # far longer than the step: the answer ends the wait
    monkeypatch.setattr(step_pipeline, "ARRIVAL_WINDOW_S", 2.0)

    async def main():
        fake = FakeWorker(step_delay=0.05)
        async with harness(fake, pipeline_depth=2) as (router, _, stub, _):
            fake.fail_next = grpc.StatusCode.INTERNAL  # the first step aborts the stream
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([5], max_new_tokens=20))
            gc.collect()  # an unread failed future would be reported now
            await asyncio.sleep(0)
            return err.value.code()

    with caplog.at_level(logging.ERROR):
        code = asyncio.run(main())
    assert code == grpc.StatusCode.INTERNAL
    unread = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not unread, unread[0].getMessage()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_refused_step_fails_only_its_request_not_the_step_sent_behind_it(tiny_model, monkeypatch, seed):
    """Through both services on the cpu backend, two steps in flight, 16-token steps: the first step carries the
    first chunk of request B alone, and the wire makes a token of it leave the vocabulary, so the worker refuses
    that step. The step sent behind it, before its answer, carries B's last chunk with three other prompts: B's
    chunk fails alone there, and the others finish with the greedy tokens they get alone."""
    from router_service import wire
    from tests.helpers import BackgroundWorker
    from tests.router_service.test_e2e_worker import offline_greedy

    rng = np.random.default_rng(seed)
    bad = [int(t) for t in rng.integers(3, 250, 20)]  # 16 tokens in step 1, the last 4 in step 2
    goods = [[int(t) for t in rng.integers(3, 250, 4)] for _ in range(3)]  # 12 tokens: they fill step 2
    lengths = [int(n) for n in rng.integers(3, 9, 3)]
    chunk_message, sent, refusals = wire.prefill_chunk, [], []

    def corrupting(chunk):
        message = chunk_message(chunk)
        sent.append((chunk.request_id, chunk.start, len(chunk.token_ids)))
        if chunk.is_first and list(chunk.token_ids) == bad[:16]:
            message.token_ids[0] = VOCAB_SIZE
        return message

    monkeypatch.setattr(wire, "prefill_chunk", corrupting)
    worker = BackgroundWorker(tiny_model).start()

    async def main():
        async with running_router(worker.address, pipeline_depth=2, max_batch_tokens=16) as (router, stub):
            loop, gate = router.batching_loop, asyncio.Event()
            fill, apply = loop._fill_pipeline, loop._results.apply

            async def gated_fill():  # nothing is scheduled until every request waits, B first
                await gate.wait()
                await fill()

            def recording_apply(sent, response, late_masks_due):
                refusals.append(response.step_error)
                apply(sent, response, late_masks_due)

            loop._fill_pipeline, loop._results.apply = gated_fill, recording_apply
            b = asyncio.ensure_future(stub.Generate(ids_request(bad, max_new_tokens=4, ignore_eos=True)))
            await wait_for(lambda: loop.scheduler.num_waiting == 1)
            calls = [stub.Generate(ids_request(p, max_new_tokens=n, ignore_eos=True)) for p, n in zip(goods, lengths)]
            together = [asyncio.ensure_future(call) for call in calls]
            await wait_for(lambda: loop.scheduler.num_waiting == 4)
            gate.set()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await b
            assert err.value.code() == grpc.StatusCode.INTERNAL  # the details stay in the router's log
            return [list(r.token_ids) for r in await asyncio.gather(*together)]

    try:
        got = asyncio.run(main())
    finally:
        worker.stop()
    assert got == [offline_greedy(tiny_model, p, n) for p, n in zip(goods, lengths)]
    b_id = sent[0][0]
    assert sent[:4] == [(b_id, 0, 16), (b_id, 16, 4), (b_id + 1, 0, 4), (b_id + 2, 0, 4)], sent
    assert refusals[0] and not any(refusals[1:]), refusals  # only B's step was refused
