import io
import json
import logging

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.errors import ConfigError
from common.logging_setup import configure_logging
from common.tracing import get_tracer, make_tracer_provider


@pytest.fixture
def stream():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    yield buf
    for h in list(root.handlers):
        if getattr(h, "_colibri", False):
            root.removeHandler(h)
    root.handlers[:], root.level = saved


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_has_core_keys_and_event_fields(stream):
    configure_logging("router", fmt="json", stream=stream)
    logging.getLogger("router_service.server").info("request %s", "done", extra={"request_id": "r1", "tokens": 3})
    (rec,) = lines(stream)
    assert rec["message"] == "request done"
    assert rec["level"] == "INFO" and rec["logger"] == "router_service.server" and rec["service"] == "router"
    assert rec["request_id"] == "r1" and rec["tokens"] == 3
    assert rec["timestamp"].endswith("Z") and "T" in rec["timestamp"]
    assert "trace_id" not in rec and "span_id" not in rec  # no span: omitted, never zeros


def test_trace_ids_inside_span(stream):
    configure_logging("worker", fmt="json", stream=stream)
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider("worker", SimpleSpanProcessor(exporter))
    with get_tracer(provider).start_as_current_span("decode") as span:
        logging.getLogger("t").warning("slow step")
    ctx = span.get_span_context()
    (rec,) = lines(stream)
    assert rec["trace_id"] == format(ctx.trace_id, "032x")
    assert rec["span_id"] == format(ctx.span_id, "016x")
    assert int(rec["trace_flags"], 16) & 0x01  # sampled (newer SDKs also set the W3C "random" bit)


def test_exception_serialised(stream):
    configure_logging("worker", fmt="json", stream=stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("t").exception("step failed")
    (rec,) = lines(stream)
    assert rec["level"] == "ERROR"
    assert "RuntimeError: boom" in rec["exc_info"] and "Traceback" in rec["exc_info"]


def test_extra_with_reserved_name_is_kept(stream):
    configure_logging("router", fmt="json", stream=stream)
    logging.getLogger("t").info("x", extra={"service": "shadow", "path": object()})
    (rec,) = lines(stream)
    assert rec["service"] == "router" and rec["field.service"] == "shadow"
    assert isinstance(rec["path"], str)  # non-JSON values are stringified, the line survives


def test_text_mode_from_env_and_reconfigure(stream):
    configure_logging("router", fmt="json", stream=stream)
    configure_logging("router", env={"LOG_FORMAT": "text"}, stream=stream)
    assert sum(getattr(h, "_colibri", False) for h in logging.getLogger().handlers) == 1
    logging.getLogger("router_service.x").info("hello", extra={"request_id": "r9", "batch_id": 4})
    text = stream.getvalue().strip()
    assert not text.startswith("{")
    assert "INFO" in text and "hello" in text and "rid=r9" in text and "batch_id=4" in text


def test_level_and_format_validation(stream):
    configure_logging("router", level="warning", fmt="json", stream=stream)
    logging.getLogger("t").info("dropped")
    assert stream.getvalue() == ""
    with pytest.raises(ConfigError, match="LOG_LEVEL"):
        configure_logging("router", level="LOUD", stream=stream)
    with pytest.raises(ConfigError, match="LOG_FORMAT"):
        configure_logging("router", fmt="xml", stream=stream)
