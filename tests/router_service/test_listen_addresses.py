"""Every router listener (gRPC, health, HTTP, metrics) binds the address its setting names: 127.0.0.1 or ::1 keep it
on this host over that protocol only, and `::` (the default for --host) takes IPv4 and IPv6 alike, so an IPv6-only
cluster reaches the router as a dual-stack one does."""

from __future__ import annotations

import asyncio

import pytest

from common.metrics import new_registry
from router_service.config import RouterConfig
from router_service.main import start_router
from tests.helpers import free_port
from tests.listen_checks import EVERY_LOOPBACK, HAS_IPV6, IPV4_LOOPBACK, IPV6_LOOPBACK, reached

NO_IPV6 = pytest.mark.skipif(not HAS_IPV6, reason="this host has no IPv6 loopback")
CASES = [
    pytest.param({"host": IPV4_LOOPBACK, "metrics_host": IPV4_LOOPBACK}, {IPV4_LOOPBACK}, id="ipv4-loopback"),
    pytest.param(
        {"host": IPV6_LOOPBACK, "metrics_host": IPV6_LOOPBACK}, {IPV6_LOOPBACK}, id="ipv6-loopback", marks=NO_IPV6
    ),
    pytest.param({"metrics_host": "::"}, EVERY_LOOPBACK, id="default-every-interface"),
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

    reached_by = asyncio.run(body())
    assert reached_by == dict.fromkeys(("grpc", "health_port", "http_port", "metrics_port"), expected)
