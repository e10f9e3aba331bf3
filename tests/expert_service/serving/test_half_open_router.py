"""A router that vanishes without closing its connection (its host died, a network dropped the connection) left its
step stream open on the worker for gRPC's default keepalive of 2 hours: the sequences it held refused every later
router's ClearCache for as long. The worker pings its callers now, and a connection whose ping goes unanswered ends
with its streams."""

from __future__ import annotations

import asyncio
import random

import grpc

from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from expert_service.serving import endpoints
from router_service import worker_connection
from tests.grpc_teardown import served


class _Echo(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self):
        self.ended = asyncio.Event()

    async def StepStream(self, request_iterator, context):
        try:
            async for request in request_iterator:
                yield pb.StepStreamResponse(step_id=request.step_id)
        finally:
            self.ended.set()


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cut: asyncio.Event) -> None:
    """Copies bytes until `cut`, then swallows them: the peer's packets stop arriving, its socket never closes."""
    while data := await reader.read(65536):
        if not cut.is_set():
            writer.write(data)


def test_a_step_stream_whose_router_went_silent_ends_at_the_keepalive():
    async def main():
        servicer, cut, tasks = _Echo(), asyncio.Event(), []
        server = grpc.aio.server(options=endpoints.server_options(keepalive_s=0.3, ping_timeout_s=0.5))
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        async with served(server, grace=None) as port:

            async def relay(client_reader, client_writer):
                worker_reader, worker_writer = await asyncio.open_connection("127.0.0.1", port)
                tasks.extend(
                    asyncio.ensure_future(_relay(r, w, cut))
                    for r, w in ((client_reader, worker_writer), (worker_reader, client_writer))
                )

            proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}")
            try:
                call = worker_pb2_grpc.WorkerServiceStub(channel).StepStream()
                step_id = random.randint(1, 1 << 30)
                await call.write(pb.StepStreamRequest(step_id=step_id))
                assert (await call.read()).step_id == step_id
                cut.set()
                await asyncio.wait_for(servicer.ended.wait(), 45)  # in about a second; 2 hours before
            finally:
                call.cancel()
                await channel.close()
                for task in tasks:
                    task.cancel()
                proxy.close()

    asyncio.run(main())


def test_the_keepalive_ends_a_silent_stream_before_the_router_warns_of_a_held_worker():
    """A router that reconnects after losing its own stream to a network fault waits for that stream's end at the
    worker; it warns of a worker held by another client only after that end should have come."""
    options = dict(endpoints.SERVER_OPTIONS)
    held_s = (options["grpc.keepalive_time_ms"] + options["grpc.http2.ping_timeout_ms"]) / 1000
    assert held_s * 2 < worker_connection.BUSY_WARNING_S
