"""Open connections of a gRPC server, as gRPC core's channelz counts them (grpcio has no public count).

The connection cap and the idle timeout (common/connection_limits.py) are enforced inside gRPC core, which neither
tells the process when it refuses or idles out a connection nor counts either: no counter of them can be exported.
What channelz does hold is each server's open connections (its sockets), read here at scrape time; at
grpc_max_connections, new connections are being closed as they open. Channelz is reached through grpcio's Cython
layer (what the grpcio-channelz package calls); where that is missing, `count()` is None and the gauges say 0.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import grpc

log = logging.getLogger("colibri.connections")
PAGE = 1000  # sockets per channelz query

try:
    from grpc._cython import cygrpc

    _get_servers, _get_server_sockets = cygrpc.channelz_get_servers, cygrpc.channelz_get_server_sockets
except (ImportError, AttributeError):  # a grpcio without channelz: no count, the servers run as before
    _get_servers = _get_server_sockets = None


def _server_ids() -> set[int]:
    if _get_servers is None:
        return set()
    ids: set[int] = set()
    start = 0
    while True:
        page = json.loads(_get_servers(start))
        found = [int(s["ref"]["serverId"]) for s in page.get("server", [])]
        ids.update(found)
        if page.get("end", True) or not found:
            return ids
        start = max(found) + 1


def _server_ids_or_none() -> set[int] | None:
    """_server_ids(), or None when grpcio's private channelz fails in any way (a grpcio whose Cython layer or JSON
    changed): the count is a gauge, never a reason for a server not to start."""
    try:
        return _server_ids()
    except Exception as e:  # noqa: BLE001 - a private API: whatever it raises, the server runs uncounted
        log.warning("gRPC channelz cannot be read (%s): open connections read 0", e)
        return None


class ConnectionCount:
    """`count()`: the open connections of one gRPC server, or None when channelz cannot say."""

    def __init__(self, server_id: int | None):
        self.server_id = server_id

    def count(self) -> int | None:
        if self.server_id is None or _get_server_sockets is None:
            return None
        total, start = 0, 0
        while True:
            try:
                page = json.loads(_get_server_sockets(self.server_id, start, PAGE))
                sockets = [int(s["socketId"]) for s in page.get("socketRef", [])]
            except Exception:  # noqa: BLE001 - a stopped server (channelz forgets it: ValueError) or a changed
                return None  # private API: a scrape must not fail on either
            total += len(sockets)
            if page.get("end", True) or not sockets:
                return total
            start = max(sockets) + 1

    def gauge_value(self) -> float:
        return float(self.count() or 0)


def counted_server(make: Callable[[], grpc.aio.Server]) -> tuple[grpc.aio.Server, ConnectionCount]:
    """`make()`'s server and its connection count. Channelz numbers a server when it is created, so the server is the
    one id that appears across `make()` (servers are created one at a time by the thread that starts a process)."""
    before = _server_ids_or_none()
    server = make()
    after = _server_ids_or_none() if before is not None else None
    new = after - before if after is not None and before is not None else set()
    if len(new) != 1:
        log.warning("gRPC channelz does not identify the new server: its open connections read 0")
        return server, ConnectionCount(None)
    return server, ConnectionCount(new.pop())
