"""A DEADLINE_EXCEEDED says where the request was and whose limit passed: a request that never left the queue ends
with ErrorInfo reason QUEUE_TIMEOUT, whichever deadline ended it first (the client's, or the router's
request_timeout_s), and one the router's request_timeout_s ended names that setting (docs/api.md, status codes)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from router_service.request_state import RequestState, deadline_error
from tests.router_service.fake_worker import FakeWorker, harness, ids_request, wait_for


def _reason(error: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(error)
    info = error_details_pb2.ErrorInfo()
    assert status is not None and status.details[0].Unpack(info)
    return info.reason


async def _deadline_error(stub, timeout=None, **params) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(ids_request([2], **params), timeout=timeout)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return err.value


def _queued_behind_a_holder(**overrides):
    # 64 blocks of 4 tokens: the holder reserves 51, so a second request of 200 tokens waits in the queue
    return harness(FakeWorker(num_blocks=64, step_delay=0.01), **overrides)


def test_a_client_deadline_that_passes_in_the_queue_is_a_queue_timeout():
    async def main():
        async with _queued_behind_a_holder() as (router, _, stub, _):
            holder = stub.GenerateStream(ids_request([1], max_new_tokens=200))
            await holder.read()
            error = await _deadline_error(stub, timeout=0.4, max_new_tokens=200)
            assert _reason(error) == "QUEUE_TIMEOUT"
            assert error.details() == "the request's deadline passed while it waited in the queue"
            holder.cancel()
            await wait_for(lambda: router.batching_loop.num_active == 0)

    asyncio.run(main())


def test_request_timeout_s_that_passes_during_generation_is_named():
    async def main():
        async with harness(FakeWorker(step_delay=0.01), request_timeout_s=0.3) as (router, _, stub, _):
            error = await _deadline_error(stub, max_new_tokens=200)
            assert _reason(error) == "DEADLINE_EXCEEDED"
            assert error.details() == "the request ran longer than request_timeout_s=0.3"
            await wait_for(lambda: router.batching_loop.num_active == 0)

    asyncio.run(main())


def test_request_timeout_s_that_passes_in_the_queue_is_a_queue_timeout():
    # In a router the request ahead of it, with the same request_timeout_s, always leaves first: the rule alone.
    state = RequestState(1, "r", req=None, deadline=10.3, arrived_at=10.0)
    error = deadline_error(state, request_timeout_s=0.3)
    assert error.reason == "QUEUE_TIMEOUT" and str(error) == "waited in the queue longer than request_timeout_s=0.3"
    state.deadline = 10.2  # the client's, earlier
    assert str(deadline_error(state, 0.3)) == "the request's deadline passed while it waited in the queue"


def test_a_client_deadline_that_passes_during_generation_says_so():
    async def main():
        async with harness(FakeWorker(step_delay=0.01)) as (_, _, stub, _):
            error = await _deadline_error(stub, timeout=0.3, max_new_tokens=200)
            assert _reason(error) == "DEADLINE_EXCEEDED"
            assert error.details() == "the request's deadline passed during generation"

    asyncio.run(main())
