"""The worker's step stream ending before the router's next write is a lost worker: the requests in flight
end UNAVAILABLE (retry elsewhere), never INTERNAL."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from router_service.worker_client import StepStream
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
