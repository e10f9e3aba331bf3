"""Where the worker listens: its RPCs on a Unix socket or a TCP address, a health-only TCP port for probes.

Every bind failure is one line naming the role and the address ("worker gRPC 127.0.0.1:50052 is in use")
and exits with AddressInUseError's code, which `colibri serve` does not restart. gRPC's SO_REUSEPORT is
turned off, so a second worker on the same port fails instead of silently sharing it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
from pathlib import Path

import grpc

from common.errors import AddressInUseError, ConfigError
from common.listen_address import bind_failure, grpc_listen_address, unix_socket_path_problem

log = logging.getLogger("colibri.worker")
# A router whose host died, or whose connection a network dropped, leaves a half-open connection: without pings of
# the worker's own its step stream (and the sequences it holds, which refuse the next router's ClearCache) lived
# for gRPC's default 2 hours. Pinged every KEEPALIVE_S, it ends once a ping goes unanswered PING_TIMEOUT_S.
KEEPALIVE_S = 20.0
PING_TIMEOUT_S = 10.0


def server_options(keepalive_s: float = KEEPALIVE_S, ping_timeout_s: float = PING_TIMEOUT_S) -> list[tuple[str, int]]:
    """The worker's gRPC server options (a test shortens the keepalive)."""
    timeout_ms = int(ping_timeout_s * 1000)
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        # gRPC ends the connection at its ping timeout (60 s by default); keepalive_timeout_ms alone was not heeded
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # the router pings every 10 s (worker_client.py): more often than gRPC's default 5 min would be abuse
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ]


SERVER_OPTIONS = server_options()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_tcp(server: grpc.aio.Server, role: str, host: str, port: int) -> int:
    """Adds an insecure TCP port; returns the port bound (port 0 picks one)."""
    try:
        bound = server.add_insecure_port(grpc_listen_address(host, port))
    except RuntimeError:
        bound = 0
    if not bound:
        raise bind_failure(role, host, port)
    return bound


def _socket_in_use(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def prepare_socket(path: str, role: str) -> Path:
    """Checks the socket's directory and clears a stale socket file a previous run left behind."""
    p = Path(path)
    if not p.is_absolute():
        raise ConfigError(f"socket: {path} must be an absolute path")
    if (problem := unix_socket_path_problem(path)) is not None:
        raise ConfigError(f"socket: {problem}: use a shorter one")
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(f"socket: directory {parent} does not exist")
    mode = parent.stat().st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        log.warning(
            "the socket directory %s is writable by every user: another user could replace the "
            "socket; use a directory only this user can write",
            parent,
        )
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise AddressInUseError(f"{role} unix:{p} cannot be bound: a file that is not a socket is there")
        if _socket_in_use(p):
            raise AddressInUseError(f"{role} unix:{p} is in use")
        p.unlink()  # stale: nobody listens on it
    return p


def bind_socket(server: grpc.aio.Server, role: str, path: str) -> Path:
    """Adds a Unix socket only this user can connect to (mode 0600, created under umask 077)."""
    p = prepare_socket(path, role)
    old = os.umask(0o077)
    try:
        bound = server.add_insecure_port(f"unix:{p}")
    except RuntimeError:
        bound = 0
    finally:
        os.umask(old)
    if not bound or not p.exists():
        raise AddressInUseError(f"{role} unix:{p} cannot be bound")
    os.chmod(p, 0o600)
    return p
