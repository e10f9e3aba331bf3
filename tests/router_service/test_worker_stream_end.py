"""The worker's step stream ending before the router's next write, or during it, is a lost worker: the requests
in flight end UNAVAILABLE (retry elsewhere), never INTERNAL."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.pb import worker_pb2
from router_service.worker_client import BROKEN_CALL, StepStream
from tests.router_service.fake_worker import FakeWorker, harness, ids_request


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
