"""The bind-address settings: an IP address (IPv6 with or without brackets) or a name this machine resolves, else
refused in one line naming the flag; `::` is every interface, bound dual-stack where the host has IPv6."""

from __future__ import annotations

import ipaddress
import socket
import urllib.request

import pytest

from common import listen_address
from common.config import resolve
from common.errors import AddressInUseError, ConfigError
from common.listen_address import (
    bind_address_problem,
    bind_failure,
    grpc_listen_address,
    host_port,
    listen_host,
)
from common.metrics import new_registry, start_metrics_server
from expert_service.serving.main import WorkerConfig
from router_service.config import RouterConfig
from tests.listen_checks import HAS_IPV6, accepts

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


def _link_local() -> str | None:
    """An IPv6 link-local address of this host with its zone (fe80::1%eth0), from the kernel's table; None if
    there is none."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    for hex_address, _, _, scope, _, interface in rows:
        if scope == "20":  # link scope
            return f"{ipaddress.IPv6Address(bytes.fromhex(hex_address))}%{interface}"
    return None


LINK_LOCAL = _link_local()


@pytest.mark.skipif(LINK_LOCAL is None, reason="this host has no IPv6 link-local address")
def test_the_metrics_port_binds_a_link_local_address_with_its_zone():
    # bind((host, port)) drops the zone, and the kernel refuses a link-local address without one ("Invalid
    # argument"), while gRPC and the HTTP front bound it
    server = start_metrics_server(new_registry(), 0, LINK_LOCAL)
    port = server.server_port
    try:
        assert server.servers[0].socket.getsockname()[3] != 0  # the zone's interface
        with socket.create_connection((LINK_LOCAL, port), timeout=5):
            pass
    finally:
        server.shutdown()
        server.server_close()


def test_an_ipv4_mapped_address_is_its_ipv4_address():
    assert listen_host("::ffff:127.0.0.1") == listen_host("[::ffff:127.0.0.1]") == "127.0.0.1"
    assert listen_host("::1") == "::1" and listen_host("localhost") == "localhost"


def test_a_bind_failure_names_the_role_the_address_and_why():
    message = str(bind_failure("worker health", "192.0.2.1", 9))  # TEST-NET-1: no address of this host
    assert message.startswith("worker health 192.0.2.1:9 cannot be bound: ") and "\n" not in message
    if LINK_LOCAL is not None:  # with its zone, the address is refused for what it is: unassigned here
        zone = LINK_LOCAL.split("%")[1]
        assert "Invalid argument" not in str(bind_failure("worker gRPC", f"fe80::dead:1%{zone}", 0))


# A name resolving to two loopback addresses, as localhost does on many hosts (127.0.0.1 and ::1); two IPv4 ones
# where this host has no IPv6 loopback.
TWO_ADDRESSES = "two-loopbacks.test"
FIRST, SECOND = ("127.0.0.1", "::1") if HAS_IPV6 else ("127.0.0.1", "127.0.0.2")


@pytest.fixture
def two_address_name(monkeypatch):
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host == TWO_ADDRESSES:
            return [row for address in (FIRST, SECOND, FIRST) for row in real(address, port, *args, **kwargs)]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _metrics_answer(address: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host_port(address, port)}/metrics", timeout=5) as resp:
            return resp.status == 200 and b"process_" in resp.read()
    except OSError:
        return False


def test_the_metrics_port_binds_every_address_of_a_host_name(two_address_name):
    # gRPC and the HTTP front bind every address a name resolves to; a scraper on the other family was refused
    server = start_metrics_server(new_registry(), 0, TWO_ADDRESSES)
    port = server.server_port
    try:
        assert len(server.servers) == 2  # the repeated address is bound once
        assert {s.server_port for s in server.servers} == {port}  # port 0: the first free port, on both
        assert _metrics_answer(FIRST, port) and _metrics_answer(SECOND, port)
    finally:
        server.shutdown()
        server.server_close()
    assert not accepts(FIRST, port) and not accepts(SECOND, port)
    assert not any(t.is_alive() for t in server.threads)


def test_a_taken_port_on_the_second_address_names_it(two_address_name):
    family = socket.AF_INET6 if ":" in SECOND else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as taken:
        taken.bind((SECOND, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AddressInUseError) as e:
            start_metrics_server(new_registry(), port, TWO_ADDRESSES, role="worker metrics")
        assert str(e.value) == f"worker metrics {host_port(SECOND, port)} is in use"
        assert (
            str(bind_failure("worker gRPC", TWO_ADDRESSES, port)) == f"worker gRPC {host_port(SECOND, port)} is in use"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as first:  # the first address was let go again
        first.bind((FIRST, port))
