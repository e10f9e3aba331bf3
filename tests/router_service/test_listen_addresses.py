"""Every router listener (gRPC, health, HTTP, metrics) binds the address its setting names: 127.0.0.1 or ::1 keep it
on this host over that protocol only, and `::` (the default for --host) takes IPv4 and IPv6 alike, so an IPv6-only
cluster reaches the router as a dual-stack one does."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from common.errors import AddressInUseError
from common.metrics import new_registry
from router_service.config import RouterConfig
from router_service.main import start_router
from tests.grpc_teardown import grpc_tasks_ended
from tests.helpers import free_port
from tests.listen_checks import EVERY_LOOPBACK, HAS_IPV6, IPV4_LOOPBACK, IPV6_LOOPBACK, accepts, reached

NO_IPV6 = pytest.mark.skipif(not HAS_IPV6, reason="this host has no IPv6 loopback")
CASES = [
    pytest.param({"host": IPV4_LOOPBACK, "metrics_host": IPV4_LOOPBACK}, {IPV4_LOOPBACK}, id="ipv4-loopback"),
    pytest.param(
        {"host": IPV6_LOOPBACK, "metrics_host": IPV6_LOOPBACK}, {IPV6_LOOPBACK}, id="ipv6-loopback", marks=NO_IPV6
    ),
    pytest.param({"metrics_host": "::"}, EVERY_LOOPBACK, id="default-every-interface"),
    # ::ffff:127.0.0.1 is 127.0.0.1: the HTTP front and the metrics port must bind it as gRPC does (an IPv6 socket
    # with IPV6_V6ONLY on refuses it with "Invalid argument")
    pytest.param({"host": "::ffff:127.0.0.1", "metrics_host": "[::ffff:127.0.0.1]"}, {IPV4_LOOPBACK}, id="ipv4-mapped"),
]


@pytest.mark.parametrize("hosts, expected", CASES)
def test_every_router_listener_binds_the_configured_address(hosts, expected):
    async def body():
        ports = {"health_port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
        config = RouterConfig(port=0, worker_retry_s=0.05, warmup=False, **ports, **hosts)
        # No worker behind it: the ports are bound before one connects.
        router = await start_router(config, "127.0.0.1:1", metrics_registry=new_registry())
        try:
            listeners = {"grpc": router.port, **ports}
            return {name: await asyncio.to_thread(reached, port) for name, port in listeners.items()}
        finally:
            await router.stop(grace=0.1)
            await grpc_tasks_ended()

    reached_by = asyncio.run(body())
    assert reached_by == dict.fromkeys(("grpc", "health_port", "http_port", "metrics_port"), expected)


def test_a_second_router_on_the_same_port_is_refused():
    # gRPC sets SO_REUSEPORT unless told not to: a second router would share the port with the first, the kernel
    # handing each new connection to either
    async def body():
        config = RouterConfig(host=IPV4_LOOPBACK, port=free_port(), worker_retry_s=0.05, warmup=False)
        first = await start_router(config, "127.0.0.1:1")
        try:
            with pytest.raises(AddressInUseError) as e:
                second = await start_router(config, "127.0.0.1:1")
                await second.stop(grace=0)
            return str(e.value)
        finally:
            await first.stop(grace=0.1)
            await grpc_tasks_ended()

    assert asyncio.run(body()).startswith("router gRPC 127.0.0.1:")


def test_a_port_that_cannot_be_bound_leaves_nothing_listening():
    # the metrics port is bound before the gRPC port: a failed start-up left its socket and thread behind
    async def body():
        with socket.socket() as busy:
            busy.bind((IPV4_LOOPBACK, 0))
            busy.listen()
            metrics_port = free_port()
            config = RouterConfig(
                host=IPV4_LOOPBACK,
                port=busy.getsockname()[1],
                metrics_host=IPV4_LOOPBACK,
                metrics_port=metrics_port,
                worker_retry_s=0.05,
                warmup=False,
            )
            with pytest.raises(AddressInUseError) as e:
                await start_router(config, "127.0.0.1:1", metrics_registry=new_registry())
        return str(e.value), metrics_port

    message, metrics_port = asyncio.run(body())
    assert not accepts(IPV4_LOOPBACK, metrics_port)
    assert not [t for t in threading.enumerate() if t.name == "colibri-router-metrics"]
    assert message.endswith("is in use") and "\n" not in message


def test_an_address_of_another_host_is_refused_in_one_line_saying_why():
    # 192.0.2.1 (TEST-NET-1) resolves but is no address of this host
    async def body():
        config = RouterConfig(host="192.0.2.1", port=free_port(), worker_retry_s=0.05, warmup=False)
        with pytest.raises(AddressInUseError) as e:
            await start_router(config, "127.0.0.1:1")
        return str(e.value)

    message = asyncio.run(body())
    assert message.startswith("router gRPC 192.0.2.1:") and "cannot be bound: " in message
    assert "in use" not in message and "\n" not in message
