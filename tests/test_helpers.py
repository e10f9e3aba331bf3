"""The shared test helpers hold what they promise: a reserved port stays reserved until its server binds
it, and an in-process router does not make a test wait for a warm-up it does not need."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from tests.grpc_teardown import stopped
from tests.helpers import free_port, running_router


def test_a_free_port_is_kept_from_other_takers_until_its_server_binds_it():
    port = free_port()
    with socket.socket() as other:  # someone else's bind: no SO_REUSEADDR, so it cannot take the port
        with pytest.raises(OSError) as err:
            other.bind(("127.0.0.1", port))
        assert err.value.errno == errno.EADDRINUSE
    with socket.socket() as server:  # the server the port was chosen for binds it (SO_REUSEADDR)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()


def test_running_router_asks_for_no_warm_up_unless_told():
    from tests.router_service.fake_worker import FakeWorker, start_fake_worker

    async def main():
        fake = FakeWorker()
        server, address = await start_fake_worker(fake)
        try:
            async with running_router(address):
                assert "Warmup" not in fake.calls
            async with running_router(address, warmup=True):
                assert "Warmup" in fake.calls
        finally:
            await stopped(server)

    asyncio.run(main())


def test_served_returns_once_grpc_aio_s_own_tasks_have_ended():
    """A server stopped with a stream open: its stop() returns while grpc.aio's tasks for that call may still
    run (they would complete after the loop closed, on a later test's loop); `served` returns after them."""
    import grpc

    from tests.grpc_teardown import _runs_grpc_aio, served

    async def echo(requests, context):
        async for item in requests:
            yield item

    async def main():
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(echo)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {"Echo": handler}),))
        async with served(server) as port:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            call = channel.stream_stream("/t.Echo/Echo")()
            await call.write(b"x")
            assert await call.read() == b"x"
        left = [task for task in asyncio.all_tasks() if _runs_grpc_aio(task) and not task.done()]
        await channel.close()
        return left

    assert asyncio.run(main()) == []
