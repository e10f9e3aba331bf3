"""The HTTP port's cap on open connections (`http_max_connections`; router_service/http_api.py applies it).

aiohttp takes every connection it is offered: a client opening thousands of idle or slow ones would hold a file
descriptor and a handler each until its header timeout. `ConnectionGate` is the listening socket's protocol
factory: it hands each connection to aiohttp's handler while fewer than the cap are open; past it the connection
is sent a canned 503 (OpenAI's error shape, `Retry-After`, `Connection: close`) as soon as it opens, and closed
once the client has closed its side or after REFUSAL_LINGER_S or REFUSAL_LINGER_BYTES (a close with the client's
request unread would reset the connection and could lose the answer); at most MAX_LINGERING linger, so a flood of
refusals holds few descriptors. A request answered before its body arrived (`close_unread`) lingers the same way.
Connections still in their TLS handshake are not counted: each has http_header_timeout_s to finish it (the
server's ssl_handshake_timeout). The gate sees each connection's bytes as they arrive: a chunked body whose
framing outgrows the body it carries (`framing`) fails its reader, which the body's own limits never see.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable, Iterator

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError

from common.listen_address import dual_stack_socket, is_dual_stack, listen_host

# How long and how many bytes a refused connection is read on before it closes (a close with the client's bytes
# unread resets the connection, and the client may lose the answer): a client past either has had its chance.
REFUSAL_LINGER_S = 1.0
REFUSAL_LINGER_BYTES = 1024 * 1024
# A chunked body's framing (chunk sizes, extensions) may take this many bytes per body byte (1-byte chunks with a
# short extension take 7) and FRAMING_SLACK_BYTES besides: framing that carries no body is filler, sent on and on.
FRAMING_BYTES_PER_BYTE = 8
FRAMING_SLACK_BYTES = 64 * 1024
MAX_LINGERING = 64  # refused connections lingering at once; past it (a flood) one is closed as soon as answered


def refusal(limit: int, retry_after_s: float) -> bytes:
    """The whole answer to a connection past the cap."""
    message = f"the router has {limit} HTTP connections open (http_max_connections); retry shortly"
    error = {"message": message, "type": "server_error", "param": None, "code": "too_many_connections"}
    body = json.dumps({"error": error}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Retry-After: {max(1, math.ceil(retry_after_s))}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class FramingTooLarge(web.RequestPayloadError):
    """A chunked body whose framing outgrew its bytes (the body's reader raises it)."""


class _Framing:
    """Watches one chunked body's bytes on the wire against the body bytes they carried."""

    def __init__(self, payload) -> None:
        self.payload, self.start = payload, payload.total_bytes
        self.wire = 0

    def took(self, size: int) -> None:
        """`size` bytes arrived (and were parsed): the body's reader fails once they are mostly framing."""
        payload = self.payload
        if payload.is_eof() or payload.exception() is not None:
            return  # what follows the body is the next request's, not framing
        self.wire += size
        carried = payload.total_bytes - self.start
        if self.wire > FRAMING_BYTES_PER_BYTE * carried + FRAMING_SLACK_BYTES:
            payload.set_exception(
                FramingTooLarge(
                    f"its chunked framing (chunk sizes, extensions) passed {FRAMING_SLACK_BYTES} bytes beyond "
                    f"{FRAMING_BYTES_PER_BYTE} per body byte"
                )
            )


class ConnectionGate:
    """Protocol factory for the HTTP port: `factory()` (aiohttp's server) serves each connection while fewer than
    `limit` are open; the others are refused. `open` counts the connections served now."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        limit: int,
        retry_after_s: float,
        on_refused: Callable[[], None] = lambda: None,
    ):
        self.factory, self.limit, self.on_refused = factory, limit, on_refused
        self.answer = refusal(limit, retry_after_s)
        self.open = 0
        self._refused: set[asyncio.Transport] = set()  # refused connections lingering before their close
        self._served: dict[asyncio.BaseTransport | None, _Gated] = {}  # the connections served, by transport

    def __call__(self) -> asyncio.Protocol:
        return _Gated(self)

    @contextlib.contextmanager
    def framing(self, request: web.Request) -> Iterator[None]:
        """Within it, the request's chunked body fails with FramingTooLarge once its framing outgrows its bytes."""
        served = self._served.get(request.transport) if request.transport is not None else None
        if served is None:
            yield
            return
        served.framing = _Framing(request.content)
        try:
            yield
        finally:
            served.framing = None

    def close(self) -> None:
        """Closes the refused connections still lingering (the server stops)."""
        for transport in list(self._refused):
            transport.abort()
        self._refused.clear()


class _Gated(asyncio.Protocol):
    """One connection: aiohttp's handler behind it, or a refusal."""

    def __init__(self, gate: ConnectionGate):
        self.gate = gate
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.dropped = 0  # a refused connection's bytes
        self.framing: _Framing | None = None  # a chunked body being read

    def connection_made(self, transport) -> None:
        gate = self.gate
        if gate.open < gate.limit:
            gate.open += 1
            self.inner = gate.factory()
            gate._served[transport] = self
            self.transport = transport
            self.inner.connection_made(transport)
            return
        gate.on_refused()
        transport.write(gate.answer)
        if len(gate._refused) >= MAX_LINGERING:
            transport.close()
            return
        self.transport = transport
        gate._refused.add(transport)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
            if self.framing is not None:
                self.framing.took(len(data))
            return
        self.dropped += len(data)  # a refused connection's bytes are dropped, so many at most
        if self.dropped > REFUSAL_LINGER_BYTES and self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None  # refused: None closes it

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.gate.open -= 1
            self.gate._served.pop(self.transport, None)
            self.inner.connection_lost(exc)
            return
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.gate._refused.discard(self.transport)


def body_unread(request: web.Request) -> bool:
    """True when the request announced a body that has not all arrived: its answer must end the connection."""
    return request.body_exists and not request.content.is_eof()


def framing_faulty(request: web.Request) -> bool:
    """An HTTP/1.0 request with Transfer-Encoding, which HTTP/1.0 lacks: RFC 9112 has its framing treated as faulty
    (a sender may have kept part of the message back) and its connection closed after it."""
    return request.version < HttpVersion11 and hdrs.TRANSFER_ENCODING in request.headers


async def close_unread(request: web.Request) -> None:
    """Ends the connection of a request answered before its body arrived (the answer sent, with `Connection:
    close`): the answer's end is signalled (a half-close), the body read on and dropped for at most
    REFUSAL_LINGER_BYTES and REFUSAL_LINGER_S, then the connection is closed. aiohttp would read on for 10 s at any
    rate, then serve the next request."""
    transport = request.transport
    if transport is None:
        return
    if transport.can_write_eof():  # not over TLS
        transport.write_eof()
    dropped = 0
    try:
        async with asyncio.timeout(REFUSAL_LINGER_S):
            while dropped <= REFUSAL_LINGER_BYTES and (piece := await request.content.readany()):
                dropped += len(piece)
    except (TimeoutError, ConnectionError, HttpProcessingError, web.RequestPayloadError):
        pass  # the linger is over, or the body was malformed: the connection ends either way
    request.protocol.force_close()  # aiohttp's own linger is skipped, and so is the next request


async def listen(factory, config, hooks, host: str, port: int, ssl_context) -> tuple[asyncio.Server, ConnectionGate]:
    """The HTTP port's listening socket, serving connections with `factory` (aiohttp's server) through a gate of
    config.http_max_connections; a TLS handshake gets http_header_timeout_s (the time a connection has from its
    opening to send its headers). Raises OSError when the address cannot be bound. The open-file limit is the
    caller's to fit (router_service/main.py sizes it for every port's cap)."""
    limit = config.http_max_connections
    gate = ConnectionGate(factory, limit, config.retry_after_s, hooks.on_http_connection_refused)
    hooks.on_http_connections(lambda: gate.open)
    ssl_options = {
        "ssl": ssl_context,
        "ssl_handshake_timeout": config.http_header_timeout_s if ssl_context is not None else None,
    }
    loop = asyncio.get_running_loop()
    bound_host = listen_host(host)
    if is_dual_stack(bound_host):  # asyncio would bind `::` IPv6 only (it sets IPV6_V6ONLY)
        server = await loop.create_server(gate, sock=dual_stack_socket(port), **ssl_options)
    else:
        server = await loop.create_server(gate, bound_host, port, **ssl_options)
    return server, gate
