"""Bounds on the connections a server holds: the gRPC ports' cap (`grpc_max_connections`, the router's and the
worker's), their idle and handshake timeouts, and the process's open-file limit sized to fit every cap (the HTTP
port's `http_max_connections` too).

gRPC core enforces the cap (`grpc.max_allowed_incoming_connections`): it counts a connection from its accept, the
handshake included, until it closes, and closes one accepted past the cap at once, before reading from it (its
client's call fails UNAVAILABLE). Each listening server counts its own. gRPC reports neither refusals nor idle
closes, so no counter follows them; the open connections are read from channelz (common/grpc_connections.py).
"""

from __future__ import annotations

import logging

log = logging.getLogger("colibri.connections")
# Descriptors a process needs besides its capped connections: lingering HTTP refusals, channels to the worker,
# metrics, chat-template processes, token, certificate and model files.
FD_RESERVE = 256
MAX_CONNECTIONS = 1 << 20  # Linux's default ceiling on a process's open files (fs.nr_open); gRPC aborts at 2^31 - 1
# A connection with no call open this long is sent GOAWAY (its client reconnects when it next calls), so abandoned
# ones give their place back. Keep-alive pings do not count as calls.
GRPC_IDLE_TIMEOUT_MS = 300_000
# TLS and the HTTP/2 preface take milliseconds; without this a connection that never speaks holds its place for
# gRPC's default of 120 s.
GRPC_HANDSHAKE_TIMEOUT_MS = 10_000


def grpc_connection_options(max_connections: int) -> list[tuple[str, int]]:
    """A gRPC server's options for at most `max_connections` open connections on each of its ports."""
    return [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.max_connection_idle_ms", GRPC_IDLE_TIMEOUT_MS),
        ("grpc.server_handshake_timeout_ms", GRPC_HANDSHAKE_TIMEOUT_MS),
    ]


def fit_open_files(connections: int, settings: str) -> None:
    """Raises the process's soft open-file limit to fit `connections` (what `settings` allow open at once) and
    FD_RESERVE other descriptors, as far as the hard limit allows; warns when it cannot (the caps would not stop the
    descriptors running out first)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < need:
        log.warning(
            "the open-file limit (%d) leaves room for about %d connections, fewer than %s allow (%d): raise the "
            "limit (ulimit -n, or the container's nofile) or lower the setting",
            soft,
            max(0, soft - FD_RESERVE),
            settings,
            connections,
        )
