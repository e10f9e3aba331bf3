"""The worker's step stream ending before the router's next write, or during it, is a lost worker: the requests
in flight end UNAVAILABLE (retry elsewhere), never INTERNAL."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb import worker_pb2
from router_service.worker_client import BROKEN_CALL, StepStream
from tests.router_service.fake_worker import FakeWorker, harness, ids_request, wait_for
from tests.router_service.test_servicer import details


class EndsAfterOneStep(FakeWorker):
    """Answers the first step of a stream, then ends the stream with OK (a worker going away cleanly)."""

    async def StepStream(self, request_iterator, context):
        async with contextlib.aclosing(super().StepStream(request_iterator, context)) as responses:
            async for response in responses:
                yield response
                return


def test_a_write_after_the_worker_ended_the_stream_is_unavailable(monkeypatch):
    receive = StepStream.receive

    async def receive_once_the_call_is_over(self):
        # Widens the window deterministically: the result is handed over only once the stream's end has
        # arrived too, so the router's next write always finds the call finished.
        response = await receive(self)
        await self._call.code()
        return response

    monkeypatch.setattr(StepStream, "receive", receive_once_the_call_is_over)

    async def main():
        async with harness(EndsAfterOneStep(), pipeline_depth=1) as (_, _, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([1], max_new_tokens=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()

    asyncio.run(main())


class BrokenCall:
    """A step call that ended with `details` as INTERNAL: its writes and reads raise that status."""

    def __init__(self, details: str):
        self.error = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    async def write(self, request):
        raise self.error

    async def read(self):
        raise self.error

    def done(self) -> bool:
        return True

    async def code(self):
        return self.error.code()

    async def details(self):
        return self.error.details()


async def _errors_of(stream: StepStream) -> list[tuple[grpc.StatusCode, str]]:
    """The errors the router acts on from a send, a receive and the stream's end."""
    found = []
    for attempt in (stream.send(worker_pb2.StepStreamRequest(step_id=1)), stream.receive()):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await attempt
        found.append((err.value.code(), err.value.details()))
    ended = await stream.end_error()
    assert ended is not None
    return [*found, (ended.code(), ended.details())]


def test_a_call_grpc_broke_under_a_write_is_a_lost_worker_not_a_failed_step():
    """gRPC's client reads "Internal error from Core" when the worker ends a stream the router is writing to (a worker
    stopping): taken as the worker's INTERNAL, it failed the batch in flight INTERNAL (HTTP 500) instead of
    UNAVAILABLE. The worker's own INTERNAL (a fault in a step) still fails that step."""

    async def main():
        broken = await _errors_of(StepStream(BrokenCall(BROKEN_CALL), 1.0))
        assert {code for code, _ in broken} == {grpc.StatusCode.UNAVAILABLE}, broken
        fault = await _errors_of(StepStream(BrokenCall("worker fault; the worker is restarting"), 1.0))
        assert {code for code, _ in fault} == {grpc.StatusCode.INTERNAL}, fault

    asyncio.run(main())


async def _readiness(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="colibri.readiness"))
    return reply.status


@pytest.mark.parametrize("told_by", ["health", "refused sequence"])
def test_a_draining_worker_turns_the_router_not_ready_at_once_while_its_streams_finish(told_by):
    """A worker draining (its SIGTERM) keeps its stream open until the router's sequences are done; the router stayed
    SERVING meanwhile, admitted every new request and sent it to be refused (DRAINING). It learns from the worker's
    Health (asked every second while requests run) or from the first sequence refused as DRAINING."""

    async def main():
        async with harness(FakeWorker(step_delay=0.01)) as (router, fake, stub, channel):
            held = stub.GenerateStream(ids_request([1], max_new_tokens=400))
            await held.read()
            fake.draining = True
            fake.ready = told_by != "health"
            if told_by == "refused sequence":
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(ids_request([2], max_new_tokens=2))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert router.batching_loop.is_worker_draining  # told by the refusal, before any Health
                # a draining worker's Health says so soon after: a later poll (every second) must agree, or on a
                # slow machine it turned the router back before the requests below were sent
                fake.ready = False
            await wait_for(lambda: router.batching_loop.is_worker_draining, timeout=3.0)
            assert await _readiness(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            seen = set(fake.seen_ids)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([3], max_new_tokens=2))
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.UNAVAILABLE,
                "the worker is shutting down; retry shortly",
            )
            assert fake.seen_ids == seen  # refused by the router: never sent
            while await held.read() is not grpc.aio.EOF:  # the request in flight steps on to its end
                pass
            assert await held.code() == grpc.StatusCode.OK
            fake.draining, fake.ready = False, True  # ready again (a wedged model thread that recovered)
            await wait_for(lambda: not router.batching_loop.is_worker_draining, timeout=5.0)
            assert await _readiness(channel) == health_pb2.HealthCheckResponse.SERVING
            assert (await stub.Generate(ids_request([4], max_new_tokens=2))).generated_tokens == 2

    asyncio.run(main())


def test_a_health_answer_asked_before_the_worker_drained_does_not_undo_its_refusal():
    """A probe asked while the worker was still ready can land after a sequence was refused DRAINING: that stale
    "ready" must not turn the router SERVING again and send it new requests to refuse. The refusal says when to
    retry as the router's retry_after_s does."""

    async def main():
        fake = FakeWorker(step_delay=0.01)
        fake.health_delay = 0.8
        async with harness(fake, retry_after_s=3.0) as (router, fake, stub, channel):
            held = stub.GenerateStream(ids_request([1], max_new_tokens=600))
            await held.read()
            await wait_for(lambda: fake.health_in_flight > 0, timeout=5.0)  # a probe asked while ready
            fake.draining, fake.ready = True, False
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(ids_request([2], max_new_tokens=2))
            assert details(refused.value)["RetryInfo"].retry_delay.seconds == 3  # the router's retry_after_s
            await wait_for(lambda: router.batching_loop.is_worker_draining, timeout=3.0)
            deadline = asyncio.get_running_loop().time() + 1.5  # past the stale probe's answer, and a fresh one
            while asyncio.get_running_loop().time() < deadline:
                assert router.batching_loop.is_worker_draining, "a stale health answer turned the router SERVING"
                await asyncio.sleep(0.02)
            held.cancel()

    asyncio.run(main())
