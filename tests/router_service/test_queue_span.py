"""The request span's `queue` child (docs/observability.md): arrival to the first step that carries the
request, or to the request's end when no step ever did."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from common.logging_setup import JsonFormatter
from common.tracing import make_tracer_provider
from tests.router_service.fake_worker import FakeWorker, harness, ids_request


@pytest.fixture
def exporter():
    """The router makes its spans with the global provider, which OpenTelemetry lets a process set once:
    reset it the way its own test utilities do, and put the previous one back after."""
    exporter = InMemorySpanExporter()
    saved = trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER
    trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = Once(), None
    trace.set_tracer_provider(make_tracer_provider("test-router", SimpleSpanProcessor(exporter)))
    yield exporter
    trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = saved


def children(exporter, name: str, parent) -> list:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name == name and s.parent is not None and s.parent.span_id == parent.context.span_id
    ]


def test_queue_span_runs_from_arrival_to_the_first_step(exporter):
    async def main():
        async with harness() as (_, _, stub, _):
            await stub.Generate(ids_request([1], max_new_tokens=3))

    asyncio.run(main())
    request = next(s for s in exporter.get_finished_spans() if s.name.startswith("text_completion"))
    [queue] = children(exporter, "queue", request)
    assert queue.context.trace_id == request.context.trace_id and queue.kind == trace.SpanKind.INTERNAL
    first_step = min(
        (s for s in exporter.get_finished_spans() if s.name in ("prefill", "decode")), key=lambda s: s.start_time
    )
    assert request.start_time <= queue.start_time <= queue.end_time <= first_step.start_time + 1_000_000


def test_queue_span_of_a_request_never_scheduled_ends_with_it(exporter):
    async def main():
        # 64 blocks of 4 tokens: the first request holds 51 of them, so the second waits until its queue timeout.
        async with harness(FakeWorker(num_blocks=64, step_delay=0.01), queue_timeout_s=0.3) as (_, _, stub, _):
            holder = stub.GenerateStream(ids_request([1], max_new_tokens=200))
            await holder.read()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([2], max_new_tokens=200))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            holder.cancel()

    asyncio.run(main())
    request = next(
        s
        for s in exporter.get_finished_spans()
        if s.name.startswith("text_completion") and s.attributes.get("error.type") == "QUEUE_TIMEOUT"
    )
    [queue] = children(exporter, "queue", request)
    assert queue.end_time - queue.start_time >= 0.25e9 and queue.end_time <= request.end_time


class _JsonLines(logging.Handler):
    """Formats each record as it is emitted, as the stderr handler does: the trace fields are the current span's."""

    def __init__(self):
        super().__init__()
        self.setFormatter(JsonFormatter("router"))
        self.lines: list[dict] = []

    def emit(self, record):
        self.lines.append(json.loads(self.format(record)))


@pytest.mark.parametrize("finish", ["ok", "cancelled"])
def test_request_log_line_carries_the_request_spans_trace_id(exporter, finish):
    """The one line a request ends with is in its span's trace, whether the loop ended it (ok) or its own task."""
    handler = _JsonLines()
    logger = logging.getLogger("colibri.router.batching_loop")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)

    async def main():
        async with harness(FakeWorker(step_delay=0.01)) as (_, _, stub, _):
            if finish == "ok":
                await stub.Generate(ids_request([1], max_new_tokens=3))
                return
            stream = stub.GenerateStream(ids_request([1], max_new_tokens=200))
            await stream.read()
            stream.cancel()
            for _ in range(100):
                if any(line["message"] == "request cancelled" for line in handler.lines):
                    return
                await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    request = next(s for s in exporter.get_finished_spans() if s.name.startswith("text_completion"))
    [line] = [line for line in handler.lines if line["message"] == f"request {finish}"]
    assert line["trace_id"] == format(request.context.trace_id, "032x")
    assert line["span_id"] == format(request.context.span_id, "016x")
