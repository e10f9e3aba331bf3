"""Who may call a gRPC port: bearer tokens, shared by the router's public port and the worker's port.

Callers send `authorization: Bearer TOKEN`. The accepted tokens come from a file (one per line, blank lines and
`#` comments skipped, so a rotation can accept the old and the new one) re-read when it changes, and/or one
fixed token (from the environment or the config). Each presented token is compared with every accepted one in
constant time. `BearerAuthInterceptor` refuses a call without an accepted token before its body is parsed:
an unauthenticated caller's bytes never reach a protobuf parser. docs/security.md describes the whole model.

Files are watched by `os.stat` of the resolved path (inode, device, size, mtime): Kubernetes updates a mounted
Secret by swapping a `..data` symlink, which changes the inode of every file at once. A file that vanished or
does not parse keeps the previous value, with one warning per change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import logging
import os
import stat
import threading
import time

import grpc

from common.errors import ConfigError
from common.files import read_regular

log = logging.getLogger("colibri.auth")
WORKER_TOKEN_ENV = "COLIBRI_WORKER_TOKEN"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
RECHECK_S = 1.0  # watched files are stat'ed at most this often
MAX_TOKEN_FILE_BYTES = 64 * 1024
# Callers without a token must not fill the concurrent-call limit through the exempt methods: a unary request
# (health's Check and Watch) must arrive within EXEMPT_REQUEST_TIMEOUT_S, and at most EXEMPT_STREAMS_MAX of their
# streams (health Watch, reflection) are open at once (a client-side health check holds one per connection).
EXEMPT_REQUEST_TIMEOUT_S = 10.0
EXEMPT_STREAMS_MAX = 8


def _stamp(path: str) -> tuple | None:
    try:
        st = os.stat(path)  # follows symlinks: a `..data` swap changes the inode
    except OSError:
        return None
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns


def _read(path: str, max_bytes: int | None) -> bytes:
    data = read_regular(path, max_bytes)
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes")
    return data


class WatchedFiles:
    """Reads a set of files through `parse` (bytes per file -> value) and again whenever one of them changed."""

    def __init__(self, paths: list[str], parse, what: str, max_bytes: int | None = None):
        self.paths, self._parse, self.what, self._max_bytes = paths, parse, what, max_bytes
        self._lock = threading.Lock()  # the TLS fetcher runs on gRPC's threads
        self._stamps = [_stamp(p) for p in paths]
        self._checked = time.monotonic()
        try:
            contents = []
            for path in paths:
                try:
                    contents.append(_read(path, max_bytes))
                except OSError as e:
                    raise ConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
            self.value = parse(contents)
        except ValueError as e:
            raise ConfigError(f"{what}: {e}") from None
        self.version = 0

    def current(self):
        """The value, re-read first if a file changed (checked at most every RECHECK_S seconds)."""
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return self.value
        with self._lock:
            self._checked = now
            stamps = [_stamp(p) for p in self.paths]
            if stamps == self._stamps:
                return self.value
            self._stamps = stamps
            try:
                if None in stamps:
                    raise ValueError(f"{self.paths[stamps.index(None)]} is missing")
                value = self._parse([_read(p, self._max_bytes) for p in self.paths])
            except (OSError, ValueError) as e:  # mid-rotation or removed: keep what was accepted so far
                log.warning("%s: keeping the previous value: %s", self.what, e)
                return self.value
            self.value, self.version = value, self.version + 1
            log.info("%s: reloaded %s", self.what, ", ".join(self.paths))
            return self.value


def token_lines(path: str):
    """A WatchedFiles parser: the tokens of the file at `path`, one per line (blank lines and `#` comments
    skipped); ValueError when it holds none."""

    def parse(contents: list[bytes]) -> tuple[bytes, ...]:
        lines = [line.strip() for line in contents[0].removeprefix(b"\xef\xbb\xbf").splitlines()]  # BOM: editors
        tokens = tuple((n, line) for n, line in enumerate(lines, 1) if line and not line.startswith(b"#"))
        if not tokens:
            raise ValueError(f"{path} holds no token (one per line)")
        for n, token in tokens:  # a token gRPC cannot send would fail every call (or never match) at run time
            check_sendable(token, f"{path}, line {n}")
        return tuple(token for _, token in tokens)

    return parse


def check_sendable(token: bytes, what: str) -> None:
    """Raises ValueError unless `token` can travel as `authorization: Bearer TOKEN` gRPC metadata, which carries
    printable ASCII only: gRPC refuses any other byte only as the call starts (`INTERNAL: Invalid metadata`)."""
    bad = next((i for i, byte in enumerate(token) if not 0x20 <= byte <= 0x7E), None)
    if bad is not None:  # the token is a secret: its position and byte are told, never the token
        raise ValueError(
            f"{what}: byte 0x{token[bad]:02x} at position {bad} of the token; a bearer token is printable ASCII"
        )


def fixed_token(token: str, what: str) -> bytes:
    """`token` (from the environment or a config file) without the whitespace around it; a ConfigError naming
    `what` (never the token) unless gRPC metadata can carry it."""
    data = token.strip().encode("utf-8", "surrogateescape")
    try:
        check_sendable(data, what)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return data


def warn_if_every_user_reads(path: str, what: str) -> None:
    """Logs a warning when any local user may read the secret file at `path` (mode o+r): they could call as its
    holder. Not refused: the file may be meant so (a single-user host), and the operator decides."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # reading it reports the problem
        return
    if mode & stat.S_IROTH:
        log.warning("%s: %s is readable by every user (mode 0%o); chmod o-r it", what, path, stat.S_IMODE(mode))


