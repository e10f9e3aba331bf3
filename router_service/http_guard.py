"""What keeps the HTTP front's connections bounded and its log quiet when clients are hostile
(router_service/http_api.py applies it).

- Bodies (`read_body`): a body labelled with a form type a browser posts across sites unasked
  (text/plain, urlencoded, multipart) or with a coding not decoded here (DECODED_CODINGS) is a 415 before it is
  read, one that is not whole streams of its coding a 400 (router_service.http_codings); read within
  `http_body_timeout_s` (408 after it), at most `max_message_bytes` (413), each reserved in the front's body
  budget before it is read (router_service.http_bodies; 503 past it), then parsed and checked as JSON by
  router_service.http_json.
- Writes (`send`, `bounded`): one write of an answer may wait `http_write_timeout_s` for the client to read; a
  client that stops reading is disconnected (its buffered bytes dropped) and its request cancelled.
- `Expect: 100-continue` (`send_continue`, `refused_before_continue`): aiohttp would answer it before the
  middleware runs, inviting any client (one without a token included) to upload its body. Its routes get
  `defer_continue` instead, and the 100 goes out when a handler first reads the body: a request refused from
  its headers alone (auth, path, method, Content-Length, X-Request-Id, room) gets its final answer instead, and
  its connection closes, the body it announced never asked for.
- Log (`ProtocolLog`): aiohttp logs a malformed request (a header line over 8 KiB, more than 128 headers, bytes
  that are not HTTP) at ERROR with a traceback, once per request: anyone could flood the log. Those become one
  rate-limited WARNING line; a fault of the router's own keeps its ERROR and traceback.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct

from aiohttp import hdrs, web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from yarl import URL

from common.rate_limited_log import RateLimitedLog
from router_service.errors import clipped
from router_service.http_bodies import Reservation
from router_service.http_codings import BodyDecoder, TooManyMembers, compressed_limit
from router_service.openai_errors import ApiError


def decoded_codings(has_brotli: bool, has_zstd: bool) -> tuple[str, ...]:
    """The content codings aiohttp's decoder takes given its optional packages: br with brotli or brotlicffi, zstd
    with the zstd module (Python 3.14's compression.zstd, before it backports.zstd)."""
    return ("gzip", "deflate") + ("br",) * has_brotli + ("zstd",) * has_zstd


# The codings decoded in this process, from the availability aiohttp found at its import. The server takes bodies
# undecoded (auto_decompress off): aiohttp's parser would refuse br or zstd without their package with its own
# plain-text 400 before the middleware runs; read_body decodes them with aiohttp's decompressors instead
DECODED_CODINGS = decoded_codings(HAS_BROTLI, HAS_ZSTD)
DECODE_STEP_BYTES = 64 * 1024  # the most one step of decoding yields: a small body cannot balloon at once
CONTINUED = web.RequestKey("colibri.continued", bool)  # its 100 Continue was sent
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def expects_continue(request: web.Request) -> bool:
    """An HTTP/1.1 request with `Expect: 100-continue` (HTTP/1.0 ones are answered as if without it, as RFC 9110
    asks)."""
    return request.version == HttpVersion11 and request.headers.get(hdrs.EXPECT, "").lower() == "100-continue"


def expectation_problem(request: web.Request) -> str | None:
    """Why the request's Expect header cannot be met (417), or None. An empty one expects nothing (as aiohttp
    took it: clients send `Expect:` to turn 100-continue off)."""
    expect = request.headers.get(hdrs.EXPECT)
    if not expect or request.version != HttpVersion11 or expect.lower() == "100-continue":
        return None
    return f"Expect header: only 100-continue is supported, got {expect[:64]!r}"


# Headers the router acts on that hold one value: sent twice, the router reads the first while a proxy in front
# may have checked or logged the other (a token, a request id).
SINGLE_HEADERS = (hdrs.AUTHORIZATION, "X-Request-Id")


def repeated_header(request: web.Request) -> str | None:
    """Why the request is refused for a SINGLE_HEADERS header sent more than once (400), or None."""
    for name in SINGLE_HEADERS:
        count = len(request.headers.getall(name, []))
        if count > 1:
            return f"{name} header: sent {count} times; a request carries one"
    return None


async def defer_continue(request: web.Request) -> None:
    """The routes' expect handler: answers nothing, so that aiohttp's default does not send 100 Continue before
    the middleware has checked the request (send_continue sends it when the body is read)."""


async def send_continue(request: web.Request) -> None:
    """Sends the request's 100 Continue, once, if it expects one: its body is about to be read."""
    if expects_continue(request) and not request.get(CONTINUED):
        request[CONTINUED] = True
        await request.writer.write(CONTINUE)
        request.writer.output_size = 0  # as aiohttp's default handler does: the answer's own bytes start here


def add_routes(app: web.Application, routes) -> None:
    """(method, path, handler) routes, each GET with its HEAD. Every request reaches a route of these, whose expect
    handler leaves 100 Continue to the body's first read: each path also answers its other methods (405), and
    last routes every other path (404), where aiohttp's own answers would send 100 Continue before the
    middleware runs."""
    for method, path, handler in routes:
        resource = app.router.add_resource(path)
        if method == "GET":
            resource.add_route("HEAD", handler, expect_handler=defer_continue)
        resource.add_route(method, handler, expect_handler=defer_continue)
        resource.add_route("*", _not_allowed, expect_handler=defer_continue)
    app.router.add_route("*", "/{path:.*}", _not_found, expect_handler=defer_continue)
    asterisk = AsteriskResource()
    app.router.register_resource(asterisk)
    asterisk.add_route("*", _not_found, expect_handler=defer_continue)


async def _not_allowed(request: web.Request) -> web.StreamResponse:
    """A known path asked with another method: 405 naming the path's methods."""
    methods = {route.method for route in request.match_info.route.resource or ()} - {"*"}
    raise web.HTTPMethodNotAllowed(request.method, methods)


async def _not_found(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()


class AsteriskResource(web.Resource):
    """The asterisk-form target (`OPTIONS * HTTP/1.1`; aiohttp refuses it with any other method): aiohttp's router
    has no resource that matches it, and its own 404 would send 100 Continue before the middleware runs."""

    @property
    def canonical(self) -> str:
        return "*"  # the router's index key: looked up first for a request to `*`

    def _match(self, path: str) -> dict[str, str] | None:
        return {} if path == "*" else None

    def raw_match(self, path: str) -> bool:
        return path == "*"

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError("the asterisk-form resource takes no prefix")

    def url_for(self) -> URL:  # type: ignore[override]
        return URL("*")

    def get_info(self) -> dict:  # type: ignore[override]
        return {"path": "*"}


def refused_before_continue(request: web.Request) -> bool:
    """True when the request had an Expect header (100-continue, or one refused with 417), never got its 100
    Continue and announced a body: the client may send it or not, so the connection cannot carry another
    request after this answer."""
    expected = request.version == HttpVersion11 and bool(request.headers.get(hdrs.EXPECT))
    return expected and not request.get(CONTINUED) and request.body_exists


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the body is larger than {max_bytes} bytes (max_message_bytes)", code="request_too_large")


def _too_large_compressed(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"the compressed body is larger than {compressed_limit(max_bytes)} bytes, more than any coding makes of "
        f"{max_bytes} (max_message_bytes)",
        code="request_too_large",
    )


# Old names RFC 9110 asks a recipient to take as the coding's (x-compress too, but compress is not decoded here).
OLD_NAMES = {"x-gzip": "gzip"}


def content_encoding(request: web.Request) -> str:
    """The body's one content coding, lower-cased and by its current name ("identity" when none); a 415 ApiError
    naming the codings taken when it is one aiohttp does not decode: aiohttp passes such a body through as it came,
    so a coding it does not know (or a stacked one, "gzip, gzip") would be read as plain JSON, the header ignored."""
    codings = request.headers.getall(hdrs.CONTENT_ENCODING, [])
    coding = ", ".join(codings).strip()
    named = OLD_NAMES.get(coding.lower(), coding.lower()) if coding.isascii() else coding
    # one header only: of two, aiohttp's parser heeds the last and request.headers the first
    if len(codings) <= 1 and named in ("", "identity", *DECODED_CODINGS):
        return named or "identity"
    taken = ", ".join(DECODED_CODINGS)
    raise ApiError(
        415,
        f"Content-Encoding header: {clipped(coding)!r} is not decoded here; send one of {taken}, or none",
        code="unsupported_content_encoding",
        headers={"Accept-Encoding": taken},
    )


def check_transfer_encoding(request: web.Request) -> None:
    """A 400 ApiError for a Transfer-Encoding other than chunked alone: aiohttp takes any list ending in chunked
    ("gzip, chunked") and undoes only the chunking, so the body would be read with its other codings left on."""
    codings = request.headers.getall(hdrs.TRANSFER_ENCODING, [])
    coding = ", ".join(codings).strip()
    if codings and coding.lower() != "chunked":
        raise ApiError(
            400,
            f"Transfer-Encoding header: {clipped(coding)!r} is not decoded here; send chunked alone "
            "(compress with Content-Encoding)",
            code="unsupported_transfer_encoding",
        )


# The media types a browser posts to another site without asking it first (CORS "simple" requests): a web page
# could make its visitors' browsers spend this server's compute, or read its answers after a DNS rebinding, with a
# JSON text labelled as one. No API client needs them: JSON is application/json.
CROSS_SITE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def check_content_type(request: web.Request) -> None:
    """A 415 ApiError for a body labelled with a type a browser sends across sites unasked (CROSS_SITE_TYPES, curl
    -d's among them); no header, application/json and any other type are read as JSON."""
    kind = request.content_type  # aiohttp's parse: lower case, no parameters (application/octet-stream if none)
    if kind in CROSS_SITE_TYPES:
        raise ApiError(
            415,
            f"Content-Type header: {kind!r} is a form type browsers post across sites unasked; "
            "send the body as application/json (curl: -H 'Content-Type: application/json')",
            code="unsupported_media_type",
            headers={"Accept-Post": "application/json"},
        )


async def read_body(request: web.Request, max_bytes: int, timeout_s: float, reservation: Reservation) -> bytearray:
    """The request's body (parse it with http_json.parse_json); raises ApiError (408, 413, 400, and 503 when
    `reservation` cannot grow to hold it). A Content-Length over `max_bytes` is refused before anything is read (a
    compressed one says nothing exact of the decoded body: it is refused past `compressed_limit`), and so is one
    the body budget cannot reserve; a client that expects it gets its 100 Continue only then. A body labelled with
    a form type, or a coding not decoded here, is a 415 before anything is read (a transfer coding besides chunked
    a 400); one that is not whole streams of its coding (corrupt, cut short, empty) is a 400 naming
    Content-Encoding."""
    check_content_type(request)
    check_transfer_encoding(request)
    encoding = content_encoding(request)
    length = request.content_length or 0
    if encoding == "identity" and length > max_bytes:
        raise _too_large(max_bytes)
    if encoding != "identity" and length > compressed_limit(max_bytes):
        raise _too_large_compressed(max_bytes)
    reservation.grow_to(min(length, max_bytes))
    try:
        async with asyncio.timeout(timeout_s):
            await send_continue(request)
            if encoding == "identity":
                return await _read(request, max_bytes, reservation)
            return await _decode(request, encoding, max_bytes, reservation)
    except TimeoutError:
        raise ApiError(
            408, f"the body did not arrive within {timeout_s:g} s (http_body_timeout_s)", code="request_timeout"
        ) from None
    except web.RequestPayloadError as e:  # e.g. a chunked body cut short
        raise ApiError(400, f"the body cannot be read: {_first_line(e)}", code="unreadable_body") from None
    except TooManyMembers as e:
        raise ApiError(400, f"Content-Encoding header: the body holds {e.message}", code="unreadable_body") from None
    except ContentEncodingError:
        raise ApiError(
            400,
            f"Content-Encoding header: the body is not whole {encoding} streams "
            "(corrupt, cut short, empty, or followed by other bytes)",
            code="unreadable_body",
        ) from None


async def _read(request: web.Request, max_bytes: int, reservation: Reservation) -> bytearray:
    """The body's (decoded) bytes, the reservation grown as they arrive past what it holds. Not request.read(),
    which keeps its copy on the request for as long as the handler runs."""
    body = bytearray()
    while chunk := await request.content.readany():
        _take(body, chunk, max_bytes, reservation)
    return body


def _take(body: bytearray, piece: bytes, max_bytes: int, reservation: Reservation) -> None:
    """Appends `piece` to the body read so far: a 413 past `max_bytes`, the reservation grown to hold it first."""
    if len(body) + len(piece) > max_bytes:
        raise _too_large(max_bytes)
    reservation.grow_to(len(body) + len(piece))
    body += piece


async def _decode(request: web.Request, encoding: str, max_bytes: int, reservation: Reservation) -> bytearray:
    """The body decoded from `encoding` (router_service.http_codings), at most `max_bytes` (413 past them), the
    reservation grown as they decode; raises ContentEncodingError for a body that is not whole streams of it."""
    body, decoder = bytearray(), BodyDecoder(encoding, DECODE_STEP_BYTES)
    received, most = 0, compressed_limit(max_bytes)
    while chunk := await request.content.readany():
        received += len(chunk)
        if received > most:  # bytes that decode to little or nothing, sent on and on
            raise _too_large_compressed(max_bytes)
        for piece in decoder.feed(chunk):
            _take(body, piece, max_bytes, reservation)
    decoder.finish()  # a stream cut short (in a gzip trailer too), or an empty body
    return body


def _first_line(error: Exception, limit: int = 160) -> str:
    """aiohttp's message for a client's error without its status prefix and the excerpt it quotes."""
    text = getattr(error, "message", None) or str(error)
    lines = [line.strip() for line in re.sub(r"^\d{3}, message:", "", text.strip()).splitlines() if line.strip()]
    return (lines or [""])[0][:limit]


def abort(request: web.Request) -> None:
    """Closes the connection at once, dropping what is buffered for the client: close() would wait to send it, and
    the kernel would keep sending its own buffer to a client that may never read; a zero linger resets instead."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


async def bounded(request: web.Request, sending, timeout_s: float):
    """Awaits one step of sending an answer (prepare, a write, write_eof); raises ConnectionResetError, the
    connection aborted, when the client does not take it within `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await sending
    except TimeoutError:
        abort(request)
        raise ConnectionResetError("the client stopped reading its answer") from None


async def send(request: web.Request, response: web.StreamResponse, timeout_s: float) -> None:
    """Sends a whole (not yet prepared) answer; a client that does not read it within `timeout_s` is disconnected.
    aiohttp's own sending afterwards finds it sent (or the connection gone, which it takes quietly)."""
    if response.prepared:
        return
    try:
        async with asyncio.timeout(timeout_s):
            await response.prepare(request)
            await response.write_eof()
    except TimeoutError:
        abort(request)
    except ConnectionError:
        pass  # the client went away: aiohttp sees the closed connection


class ProtocolLog(logging.LoggerAdapter):
    """aiohttp's server logger: a client's malformed request is a rate-limited WARNING line naming the problem, a
    client gone mid-answer is DEBUG; everything else (the router's own faults) is logged as aiohttp asks."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        super().__init__(logger, {})
        self._malformed = RateLimitedLog(logger, interval_s)

    def log(self, level, msg, *args, exc_info=None, **kwargs):
        error = exc_info if isinstance(exc_info, BaseException) else None
        if level >= logging.ERROR and isinstance(error, (HttpProcessingError, web.RequestPayloadError)):
            self._malformed.warning("malformed HTTP request: %s", _first_line(error))
        elif level >= logging.ERROR and isinstance(error, ConnectionError):
            self.logger.debug("HTTP client gone mid-answer: %s", error)
        else:
            super().log(level, msg, *args, exc_info=exc_info, **kwargs)
