"""The shared test helpers hold what they promise: a reserved port stays reserved until its server binds
it, and an in-process router does not make a test wait for a warm-up it does not need."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

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
            await server.stop(0)

    asyncio.run(main())