class TokenSet:
    """The accepted bearer tokens: one fixed token and those of a watched file; empty = no authentication.
    `token_name` names where the fixed token came from in the error refusing it."""

    def __init__(self, token_file: str = "", token: str = "", token_name: str = "token"):
        self._fixed = (fixed_token(token, token_name),) if token.strip() else ()
        self._file = (
            WatchedFiles([token_file], token_lines(token_file), "auth_token_file", MAX_TOKEN_FILE_BYTES)
            if token_file
            else None
        )
        if token_file:
            warn_if_every_user_reads(token_file, "auth_token_file")

    @property
    def enabled(self) -> bool:
        return bool(self._fixed or self._file)

    def __bool__(self) -> bool:
        return self.enabled

    def accepts(self, authorization: str | bytes) -> bool:
        """`authorization` metadata or header (`Bearer TOKEN`) against every token, in constant time per token."""
        given = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
        scheme, _, token = given.partition(b" ")
        match = False
        for expected in self._fixed + (self._file.current() if self._file else ()):
            match |= hmac.compare_digest(token.strip(), expected)  # no early exit: the time says nothing
        return scheme.lower() == b"bearer" and match


def authorization(metadata) -> str | bytes:
    """The first `authorization` value of a call's metadata ("" when there is none)."""
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return ""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The status an unauthenticated call ends with (a service may map it through its own error contract)."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple = ()


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without an accepted token with `refusal`, at once: before its body is parsed, or even
    received. Methods under `exempt` (health: probes carry no token) pass without one, their request bounded in
    time (EXEMPT_REQUEST_TIMEOUT_S) and their streams (health Watch, reflection) in number (EXEMPT_STREAMS_MAX), so
    that callers without a token cannot fill the server's concurrent-call limit. Install it first, so that no
    other interceptor sees the call."""

    def __init__(self, tokens: TokenSet, refusal: Refusal, exempt: tuple[str, ...] = (HEALTH_PREFIX,)):
        self.tokens, self.refusal, self.exempt = tokens, refusal, exempt
        self.open_exempt_streams = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if self.tokens.accepts(authorization(handler_call_details.invocation_metadata)):
            return handler
        if handler_call_details.method.startswith(self.exempt):
            return self._bounded(_request_in_time(handler, EXEMPT_REQUEST_TIMEOUT_S))
        return _refusing(handler, self.refusal)

    def _bounded(self, handler):
        """A stream-stream `handler` (an exempt stream) holding one of EXEMPT_STREAMS_MAX places while it runs;
        past them RESOURCE_EXHAUSTED at once. Others as they are."""
        if not (handler.request_streaming and handler.response_streaming):
            return handler

        async def stream(requests, context):
            if self.open_exempt_streams >= EXEMPT_STREAMS_MAX:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{EXEMPT_STREAMS_MAX} health or reflection streams without a token are open; send the token, "
                    "or watch the health port",
                )
            self.open_exempt_streams += 1
            try:
                async for response in _relay(handler.stream_stream(requests, context)):
                    yield response
            finally:
                self.open_exempt_streams -= 1

        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        return grpc.stream_stream_rpc_method_handler(stream, **kwargs)


async def _relay(responses):
    """The responses of a streaming handler's result: an async or plain iterator, or (a handler that writes with
    context.write) an awaitable whose end ends the stream."""
    if inspect.isawaitable(responses):
        await responses
        return
    if hasattr(responses, "__aiter__"):
        async for response in responses:
            yield response
    else:
        for response in responses or ():
            yield response


def _refusing(handler, refusal: Refusal):
    """A handler that ends the call with `refusal`. It reads requests as a stream whatever the method's shape, so
    gRPC runs it as soon as the headers arrive (a unary-request handler waits for the request: a caller holding
    it back would keep a place of the concurrent-call limit), and it has no request deserializer: an
    unauthenticated caller's bytes are never parsed."""

    async def refuse(request_iterator, context):
        await context.abort(refusal.code, refusal.details, refusal.trailing_metadata)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)


def _request_in_time(handler, timeout_s: float):
    """`handler` with its unary request read as a stream that must deliver it within timeout_s (else the call
    ends DEADLINE_EXCEEDED; INVALID_ARGUMENT when it ends with none); request-streaming handlers as they are."""
    if handler.request_streaming:
        return handler

    async def first_request(requests, context):
        try:
            return await asyncio.wait_for(anext(requests), timeout_s)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request did not arrive within {timeout_s:g} s")
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.response_streaming:

        async def stream(requests, context):
            async for response in _relay(handler.unary_stream(await first_request(requests, context), context)):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream, **kwargs)

    async def unary(requests, context):
        response = handler.unary_unary(await first_request(requests, context), context)
        return await response if inspect.isawaitable(response) else response

    return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
