import io
import json
import logging
import warnings

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.errors import ConfigError
from common.logging_setup import configure_logging
from common.tracing import get_tracer, make_tracer_provider


@pytest.fixture
def stream():
    root, numba = logging.getLogger(), logging.getLogger("numba")
    saved = (list(root.handlers), root.level, numba.level)
    buf = io.StringIO()
    yield buf
    for h in list(root.handlers):
        if getattr(h, "_colibri", False):
            root.removeHandler(h)
    root.handlers[:], root.level, numba.level = saved
    logging.captureWarnings(False)


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


def test_numba_driver_speaks_only_when_asked(stream):
    """Numba's CUDA driver logs each allocation and free at INFO once a handler exists (a served cuda worker
    wrote ~200 such lines by shutdown): quiet below WARNING unless NUMBA_CUDA_LOG_LEVEL asks for it."""
    driver = logging.getLogger("numba.cuda.cudadrv.driver")
    configure_logging("colibri-worker", fmt="json", stream=stream, env={})
    driver.info("dealloc: cuMemFree 4096 bytes")
    driver.warning("context lost")
    assert [(r["logger"], r["message"]) for r in lines(stream)] == [(driver.name, "context lost")]
    configure_logging("colibri-worker", fmt="json", stream=stream, env={"NUMBA_CUDA_LOG_LEVEL": "debug"})
    driver.debug("add pending dealloc")
    assert lines(stream)[-1]["message"] == "add pending dealloc"
    with pytest.raises(ConfigError, match="NUMBA_CUDA_LOG_LEVEL: unknown level 'chatty'"):
        configure_logging("colibri-worker", stream=stream, env={"NUMBA_CUDA_LOG_LEVEL": "chatty"})


def test_a_library_warning_is_one_record(stream):
    """A warnings.warn in a library (numba's performance hints, a deprecation) is one JSON line of the format,
    not raw text between the lines a log shipper parses."""
    configure_logging("colibri-worker", fmt="json", stream=stream, env={})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("this call is deprecated", DeprecationWarning, stacklevel=1)
    (record,) = lines(stream)
    assert record["logger"] == "py.warnings" and record["level"] == "WARNING"
    assert "DeprecationWarning: this call is deprecated" in record["message"]
