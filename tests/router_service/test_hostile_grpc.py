"""Hostile gRPC clients: deadlines shorter than a step, more streams than max_concurrent_requests, streams
cancelled before their first token, between tokens and during a long prefill. Every refusal is its documented
status, its message names what actually ran out, and nothing stays held afterwards."""

import asyncio
import logging

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from common.pb import router_pb2
from tests.helpers import drained, grpc_poller_of_a_closed_loop, running_router


def _stream(max_new_tokens=40, prompt=(1, 2, 3)):
    return router_pb2.GenerateStreamRequest(
        token_ids=router_pb2.TokenIds(ids=list(prompt)),
        parameters=router_pb2.SamplingParameters(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def _drain_call(call) -> grpc.aio.AioRpcError | None:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e
    return None


def test_a_client_deadline_shorter_than_a_step_is_not_blamed_on_queue_timeout(worker, tiny_model):
    async def body():
        async with running_router(worker.address, model=str(tiny_model)) as (router, stub):
            for timeout in (0.0001, 0.0005, 0.001, 0.0001, 0.0001):
                error = await _drain_call(stub.GenerateStream(_stream(100), timeout=timeout))
                assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
                # the client's own deadline ran out, not the router's 60 s queue timeout
                assert "queue_timeout_s" not in error.details(), error.details()
            await drained(router)

    asyncio.run(body())


def test_streams_past_the_limit_or_cancelled_anywhere_leave_nothing_held(worker, tiny_model, caplog):
    caplog.set_level(logging.WARNING, logger="colibri")

    async def body():
        async with running_router(worker.address, model=str(tiny_model), max_concurrent_requests=3) as (router, stub):
            calls = [stub.GenerateStream(_stream(200)) for _ in range(8)]
            errors = [await _drain_call(c) for c in calls]
            refused = [e for e in errors if e is not None]
            assert len(refused) == 5 and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
            status = rpc_status.from_call(refused[0])
            retry = error_details_pb2.RetryInfo()
            assert any(d.Unpack(retry) for d in status.details) and retry.retry_delay.ToTimedelta().total_seconds() > 0
            for tokens_read in (0, 1, 4):  # before the first token and between tokens
                call = stub.GenerateStream(_stream())
                for _ in range(tokens_read):
                    await call.read()
                call.cancel()
            for delay in (0.0, 0.005, 0.02):  # while queued or during a long prefill
                call = stub.GenerateStream(_stream(5, prompt=[5] * 1500))
                await asyncio.sleep(delay)
                call.cancel()
            await drained(router)

    asyncio.run(body())
    assert not [r for r in caplog.records if r.exc_info and not grpc_poller_of_a_closed_loop(r)], (
        "a client's cancel logged a traceback"
    )
