import asyncio
import logging

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from common import tracing
from common.tracing import (
    ServerTracingInterceptor,
    configure_tracing,
    extract_context,
    get_tracer,
    inject_metadata,
    links_from_contexts,
    make_tracer_provider,
    otlp_span_processor,
    start_server_span,
)
from tests.grpc_teardown import served

SERVICE = "test.Worker"


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def router_provider(exporter):
    return make_tracer_provider("colibri-router", SimpleSpanProcessor(exporter), env={})


@pytest.fixture
def worker_provider(exporter):
    return make_tracer_provider("colibri-worker", SimpleSpanProcessor(exporter), env={})


async def serve_and_call(handlers: dict, call, interceptors=()):
    """Starts a loopback grpc.aio server with `handlers` (method -> handler), runs `call(channel)`."""
    server = grpc.aio.server(interceptors=list(interceptors))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    async with served(server, grace=None) as port, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await call(channel)


def by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_worker_span_is_child_of_router_step_span(exporter, router_provider, worker_provider):
    async def step(request, context):
        with start_server_span(
            "worker.decode", context.invocation_metadata(), {"colibri.batch.size": 2}, tracer_provider=worker_provider
        ):
            return b"ok"

    async def router(channel):
        tracer = get_tracer(router_provider)
        requests = [
            tracer.start_span(
                tracing.request_span_name("tiny"),
                kind=SpanKind.SERVER,
                attributes={tracing.GEN_AI_REQUEST_MODEL: "tiny"},
            )
            for _ in range(2)
        ]
        with tracer.start_as_current_span("decode", kind=SpanKind.CLIENT, links=links_from_contexts(requests)):
            reply = await channel.unary_unary(f"/{SERVICE}/Decode")(b"step", metadata=inject_metadata())
        for span in requests:
            span.end()
        return reply

    assert asyncio.run(serve_and_call({"Decode": grpc.unary_unary_rpc_method_handler(step)}, router)) == b"ok"
    spans = by_name(exporter)
    router_step, worker_step = spans["decode"], spans["worker.decode"]
    assert worker_step.context.trace_id == router_step.context.trace_id
    assert worker_step.parent is not None and worker_step.parent.is_remote
    assert worker_step.parent.span_id == router_step.context.span_id
    assert worker_step.kind == SpanKind.SERVER and worker_step.attributes["colibri.batch.size"] == 2
    assert worker_step.resource.attributes["service.name"] == "colibri-worker"
    # The batch step links to both member requests (each its own trace).
    members = [s for s in exporter.get_finished_spans() if s.name == "text_completion tiny"]
    assert {link.context.span_id for link in router_step.links} == {s.context.span_id for s in members}


