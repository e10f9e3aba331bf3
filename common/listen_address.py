"""Where a listener binds: the operator's address settings, checked at start-up, and `::` (every interface) bound
dual-stack, so a server is reachable on IPv4, IPv6 and IPv6-only clusters alike.

`::` means every interface, IPv6 and IPv4: bound as one IPv6 socket with IPV6_V6ONLY off (IPv4 clients arrive as
::ffff:a.b.c.d), or as 0.0.0.0 on a host without IPv6. gRPC core already binds any wildcard that way; asyncio and
socketserver do not (asyncio sets IPV6_V6ONLY on every IPv6 socket, socketserver leaves the platform's default), so
the HTTP front and the metrics port take their sockets from here. Any other address is bound as given: 0.0.0.0 is
IPv4 only on those two (gRPC core makes it dual-stack too), ::1 and 127.0.0.1 this host only.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import os
import socket

from common.errors import AddressInUseError

log = logging.getLogger("colibri.listen")
EVERY_INTERFACE = "::"
IPV4_EVERY_INTERFACE = "0.0.0.0"
# sockaddr_un.sun_path is 108 bytes on Linux, its terminating NUL included: gRPC and the kernel refuse a longer path
# with no word of why ("cannot be bound", "Failed to create channel").
MAX_UNIX_SOCKET_PATH_BYTES = 107
ADDRESS_HELP = "an IP address or a host name; :: = every interface, IPv6 and IPv4 (0.0.0.0 where the host has no IPv6)"


def _unbracketed(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def unix_socket_path_problem(path: str) -> str | None:
    """Why `path` cannot be a Unix socket's address (too long), or None; the message starts with the path."""
    size = len(os.fsencode(path))
    if size <= MAX_UNIX_SOCKET_PATH_BYTES:
        return None
    return f"{path} is {size} bytes long; a Unix socket path holds at most {MAX_UNIX_SOCKET_PATH_BYTES}"


def bind_address_problem(host: str) -> str | None:
    """Why a listener cannot bind `host`, or None: it must be an IP address (an IPv6 one with or without brackets)
    or a name this machine resolves now (a typo would otherwise fail later, as a port that 'cannot be bound')."""
    bare = _unbracketed(host)
    if not bare.strip():
        return "is empty: give an IP address (:: for every interface) or a host name"
    try:
        ipaddress.ip_address(bare)
        return None
    except ValueError:
        pass
    if bare != host:
        return "is not an IPv6 address, yet it is in brackets"
    try:
        socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return "is neither an IP address nor a host name this machine resolves"
    return None


@functools.cache
def ipv6_available() -> bool:
    """Whether this host can bind an IPv6 socket on every interface with IPv4 mapped onto it (a kernel booted with
    ipv6.disable=1, or a Python built without IPv6, cannot)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind((EVERY_INTERFACE, 0))
    except OSError:
        return False
    return True


def listen_host(host: str) -> str:
    """The address a listener binds for the setting `host` (brackets dropped): `::` becomes 0.0.0.0 on a host
    without IPv6, and an IPv4-mapped address (::ffff:a.b.c.d) its IPv4 address, which is what it means: an IPv6
    socket cannot bind one once IPV6_V6ONLY is on, as it is on every IPv6 socket but `::`."""
    bare = _unbracketed(host)
    if bare == EVERY_INTERFACE and not ipv6_available():
        log.info("this host has no IPv6: listening on 0.0.0.0 (IPv4) for ::")
        return IPV4_EVERY_INTERFACE
    try:
        mapped = ipaddress.ip_address(bare)
    except ValueError:
        return bare
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        return str(mapped.ipv4_mapped)
    return bare


def bind_targets(bound_host: str, port: int) -> list[tuple[socket.AddressFamily, tuple]]:
    """The family and socket address of every address `bound_host` (listen_host's answer) resolves to, in the
    resolver's order and without repeats (a name such as localhost may be 127.0.0.1 and ::1, and gRPC and the HTTP
    front bind each), each with an IPv6 zone (fe80::1%eth0) as its scope id, which bind((host, port)) would drop
    and the kernel then refuses a link-local address. Raises OSError when the name does not resolve."""
    targets: list[tuple[socket.AddressFamily, tuple]] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(bound_host, port, type=socket.SOCK_STREAM):
        if (family, sockaddr) not in targets:
            targets.append((family, sockaddr))
    return targets


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC targets and logs write it: an IPv6 address in brackets."""
    bare = _unbracketed(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def grpc_listen_address(host: str, port: int) -> str:
    """What to give grpc's add_*_port for the setting `host`."""
    return host_port(listen_host(host), port)


def is_dual_stack(bound_host: str) -> bool:
    """Whether a socket bound on `bound_host` (listen_host's answer) takes IPv4 and IPv6 alike."""
    return bound_host == EVERY_INTERFACE


def set_v6only(sock: socket.socket, bound_host: str) -> None:
    """IPV6_V6ONLY off on the every-interface socket, on on any other IPv6 one (the platform's default varies)."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if is_dual_stack(bound_host) else 1)


def dual_stack_socket(port: int) -> socket.socket:
    """A TCP socket bound on every interface, IPv6 and IPv4 (`::` with IPV6_V6ONLY off), not yet listening.
    Raises OSError when the port cannot be bound."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server does
        set_v6only(sock, EVERY_INTERFACE)
        sock.bind((EVERY_INTERFACE, port))
    except OSError:
        sock.close()
        raise
    return sock


def bound_address(bound_host: str, sockaddr: tuple, several: bool) -> str:
    """How a bind error names one address of `bound_host`: the host as given, or, where it resolves to several,
    the address that failed (so the message says which one)."""
    return host_port(sockaddr[0] if several else bound_host, sockaddr[1])


def bind_error(role: str, where: str, error: OSError) -> AddressInUseError:
    """One bind failure in one line: "worker metrics [::]:9091 is in use", or "... cannot be bound: <reason>"."""
    if error.errno == errno.EADDRINUSE:
        return AddressInUseError(f"{role} {where} is in use")
    return AddressInUseError(f"{role} {where} cannot be bound: {error.strerror or error}")


def bind_failure(role: str, host: str, port: int) -> AddressInUseError:
    """Why gRPC could not bind host:port, found by binding each address ourselves (gRPC only says that it failed):
    one line naming the role and the address ("worker gRPC 127.0.0.1:50052 is in use")."""
    bound_host = listen_host(host)
    where = host_port(bound_host, port)
    try:
        targets = bind_targets(bound_host, port)
        for family, sockaddr in targets:
            where = bound_address(bound_host, sockaddr, len(targets) > 1)
            with socket.socket(family, socket.SOCK_STREAM) as s:
                set_v6only(s, bound_host)
                s.bind(sockaddr)
    except OSError as e:
        return bind_error(role, where, e)
    return AddressInUseError(f"{role} {host_port(bound_host, port)} cannot be bound")
