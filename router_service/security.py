"""What the public port trusts: TLS (optionally mutual) with certificates re-read when their files change, and
bearer tokens from the environment or from a file re-read when it changes. Also the token the router sends to
the worker. docs/security.md describes the model.

Files are watched by `os.stat` of the resolved path (inode, size, mtime): Kubernetes updates a mounted Secret by
swapping a `..data` symlink, which changes the inode of every file at once. A file that vanished or does not
parse keeps the previous value, with one warning per change.
"""
from __future__ import annotations

import hmac
import logging
import os
import ssl
import threading
import time
from pathlib import Path

import grpc

from common.errors import ConfigError
from router_service import errors

log = logging.getLogger("colibri.router.security")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
RECHECK_S = 1.0  # files are stat'ed at most this often


def _stamp(path: str) -> tuple | None:
    try:
        st = os.stat(path)  # follows symlinks: a `..data` swap changes the inode
    except OSError:
        return None
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns


class WatchedFiles:
    """Reads a set of files through `parse` (bytes per file -> value) and again whenever one of them changed."""

    def __init__(self, paths: list[str], parse, what: str):
        self.paths, self._parse, self.what = paths, parse, what
        self._lock = threading.Lock()  # the TLS fetcher runs on gRPC's threads
        self._stamps = [_stamp(p) for p in paths]
        self._checked = time.monotonic()
        missing = [p for p, s in zip(paths, self._stamps) if s is None]
        if missing:
            raise ConfigError(f"{what}: cannot read {missing[0]}")
        try:
            self.value = parse([Path(p).read_bytes() for p in paths])
        except (OSError, ValueError) as e:
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
                value = self._parse([Path(p).read_bytes() for p in self.paths])
            except (OSError, ValueError) as e:
                log.warning("%s: keeping the previous value: %s", self.what, e)
                return self.value
            self.value, self.version = value, self.version + 1
            log.info("%s: reloaded %s", self.what, ", ".join(self.paths))
            return self.value


def _tokens(contents: list[bytes]) -> tuple[bytes, ...]:
    lines = contents[0].decode("utf-8", "replace").splitlines()
    tokens = tuple(t.encode() for t in (line.strip() for line in lines) if t and not t.startswith("#"))
    if not tokens:
        raise ValueError("no token in the file (one per line)")
    return tokens


class TokenSet:
    """Accepted bearer tokens: a fixed one (environment/config) and those of a watched file."""

    def __init__(self, token: str = "", token_file: str = ""):
        self._fixed = (token.encode(),) if token else ()
        self._file = WatchedFiles([token_file], _tokens, "auth_token_file") if token_file else None

    @property
    def enabled(self) -> bool:
        return bool(self._fixed or self._file)

    def accepts(self, authorization: str | bytes) -> bool:
        """`authorization` metadata (`Bearer TOKEN`) against every token, in constant time per token."""
        given = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
        scheme, _, token = given.partition(b" ")
        ok = scheme.lower() == b"bearer"
        match = False
        for expected in self._fixed + (self._file.current() if self._file else ()):
            match |= hmac.compare_digest(token, expected)
        return ok and match


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer TOKEN` on every RPC except grpc.health.v1 (probes carry no token)."""

    def __init__(self, tokens: TokenSet):
        self._tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if self._tokens.accepts(given):
            return handler
        return _deny(handler)


def _deny(handler):
    status = errors.to_status(errors.Unauthenticated("missing or wrong bearer token (authorization metadata)"))

    async def unary(request, context):
        await context.abort(status.code, status.details, status.trailing_metadata)

    async def streaming(request, context):
        await context.abort(status.code, status.details, status.trailing_metadata)
        yield  # makes this an async generator, as streaming handlers are

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)


# ---- TLS ----
def _check_pair(cert: bytes, key: bytes) -> None:
    """Raises ValueError unless `key` is the private key of `cert` (both PEM): a rotation caught half-way
    (new certificate, old key) is not served. The key goes through anonymous memory files, never the disk."""
    fds = [os.memfd_create(name) for name in ("cert", "key")]
    try:
        for fd, data in zip(fds, (cert, key)):
            os.write(fd, data)
        cert_path, key_path = (f"/proc/self/fd/{fd}" for fd in fds)
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as e:
        raise ValueError(f"the certificate and key do not form a pair ({e.reason or e})") from None
    finally:
        for fd in fds:
            os.close(fd)


def _tls_material(contents: list[bytes]):
    cert, key, *ca = contents
    if b"-----BEGIN" not in cert or b"-----BEGIN" not in key:
        raise ValueError("the certificate and key files must be PEM")
    _check_pair(cert, key)
    if ca and b"-----BEGIN CERTIFICATE" not in ca[0]:
        raise ValueError("the client CA file must hold PEM certificates")
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca[0] if ca else None)


class ReloadingServerCredentials:
    """TLS credentials for the public port; gRPC asks `fetch` at every handshake, which answers a new
    configuration once the files changed (None = keep the current one)."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = ""):
        paths = [cert_file, key_file] + ([client_ca_file] if client_ca_file else [])
        self._files = WatchedFiles(paths, _tls_material, "tls")
        self._served = self._files.version
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._files.value, self.fetch, require_client_authentication=bool(client_ca_file))

    def fetch(self):
        try:
            value = self._files.current()
        except Exception:  # never let a reload problem break handshakes
            log.exception("tls: reloading the certificate failed")
            return None
        if self._files.version == self._served:
            return None
        self._served = self._files.version
        return value


def server_credentials(config) -> ReloadingServerCredentials | None:
    if not config.tls_cert_file:
        return None
    return ReloadingServerCredentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)


def worker_token_source(config):
    """A callable giving the current token for router -> worker calls ("" = none): the file's first token
    (re-read when it changes) or COLIBRI_WORKER_TOKEN."""
    if config.worker_token_file:
        watched = WatchedFiles([config.worker_token_file], _tokens, "worker_token_file")
        return lambda: watched.current()[0].decode()
    return lambda: config.worker_token