def test_interceptor_traces_unary_and_stream_rpcs(exporter, router_provider, worker_provider):
    async def prefill(request, context):
        return b"done"

    async def stream(request, context):
        for i in range(3):
            yield bytes([i])

    async def bad(request, context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be >= 1")

    async def broken(request, context):
        try:
            raise ValueError("prompt token id 987654321")  # a request's value, chained under the failure
        except ValueError:
            raise RuntimeError("CUDA error")  # noqa: B904 (the chaining is the point)

    handlers = {
        "Prefill": grpc.unary_unary_rpc_method_handler(prefill),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Bad": grpc.unary_unary_rpc_method_handler(bad),
        "Broken": grpc.unary_unary_rpc_method_handler(broken),
    }

    async def client(channel):
        with get_tracer(router_provider).start_as_current_span("prefill", kind=SpanKind.CLIENT):
            md = inject_metadata()
            assert await channel.unary_unary(f"/{SERVICE}/Prefill")(b"x", metadata=md) == b"done"
            chunks = [c async for c in channel.unary_stream(f"/{SERVICE}/Stream")(b"x", metadata=md)]
            assert chunks == [b"\x00", b"\x01", b"\x02"]
            for method, code in (("Bad", grpc.StatusCode.INVALID_ARGUMENT), ("Broken", grpc.StatusCode.UNKNOWN)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary(f"/{SERVICE}/{method}")(b"x", metadata=md)
                assert err.value.code() == code

    asyncio.run(serve_and_call(handlers, client, [ServerTracingInterceptor(worker_provider)]))
    spans = by_name(exporter)
    parent = spans["prefill"].context
    for method in ("Prefill", "Stream", "Bad", "Broken"):
        span = spans[f"{SERVICE}/{method}"]
        assert span.parent.span_id == parent.span_id and span.context.trace_id == parent.trace_id
        assert span.attributes["rpc.system"] == "grpc" and span.attributes["rpc.method"] == method
    assert spans[f"{SERVICE}/Prefill"].attributes["rpc.grpc.status_code"] == 0
    # A client's bad input is not a server fault; an unhandled exception is.
    assert spans[f"{SERVICE}/Bad"].attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert spans[f"{SERVICE}/Bad"].status.status_code != StatusCode.ERROR
    assert spans[f"{SERVICE}/Broken"].status.status_code == StatusCode.ERROR
    # No exception text leaves the process with a span: it can quote the request
    events = [(e.name, dict(e.attributes or {})) for span in spans.values() for e in span.events]
    assert "987654321" not in repr(events) and "max_new_tokens" not in repr(events)


def test_extracting_malformed_trace_headers_logs_at_most_one_line_an_interval(caplog, monkeypatch):
    """OpenTelemetry logs a WARNING for each malformed header it reads; a client sends them at will."""
    monkeypatch.setattr(tracing, "MALFORMED_HEADER_LOG", tracing.RateLimitedLog(tracing.logger))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for _ in range(50):
        context = extract_context([("traceparent", parent), ("tracestate", "a=b,!!!"), ("baggage", "k=v,novalue")])
        assert trace.get_current_span(context).get_span_context().trace_id == 0x0AF7651916CD43DD8448EB211C80319C
        extract_context([("traceparent", "0" * 600)])
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].name == "common.tracing", [r.getMessage() for r in lines]
    assert "malformed trace-context header" in lines[0].getMessage()
    caplog.clear()
    tracing.MALFORMED_HEADER_LOG._next = 0.0  # the next interval: one line, counting those left out
    extract_context([("traceparent", parent), ("tracestate", "a=b,!!!")])
    assert "(and 149 more like it" in caplog.records[0].getMessage()


def test_extract_without_metadata_starts_a_new_trace(exporter, worker_provider):
    assert not trace.get_current_span(extract_context(None)).get_span_context().is_valid
    assert (
        not trace.get_current_span(extract_context([("x-request-id", "1"), ("k-bin", b"\x00")]))
        .get_span_context()
        .is_valid
    )
    with start_server_span("worker.prefill", [], tracer_provider=worker_provider) as span:
        pass
    assert span.parent is None


def test_trace_headers_that_are_not_ascii_are_left_out(exporter, worker_provider):
    """HTTP headers with bytes that are not UTF-8 arrive as surrogates (aiohttp): the baggage propagator raised."""
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    headers = [("traceparent", parent), ("baggage", "\udcff=\udcfe"), ("tracestate", "a=\udcff")]
    with start_server_span("request", headers, tracer_provider=worker_provider) as span:
        pass
    assert span.parent is not None and format(span.parent.span_id, "016x") == parent.split("-")[2]


def test_inject_uses_given_context(router_provider):
    tracer = get_tracer(router_provider)
    span = tracer.start_span("request")
    md = dict(inject_metadata(trace.set_span_in_context(span)))  # no current span: the loop's situation
    span.end()
    ctx = span.get_span_context()
    assert md["traceparent"].split("-")[1:3] == [format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")]
    assert inject_metadata() == []  # nothing current, nothing injected


def test_no_otlp_exporter_without_env():
    assert otlp_span_processor({}) is None
    provider = configure_tracing("colibri-router", env={}, set_global=False)
    assert provider._active_span_processor._span_processors == ()
    assert provider.resource.attributes["service.name"] == "colibri-router"


def test_otlp_exporter_with_env():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SERVICE_NAME": "moe-router"}
    provider = configure_tracing("colibri-router", env=env, set_global=False)
    (processor,) = provider._active_span_processor._span_processors
    assert isinstance(processor, BatchSpanProcessor)
    assert type(processor._batch_processor._exporter).__name__ == "OTLPSpanExporter"
    assert provider.resource.attributes["service.name"] == "moe-router"  # the operator's name wins
    provider.shutdown()


def test_a_server_span_keeps_no_exception_text(exporter, router_provider):
    """A request's error (a validation message can quote its token ids or its grammar) is chained under the
    exception that ends the span, the router's gRPC abort: neither message nor traceback may reach the exporter."""
    with pytest.raises(RuntimeError):
        with start_server_span("request", [], tracer_provider=router_provider):
            try:
                raise ValueError("prompt token id 987654321")
            except ValueError:
                raise RuntimeError("Locally aborted.")  # noqa: B904 (the chaining is the point)
    [span] = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert "987654321" not in repr([(e.name, dict(e.attributes or {})) for e in span.events] + [span.status])
