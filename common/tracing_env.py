"""The tracing variables the OpenTelemetry SDK and its OTLP/gRPC exporter would take badly, refused at start-up
in one line naming the variable (common/tracing.py calls this before it builds the exporter)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from common.errors import ConfigError

_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")


def check_tracing_env(env: Mapping[str, str] | None = None) -> None:
    """Refuses, naming the variable, the tracing settings the SDK would take badly: an OTLP endpoint urllib cannot
    parse (a traceback at start-up), one with no host, a port out of range or a scheme but http(s), grpc or a gRPC
    target name's (every export failing, one log line each), and a ratio sampler's argument that is no number in [0, 1] (the SDK warns once,
    then samples every trace)."""
    env = os.environ if env is None else env
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if env.get(var):
            _check_endpoint(var, env[var])
            break  # the exporter reads the first one set
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    arg = env.get("OTEL_TRACES_SAMPLER_ARG")
    if sampler in _RATIO_SAMPLERS and arg is not None:
        try:
            ratio = float(arg)
        except ValueError:
            ratio = math.nan
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(
                f"OTEL_TRACES_SAMPLER_ARG: {sampler} takes a ratio in [0, 1], got {arg!r} (the SDK would sample "
                "every trace)"
            )


# gRPC's own target names (unix:///path, dns:///host:port, ipv4:addr:port, ...): the exporter finds no host and
# port in them and hands them to gRPC whole.
_GRPC_TARGET_SCHEMES = ("unix", "unix-abstract", "dns", "ipv4", "ipv6", "vsock")
# The exporter dials the host and port of these (TLS for all but http, unless OTEL_EXPORTER_OTLP_INSECURE is true).
_URL_SCHEMES = ("http", "https", "grpc")


def _check_endpoint(var: str, endpoint: str) -> None:
    text = endpoint.strip()
    if text.split(":", 1)[0].lower() in _GRPC_TARGET_SCHEMES and ":" in text:
        _check_grpc_target(var, endpoint)
        return
    has_scheme = "://" in text
    try:
        parts = urlsplit(text if has_scheme else f"//{text}")
        parts.port  # noqa: B018 -- raises ValueError past 65535
    except ValueError as e:
        raise ConfigError(f"{var}: {endpoint!r} is not a URL ({e})") from None
    if has_scheme and parts.scheme.lower() not in _URL_SCHEMES:
        raise ConfigError(
            f"{var}: {endpoint!r} must be http://, https:// or grpc:// (OTLP over gRPC), or a gRPC target such as "
            "unix:///PATH"
        )
    if text != endpoint or any(c.isspace() for c in text):
        raise ConfigError(f"{var}: {endpoint!r} holds white space (expected e.g. http://otel-collector:4317)")
    if not parts.hostname:
        raise ConfigError(f"{var}: {endpoint!r} names no host (expected e.g. http://otel-collector:4317)")


def _check_grpc_target(var: str, endpoint: str) -> None:
    """A gRPC target name reaches gRPC whole only without an authority: with one (dns://8.8.8.8/host,
    unix://tmp/x) the exporter would dial the authority alone."""
    parts = urlsplit(endpoint)
    if endpoint != endpoint.strip() or any(c.isspace() for c in endpoint):
        raise ConfigError(f"{var}: {endpoint!r} holds white space (expected e.g. unix:///run/otel.sock)")
    if parts.netloc:
        raise ConfigError(
            f"{var}: {endpoint!r} has an authority: the exporter would dial {parts.netloc!r} alone (write "
            f"{parts.scheme}:///TARGET)"
        )
    if not parts.path.strip("/"):
        raise ConfigError(f"{var}: {endpoint!r} names no target (expected e.g. unix:///run/otel.sock)")
