"""Who may call the worker: a shared bearer token in the `authorization` metadata of every call.

The router sends `authorization: Bearer TOKEN`; a server interceptor compares it (in constant time) with the
accepted tokens before the request body is even parsed. The tokens come from `--auth-token-file` (one per
line, so a rotation can accept the old and the new one; the file is re-read when it changes) or from the
environment variable COLIBRI_WORKER_TOKEN (one token; `colibri serve` puts a fresh random one there for both
of its processes). Secrets never travel in argv. Health and reflection are exempt: probes carry no token.
docs/security.md describes the whole model.
"""
from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from pathlib import Path

import grpc

from common.errors import ConfigError

log = logging.getLogger("colibri.worker")
TOKEN_ENV = "COLIBRI_WORKER_TOKEN"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
RELOAD_CHECK_S = 1.0
MAX_TOKEN_FILE_BYTES = 64 * 1024


def _read_token_file(path: Path) -> tuple[bytes, ...]:
    """The file's tokens (one per line; blank lines and `#` comments skipped)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"auth_token_file: cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(f"auth_token_file: {path} is larger than {MAX_TOKEN_FILE_BYTES} bytes")
    lines = (line.strip() for line in data.splitlines())
    tokens = tuple(line for line in lines if line and not line.startswith(b"#"))
    if not tokens:
        raise ConfigError(f"auth_token_file: {path} holds no token")
    return tokens


class TokenSet:
    """The accepted tokens; empty when the worker runs unauthenticated."""

    def __init__(self, path: str = "", env_token: str = ""):
        self.path = Path(path) if path else None
        self._env = (env_token.strip().encode(),) if env_token.strip() else ()
        self._lock = threading.Lock()
        self._file: tuple[bytes, ...] = ()
        self._stamp = None
        self._checked = 0.0
        if self.path is not None:
            self._file, self._stamp = _read_token_file(self.path), self._stat()

    @classmethod
    def from_settings(cls, auth_token_file: str, environ=os.environ) -> TokenSet:
        return cls(auth_token_file, environ.get(TOKEN_ENV, ""))

    def __bool__(self) -> bool:
        return bool(self._env or self._file)

    def _stat(self):
        try:
            st = os.stat(self.path)     # follows the symlinks a Kubernetes Secret volume swaps on update
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._checked < RELOAD_CHECK_S:
            return
        with self._lock:
            self._checked = now
            stamp = self._stat()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                self._file = _read_token_file(self.path)
                log.info("reloaded the worker token file %s", self.path, extra={"tokens": len(self._file)})
            except ConfigError as e:   # mid-rotation or removed: keep what was accepted so far
                log.warning("%s; keeping the tokens read before", e)

    def accepts(self, presented: bytes) -> bool:
        self._reload_if_changed()
        ok = False
        for token in self._env + self._file:      # no early exit: the time taken does not tell which matched
            ok |= hmac.compare_digest(presented, token)
        return ok


def _bearer(metadata) -> bytes:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.encode() if isinstance(value, str) else bytes(value)
            scheme, _, token = text.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


def _refusals():
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")

    async def refuse_stream(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")
    return refuse, refuse_stream


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without an accepted token (UNAUTHENTICATED), before its body is parsed."""

    def __init__(self, tokens: TokenSet):
        self.tokens = tokens

    async def intercept_service(self, continuation, details):
        if details.method.startswith(EXEMPT_PREFIXES) or self.tokens.accepts(_bearer(details.invocation_metadata)):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        refuse, refuse_stream = _refusals()
        # No request deserializer: an unauthenticated caller's bytes are never parsed.
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse_stream)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
