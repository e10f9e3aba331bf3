"""The bind-address settings: an IP address (IPv6 with or without brackets) or a name this machine resolves, else
refused in one line naming the flag; `::` is every interface, bound dual-stack where the host has IPv6."""

from __future__ import annotations

import socket

import pytest

from common import listen_address
from common.config import resolve
from common.errors import ConfigError
from common.listen_address import bind_address_problem, grpc_listen_address, listen_host
from expert_service.serving.main import WorkerConfig
from router_service.config import RouterConfig
from tests.listen_checks import HAS_IPV6

UNRESOLVABLE = "no-such-host.invalid"  # .invalid never resolves (RFC 2606)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "::", "0.0.0.0", "localhost"])
def test_addresses_and_resolvable_names_are_accepted(host):
    assert bind_address_problem(host) is None


@pytest.mark.parametrize("host", ["", " ", UNRESOLVABLE, "[localhost]", "300.1.2.3"])
def test_other_addresses_are_refused(host):
    assert bind_address_problem(host)


@pytest.mark.parametrize(
    "cls, field, flag",
    [
        (RouterConfig, "host", "--host"),
        (RouterConfig, "metrics_host", "--metrics-host"),
        (WorkerConfig, "host", "--host"),
        (WorkerConfig, "health_host", "--health-host"),
        (WorkerConfig, "metrics_host", "--metrics-host"),
    ],
)
def test_an_address_that_cannot_be_bound_is_refused_naming_the_flag(cls, field, flag):
    with pytest.raises(ConfigError) as e:
        resolve(cls, env={}, flags={field: UNRESOLVABLE})
    message = str(e.value)
    assert flag in message and UNRESOLVABLE in message and "\n" not in message


def test_every_interface_is_the_default_of_the_public_listeners():
    assert RouterConfig().host == "::" and WorkerConfig().health_host == "::"


def test_every_interface_falls_back_to_ipv4_without_ipv6(monkeypatch):
    monkeypatch.setattr(listen_address, "ipv6_available", lambda: False)
    assert listen_host("::") == listen_host("[::]") == "0.0.0.0"
    assert grpc_listen_address("::", 50051) == "0.0.0.0:50051"
    assert listen_host("::1") == "::1"  # only the wildcard falls back: ::1 is the operator's choice


@pytest.mark.skipif(not HAS_IPV6, reason="this host has no IPv6 loopback")
def test_the_dual_stack_socket_takes_ipv4_and_ipv6():
    with listen_address.dual_stack_socket(0) as server:
        assert server.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        server.listen()
        port = server.getsockname()[1]
        for address in ("127.0.0.1", "::1"):
            with socket.create_connection((address, port), timeout=5):
                pass
