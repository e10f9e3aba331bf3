"""Which loopback addresses reach a listening port: the tests of the bind-address settings connect over IPv4 and
IPv6 loopback to find out what a listener bound."""

from __future__ import annotations

import socket

IPV4_LOOPBACK, IPV6_LOOPBACK = "127.0.0.1", "::1"


def _can_bind_ipv6_loopback() -> bool:
    """Whether this host has IPv6 loopback (a CI container may have none): found by binding ::1, never assumed."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind((IPV6_LOOPBACK, 0))
    except OSError:
        return False
    return True


HAS_IPV6 = _can_bind_ipv6_loopback()
# What a listener on every interface (`::`, the default) is reached on here.
EVERY_LOOPBACK = {IPV4_LOOPBACK, IPV6_LOOPBACK} if HAS_IPV6 else {IPV4_LOOPBACK}


def accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=5):
            return True
    except OSError:
        return False


def reached(port: int) -> set[str]:
    """The loopback addresses whose connections `port` accepts."""
    return {address for address in (IPV4_LOOPBACK, IPV6_LOOPBACK) if accepts(address, port)}
