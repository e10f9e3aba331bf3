"""A client deadline or cancellation that lands as a token arrives is the call's end, not a fault.

gRPC fails a write or a status sent on a call it has just ended (ExecuteBatchError). The servicer is driven
with a context that fails so, which is the race made certain; and, against the real server, the fake worker
answers a step every TOKEN_INTERVAL_S while many Generate and GenerateStream calls end (their deadline passes,
or the client cancels) at instants spread across that interval. Nothing may be logged at ERROR, by gRPC or by
the router, and a deadline reaches the client as the router's own DEADLINE_EXCEEDED (with its ErrorInfo).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc._cython.cygrpc import ExecuteBatchError  # what grpc.aio raises for a send on an ended call
from grpc_status import rpc_status

from expert_service.tools.tiny_model import NUM_SPECIAL
from router_service import servicer as servicer_module
from router_service.servicer import DEADLINE_HEADROOM_S, GenerationServicer
from tests.helpers import LogRecords
from tests.router_service.fake_worker import FakeWorker, harness, ids_request

TOKEN_INTERVAL_S = 0.02
CALLS = 96
ROUNDS = 20


@contextlib.contextmanager
def _captured(names=("grpc", "colibri")):
    """Every record of gRPC's and the router's loggers, DEBUG included."""
    handler, loggers = LogRecords(logging.DEBUG), [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


async def _one_call(stub, index: int) -> grpc.StatusCode:
    """One call ending at 0.06 s .. 0.10 s (spread over two token intervals): by its deadline, or cancelled by
    the client at that instant (every third call)."""
    end = 0.06 + (index % 16) * (2 * TOKEN_INTERVAL_S / 16)
    cancels = index % 3 == 0
    request = ids_request([NUM_SPECIAL], max_new_tokens=200)
    timeout = None if cancels else end
    call = stub.GenerateStream(request, timeout=timeout) if index % 2 else stub.Generate(request, timeout=timeout)
    if cancels:
        asyncio.get_running_loop().call_later(end, call.cancel)
    try:
        if index % 2:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    except asyncio.CancelledError:
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK


def test_calls_ending_as_tokens_arrive_log_nothing_at_error():
    async def main():
        fake = FakeWorker(
            step_delay=TOKEN_INTERVAL_S, max_batch_size=CALLS, max_batch_tokens=4 * CALLS, num_blocks=4096
        )
        async with harness(fake, max_batch_size=CALLS) as (router, fake, stub, channel):
            codes = []
            for _ in range(ROUNDS):
                codes += await asyncio.gather(*(_one_call(stub, i) for i in range(CALLS)))
            return codes

    with _captured() as records:
        codes = asyncio.run(main())
    assert not records.errors(), "\n".join(records.errors()[:5])
    assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}, codes
    assert grpc.StatusCode.DEADLINE_EXCEEDED in codes and grpc.StatusCode.CANCELLED in codes


class _EndedCall:
    """A servicer context whose call gRPC has already ended: every write and status fails as grpc.aio's do."""

    def __init__(self, time_remaining: float | None = None):
        self._time_remaining = time_remaining
        self.attempts: list[str] = []

    def time_remaining(self):
        return self._time_remaining

    def invocation_metadata(self):
        return ()

    async def send_initial_metadata(self, metadata):
        self.attempts.append("send_initial_metadata")

    async def write(self, message):
        self.attempts.append("write")
        raise ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)')

    async def abort(self, code, details="", trailing_metadata=()):
        self.attempts.append(f"abort {code.name}")
        raise ExecuteBatchError('Failed "execute_batch": (SendStatusFromServerOperation,)')


@pytest.mark.parametrize(
    "method, time_remaining, attempts",
    [
        ("GenerateStream", None, ["send_initial_metadata", "write"]),  # the client left as a token was written
        ("Generate", 0.01, ["abort DEADLINE_EXCEEDED"]),  # the router's deadline, as gRPC's passed
        ("GenerateStream", 0.01, ["send_initial_metadata", "abort DEADLINE_EXCEEDED"]),
    ],
)
def test_a_send_on_an_ended_call_ends_the_handler_as_cancelled(method, time_remaining, attempts):
    async def main():
        async with harness(FakeWorker(step_delay=0.05)) as (router, fake, stub, channel):
            servicer = GenerationServicer(router.batching_loop)
            context = _EndedCall(time_remaining)
            with pytest.raises(asyncio.CancelledError):
                await getattr(servicer, method)(ids_request([NUM_SPECIAL], max_new_tokens=50), context)
            return context.attempts

    with _captured() as records:
        assert asyncio.run(main()) == attempts
    assert not records.errors(), records.errors()
    assert any(
        r.getMessage() == "the call ended before its answer was sent" and r.levelno == logging.DEBUG
        for r in records.records
    )


def test_the_routers_deadline_comes_before_grpcs():
    async def main():
        async with harness() as (router, fake, stub, channel):
            servicer = GenerationServicer(router.batching_loop)
            deadlines = []

            async def submit(request, deadline, stream):
                deadlines.append(deadline - time.monotonic())
                raise asyncio.CancelledError

            servicer.frontend.submit = submit
            for remaining in (10.0, 0.1):
                with pytest.raises(asyncio.CancelledError):
                    await servicer.Generate(ids_request([NUM_SPECIAL]), _EndedCall(remaining))
            return deadlines

    long, short = asyncio.run(main())
    assert 10.0 - 2 * DEADLINE_HEADROOM_S < long < 10.0 - DEADLINE_HEADROOM_S
    assert 0.1 * 0.5 < short < 0.1 * 0.8  # a short deadline keeps most of its time


async def _deadline_status(stub, index: int):
    timeout = 0.6 + (index % 8) * (TOKEN_INTERVAL_S / 8)
    call = stub.GenerateStream(ids_request([NUM_SPECIAL], max_new_tokens=200), timeout=timeout)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return rpc_status.from_call(e)
    raise AssertionError("the stream outlived its deadline")


@contextlib.contextmanager
def _heap_frozen():
    """The test process's heap out of the collector's view, as the router freezes its start-up heap
    (common/heap.py): in a test worker that has run hundreds of tests a full collection can stop the shared event
    loop for longer than the router's deadline headroom, and gRPC then ends the call first."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_the_client_gets_the_routers_deadline_exceeded(monkeypatch):
    # the mechanism, with room for a loaded CI worker: the router's timer fires 150 ms ahead of the client's
    # deadline instead of 50 (its event loop is shared with the clients and the fake worker here)
    monkeypatch.setattr(servicer_module, "DEADLINE_HEADROOM_S", 0.15)

    async def main():
        async with harness(
            FakeWorker(step_delay=TOKEN_INTERVAL_S, max_batch_size=16, max_batch_tokens=1024), max_batch_size=16
        ) as (router, fake, stub, channel):
            return await asyncio.gather(*(_deadline_status(stub, i) for i in range(16)))

    with _heap_frozen():
        statuses = asyncio.run(main())
    for status in statuses:
        assert status is not None, "gRPC cut the call before the router answered"
        assert status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        info = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(info) and info.reason in ("DEADLINE_EXCEEDED", "QUEUE_TIMEOUT")
