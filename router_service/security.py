"""What the public port trusts: TLS (optionally mutual) with certificates re-read when their files change, and
bearer tokens (common/auth.py, shared with the worker) answered in the router's error contract. Also the token
the router sends to the worker. docs/security.md describes the model.
"""

from __future__ import annotations

import logging

import grpc

from common.auth import (
    BearerAuthInterceptor,
    Refusal,
    TokenSet,
    WatchedFiles,
    fixed_token,
    token_lines,
    warn_if_every_user_reads,
)
from common.tls_files import check_certificates, check_pair
from router_service import errors
from router_service.protocol import decode_guard

log = logging.getLogger("colibri.router.security")


def _refusal() -> Refusal:
    status = errors.to_status(errors.Unauthenticated("missing or wrong bearer token (authorization metadata)"))
    return Refusal(status.code, status.details, status.trailing_metadata)


def public_tokens(config) -> TokenSet:
    """The tokens the public ports (gRPC and HTTP) accept: `auth_token_file`'s and `auth_token`."""
    return TokenSet(config.auth_token_file, config.auth_token, "auth_token (COLIBRI_AUTH_TOKEN, API_KEY)")


def public_interceptors(tokens: TokenSet) -> list[grpc.aio.ServerInterceptor]:
    """The public port's interceptors. Auth first: an unauthenticated caller's bytes are never parsed, so it
    learns nothing, not even whether they decoded."""
    auth = [BearerAuthInterceptor(tokens, _refusal())] if tokens.enabled else []
    return [*auth, decode_guard()]


# ---- TLS ----
def _tls_material(cert_file: str, key_file: str, client_ca_file: str):
    """The WatchedFiles parser of the TLS files; each refusal names the settings and files it is about."""

    def parse(contents: list[bytes]):
        cert, key, *ca = contents
        try:
            check_pair(cert, key)
        except ValueError as e:
            raise ValueError(f"tls_cert_file {cert_file}, tls_key_file {key_file}: {e}") from None
        if ca:
            check_certificates(ca[0], f"tls_client_ca_file {client_ca_file}")
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca[0] if ca else None)

    return parse


class ReloadingServerCredentials:
    """TLS credentials for the public port; gRPC asks `fetch` at every handshake, which answers a new
    configuration once the files changed (None = keep the current one)."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = ""):
        paths = [cert_file, key_file] + ([client_ca_file] if client_ca_file else [])
        self._files = WatchedFiles(paths, _tls_material(cert_file, key_file, client_ca_file), "tls")
        self._served = self._files.version
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._files.value, self.fetch, require_client_authentication=bool(client_ca_file)
        )

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
        path = config.worker_token_file
        watched = WatchedFiles([path], token_lines(path), "worker_token_file")
        warn_if_every_user_reads(path, "worker_token_file")
        return lambda: watched.current()[0].decode()
    token = fixed_token(config.worker_token, "worker_token (COLIBRI_WORKER_TOKEN)").decode("ascii")
    return lambda: token
