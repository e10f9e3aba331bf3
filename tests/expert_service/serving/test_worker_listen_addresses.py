"""Every worker listener (gRPC, health, metrics) binds the address its setting names: 127.0.0.1 or ::1 keep it on
this host over that protocol only, and `::` (the default for --health-host) takes IPv4 and IPv6 alike."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import BackgroundWorker, free_port
from tests.listen_checks import EVERY_LOOPBACK, HAS_IPV6, IPV4_LOOPBACK, IPV6_LOOPBACK, reached

NO_IPV6 = pytest.mark.skipif(not HAS_IPV6, reason="this host has no IPv6 loopback")
CASES = [
    pytest.param(
        {"host": IPV4_LOOPBACK, "health_host": IPV4_LOOPBACK, "metrics_host": IPV4_LOOPBACK},
        {IPV4_LOOPBACK},
        id="ipv4-loopback",
    ),
    pytest.param(
        {"host": IPV6_LOOPBACK, "health_host": IPV6_LOOPBACK, "metrics_host": IPV6_LOOPBACK},
        {IPV6_LOOPBACK},
        id="ipv6-loopback",
        marks=NO_IPV6,
    ),
    # every interface without a token must be allowed explicitly (the worker refuses it otherwise)
    pytest.param(
        {"host": "::", "metrics_host": "::", "allow_unauthenticated": True}, EVERY_LOOPBACK, id="every-interface"
    ),
]


@pytest.mark.parametrize("hosts, expected", CASES)
def test_every_worker_listener_binds_the_configured_address(tiny_model, hosts, expected):
    worker = BackgroundWorker(tiny_model)
    ports = {"health_port": free_port(), "metrics_port": free_port()}
    worker.config = dataclasses.replace(worker.config, **ports, **hosts)
    worker.start()
    try:
        reached_by = {name: reached(port) for name, port in {"grpc": worker.port, **ports}.items()}
    finally:
        worker.stop()
    assert reached_by == dict.fromkeys(("grpc", "health_port", "metrics_port"), expected)
