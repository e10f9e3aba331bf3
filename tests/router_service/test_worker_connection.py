"""Waiting for a worker that is not there (nothing listening, an HTTP server, a peer that accepts and never answers):
bounded attempts, one INFO line when the wait starts and then one every WAITING_LOG_S, each with gRPC's reason; no
WARNING (nothing refused the router) and no traceback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from router_service import worker_connection
from router_service.config import RouterConfig
from router_service.worker_client import WorkerClient
from router_service.worker_connection import WorkerConnector
from tests.helpers import free_port, grpc_poller_of_a_closed_loop


@contextlib.asynccontextmanager
async def peer(kind: str):
    """The address of a peer that is no worker: `closed` (nothing listens), `http` (answers HTTP/1.1), `hang`
    (accepts and never writes)."""
    if kind == "closed":
        yield f"127.0.0.1:{free_port()}"
        return
    held: list[asyncio.StreamWriter] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if kind == "http":
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
        else:
            held.append(writer)

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()


@pytest.mark.parametrize(
    "kind, reason",
    [("closed", "Connection refused"), ("http", "HTTP/2"), ("hang", "no answer in time")],
)
def test_a_missing_or_wrong_worker_is_waited_for_with_its_reason_once_an_interval(caplog, kind, reason):
    """The router logged "waiting for the worker at ADDR" on every attempt (every second by default, for the
    minutes a large model loads) and never why; a peer that never answered was a WARNING that it refused us."""

    async def main():
        async with peer(kind) as address:
            client = WorkerClient(address, control_timeout_s=0.2)
            connector = WorkerConnector(RouterConfig(worker=address, worker_retry_s=0.01), client)
            try:
                for _ in range(4 if kind == "hang" else 20):
                    assert await asyncio.wait_for(connector.attempt(), 5) is None
                connector._next_waiting_log = 0.0  # WAITING_LOG_S has passed
                assert await connector.attempt() is None
                assert await connector.attempt() is None
            finally:
                await client.close()

    with caplog.at_level(logging.INFO, logger=worker_connection.log.name):
        asyncio.run(main())
    lines = [r for r in caplog.records if r.name == worker_connection.log.name]
    assert [r.levelno for r in lines] == [logging.INFO] * 2, [r.getMessage() for r in lines]
    first, later = (r.getMessage() for r in lines)
    assert first.startswith("waiting for the worker at 127.0.0.1:") and reason in first, first
    assert later.startswith("still waiting for the worker at 127.0.0.1:"), later
    assert not any(r.exc_info and not grpc_poller_of_a_closed_loop(r) for r in caplog.records)


def test_a_worker_running_another_streams_sequences_is_waited_for_then_reset(worker, caplog):
    """The worker refuses ClearCache while a step stream (another router's, or one of ours it has not seen end)
    runs sequences: the router waits, logged at INFO with the worker's reason (no WARNING: nothing is wrong with
    the router), and connects, the reset done, once that stream has ended."""
    import grpc
    import numpy as np

    from common.pb import worker_pb2 as pb
    from common.pb import worker_pb2_grpc
    from tests.expert_service.serving.test_second_caller import _Stream

    async def attempts(n: int):
        client = WorkerClient(worker.address)
        connector = WorkerConnector(RouterConfig(worker=worker.address, worker_retry_s=0.01), client)
        try:
            return [await connector.attempt() for _ in range(n)]
        finally:
            await client.close()

    rng = np.random.default_rng()
    request_id, prompt = int(rng.integers(1, 1 << 40)), rng.integers(0, 200, 5).tolist()
    with grpc.insecure_channel(worker.address) as channel:
        other = _Stream(worker_pb2_grpc.WorkerServiceStub(channel))
        chunk = pb.PrefillChunk(request_id=request_id, token_ids=prompt, sampling=pb.SamplingParams(), is_last=True)
        assert other.step(chunks=[chunk]).request_ids
        with caplog.at_level(logging.INFO, logger=worker_connection.log.name):
            assert asyncio.run(attempts(3)) == [None] * 3
        other.close()
    lines = [r for r in caplog.records if r.name == worker_connection.log.name]
    assert [r.levelno for r in lines] == [logging.INFO], [r.getMessage() for r in lines]
    assert "1 sequences of 1 open step stream are running" in lines[0].getMessage()
    assert asyncio.run(attempts(1))[0].num_kv_blocks > 0
    assert not worker.engine.sequences


class _Clock:
    """time.monotonic as worker_connection reads it, `ahead` seconds later than the real one."""

    def __init__(self):
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


def test_a_reset_refused_for_minutes_is_a_warning_once(worker, caplog, monkeypatch):
    """A worker held by a stream that never ends (a second router pointed at it) kept this router serving nothing
    with one INFO line every WAITING_LOG_S, never a WARNING; now one WARNING naming the worker once the refusals have
    lasted BUSY_WARNING_S, and no more for that wait."""
    import grpc
    import numpy as np

    from common.pb import worker_pb2 as pb
    from common.pb import worker_pb2_grpc
    from tests.expert_service.serving.test_second_caller import _Stream

    clock = _Clock()
    monkeypatch.setattr(worker_connection, "time", clock)

    async def attempts(gaps: list[float]):
        client = WorkerClient(worker.address)
        connector = WorkerConnector(RouterConfig(worker=worker.address, worker_retry_s=0.01), client)
        try:
            for gap in gaps:
                clock.ahead += gap
                assert await connector.attempt() is None
        finally:
            await client.close()

    rng = np.random.default_rng()
    request_id, prompt = int(rng.integers(1, 1 << 40)), rng.integers(0, 200, 5).tolist()
    step = worker_connection.BUSY_WARNING_S * rng.uniform(0.5, 0.9)
    with grpc.insecure_channel(worker.address) as channel:
        other = _Stream(worker_pb2_grpc.WorkerServiceStub(channel))
        chunk = pb.PrefillChunk(request_id=request_id, token_ids=prompt, sampling=pb.SamplingParams(), is_last=True)
        assert other.step(chunks=[chunk]).request_ids
        with caplog.at_level(logging.INFO, logger=worker_connection.log.name):
            asyncio.run(attempts([0.0, step, step, step, step]))
        other.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"the worker at {worker.address} has refused the router's reset for" in warnings[0]
    assert "1 sequences of 1 open step stream are running" in warnings[0] and "\n" not in warnings[0]
    assert not any(r.exc_info and not grpc_poller_of_a_closed_loop(r) for r in caplog.records)
