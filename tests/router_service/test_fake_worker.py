"""The fake worker itself: a step stream it aborts leaves nothing behind (no pending reader task, no
unretrieved error) for the event loop to report, or for a later test to trip over."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest

from tests.router_service.fake_worker import FakeWorker, harness, ids_request


def test_an_aborted_step_stream_leaves_no_task_behind():
    reported = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        async with harness(FakeWorker(step_delay=0.01)) as (_, fake, stub, _):
            call = stub.GenerateStream(ids_request([1], max_new_tokens=100))
            await call.read()
            fake.fail_next = grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError):
                while await call.read() != grpc.aio.EOF:
                    pass
        await asyncio.sleep(0)
        gc.collect()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    gc.collect()  # a task still pending at close is reported when it is collected
    assert not reported, [c.get("message") for c in reported]
