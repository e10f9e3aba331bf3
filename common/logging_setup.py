"""Process-wide logging: one JSON object per line on stderr (or a human text format), shared by both services.

Every record carries ``timestamp`` (RFC 3339, UTC, ms), ``level``, ``message``, ``logger``, ``service``,
``request_id`` (when passed in ``extra=``), ``trace_id`` / ``span_id`` / ``trace_flags`` (when an OpenTelemetry span is
current; lowercase W3C hex, as in the OTel "trace context in non-OTLP logs" spec), ``exc_info`` (the
formatted traceback, when an exception is attached) and any event fields passed with ``extra=``::

    log.info("request finished", extra={"request_id": rid, "outcome": "ok", "generated_tokens": 17})

Privacy: callers must never log prompt or completion text, token ids of a prompt, or anything derived
from them. Log lengths and counts instead. This module does not (and cannot) filter message text.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import sys
import traceback
from collections.abc import Mapping
from typing import IO, Any

from opentelemetry import trace

from common.errors import ConfigError

LOG_FORMATS = ("json", "text")

# Attributes every LogRecord has; anything else on a record came from `extra=` and is an event field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
# Keys the formatter owns; an `extra=` field with one of these names is renamed rather than lost.
_OWN_KEYS = frozenset(
    {
        "timestamp",
        "level",
        "message",
        "logger",
        "service",
        "request_id",
        "trace_id",
        "span_id",
        "trace_flags",
        "exc_info",
        "stack_info",
    }
)


def _timestamp(created: float) -> str:
    ts = _dt.datetime.fromtimestamp(created, tz=_dt.UTC)
    return ts.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _trace_fields() -> dict[str, str]:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}  # omitted, never "0" (OTel logging trace-context spec)
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "trace_flags": format(ctx.trace_flags, "02x"),
    }


def _event_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = {}
    for key, value in vars(record).items():
        if key in _RECORD_ATTRS or key == "request_id" or key.startswith("_"):
            continue
        fields[f"field.{key}" if key in _OWN_KEYS else key] = value
    return fields


def _request_id(record: logging.LogRecord) -> str | None:
    rid = getattr(record, "request_id", None)
    return str(rid) if rid is not None else None


class JsonFormatter(logging.Formatter):
    """One JSON object per record, keys in a fixed order (core keys first, then event fields)."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "timestamp": _timestamp(record.created),
            "level": record.levelname,
            "message": record.getMessage(),
            "logger": record.name,
            "service": self.service,
        }
        rid = _request_id(record)
        if rid is not None:
            out["request_id"] = rid
        out.update(_trace_fields())
        out.update(_event_fields(record))
        if record.exc_info:
            out["exc_info"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = record.stack_info
        # default=str: an odd event value (Path, enum, numpy scalar) must not drop the whole line.
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`2026-01-02T03:04:05.678Z INFO  router_service.server [rid=ab12 trace=..] message key=value ...`"""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        tags = []
        rid = _request_id(record)
        if rid is not None:
            tags.append(f"rid={rid}")
        ids = _trace_fields()
        if ids:
            tags.append(f"trace={ids['trace_id']} span={ids['span_id']}")
        line = f"{_timestamp(record.created)} {record.levelname:<7} {self.service} {record.name}"
        if tags:
            line += f" [{' '.join(tags)}]"
        line += f" {record.getMessage()}"
        fields = _event_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        if record.stack_info:
            line += "\n" + record.stack_info
        return line


class _ColibriHandler(logging.StreamHandler):
    _colibri = True  # marks the handler as ours so a second configure_logging call can replace it


def _parse_level(level: str | int, setting: str = "LOG_LEVEL") -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ConfigError(f"{setting}: unknown level {level!r} (expected DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return value


def configure_logging(
    service: str,
    level: str | int = "INFO",
    fmt: str | None = None,
    *,
    stream: IO[str] | None = None,
    env: Mapping[str, str] | None = None,
    level_name: str = "LOG_LEVEL",
) -> logging.Handler:
    """Routes every logger through one handler on the root logger and returns that handler.

    `fmt` is "json" or "text"; None reads LOG_FORMAT (default json: what containers and log shippers
    want). Calling it again replaces the handler it installed before (tests, CLI re-configuration) and
    leaves handlers installed by others (pytest's capture) alone. `stream` defaults to sys.stderr.
    """
    env = os.environ if env is None else env
    fmt = (fmt or env.get("LOG_FORMAT") or "json").strip().lower()
    if fmt not in LOG_FORMATS:
        raise ConfigError(f"LOG_FORMAT: unknown format {fmt!r} (expected json or text)")
    handler = _ColibriHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_colibri", False)]:
        root.removeHandler(old)
        old.close()  # a StreamHandler flushes on close but never closes its stream
    root.addHandler(handler)
    root.setLevel(_parse_level(level, level_name))  # level_name: where the level came from, for the error
    # grpc and urllib3 are chatty at DEBUG; their noise would bury ours.
    for name in ("grpc", "urllib3"):
        logging.getLogger(name).setLevel(max(root.level, logging.INFO))
    # Numba's CUDA driver logs every allocation and free at INFO once any handler exists; as in a process without
    # logging configured, it speaks below WARNING only when NUMBA_CUDA_LOG_LEVEL asks it to.
    numba_level = env.get("NUMBA_CUDA_LOG_LEVEL", "").strip()
    logging.getLogger("numba").setLevel(
        _parse_level(numba_level, "NUMBA_CUDA_LOG_LEVEL") if numba_level else max(root.level, logging.WARNING)
    )
    # A library's warnings become records in this format (logger py.warnings), not raw lines between them.
    logging.captureWarnings(True)
    return handler
