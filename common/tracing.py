"""OpenTelemetry tracing: provider set-up, W3C context over gRPC metadata, GenAI attribute names.

Span tree: the router's request span (SERVER, ``text_completion {model}``) → its ``queue`` child; each
worker call gets one router step span (CLIENT, ``prefill`` / ``decode``) linked to the request spans of the
batch's members; the worker's span for that call (SERVER) is the step span's child, because the router
injects the step span's context into the call metadata (``traceparent``/``tracestate``) and the worker
extracts it. Logs written inside any of these spans carry its trace_id/span_id (common.logging_setup).

Provider choice: ``configure_tracing`` installs the SDK provider globally once per process (OTel allows
one set). Code that makes spans takes an optional ``tracer_provider`` and calls ``get_tracer(provider)``;
tests build their own provider with ``make_tracer_provider(..., processor)`` (e.g. an
InMemorySpanExporter behind a SimpleSpanProcessor) and pass it in, never touching the global one.
Propagation uses the global propagator (W3C tracecontext + baggage by default, OTEL_PROPAGATORS), which is
independent of the provider.

Without OTEL_EXPORTER_OTLP_ENDPOINT spans are still created (so logs get trace ids and the worker joins
the router's trace) but nothing is exported. With it, spans go to OTLP/gRPC through a BatchSpanProcessor;
the exporter reads the rest of its settings (OTEL_EXPORTER_OTLP_HEADERS, _INSECURE, _CERTIFICATE, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode

from common.rate_limited_log import RateLimitedLog
from common.tracing_env import check_tracing_env

INSTRUMENTATION_NAME = "colibri"

# OpenTelemetry GenAI semantic conventions (GitHub open-telemetry/semantic-conventions @7b0c0fe, its
# docs/gen-ai/gen-ai-spans.md; status Development: names may change, so they live only here).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"
# Values: our operation is a plain completion; the provider is us (a custom value is allowed).
OPERATION_TEXT_COMPLETION = "text_completion"
PROVIDER_COLIBRI = "colibri"

# OpenTelemetry RPC semantic conventions (the same repository's docs/rpc/grpc.md), for spans of gRPC calls.
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
# Colibri's own attributes on step spans.
COLIBRI_BATCH_SIZE = "colibri.batch.size"
COLIBRI_BATCH_TOKENS = "colibri.batch.tokens"
COLIBRI_STEP_KIND = "colibri.step.kind"

# Server spans are errors only for these codes (RPC semconv); a client's bad input is not our error.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def request_span_name(model: str, operation: str = OPERATION_TEXT_COMPLETION) -> str:
    """GenAI span name: `{gen_ai.operation.name} {gen_ai.request.model}`."""
    return f"{operation} {model}"


def otlp_span_processor(env: Mapping[str, str] | None = None) -> SpanProcessor | None:
    """A BatchSpanProcessor over the OTLP/gRPC exporter when OTEL_EXPORTER_OTLP_ENDPOINT is set, else None."""
    env = os.environ if env is None else env
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    # Imported here: the exporter pulls in its own gRPC/protobuf stack, not needed when not exporting.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))


def make_tracer_provider(
    service_name: str, *processors: SpanProcessor, env: Mapping[str, str] | None = None
) -> TracerProvider:
    """An SDK provider with service.name (OTEL_SERVICE_NAME wins over `service_name`) and `processors`."""
    env = os.environ if env is None else env
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def configure_tracing(
    service_name: str, *, env: Mapping[str, str] | None = None, set_global: bool = True
) -> TracerProvider:
    """The process's provider: OTLP export when configured, nothing exported otherwise; set as global.

    Call once at start-up; call ``provider.shutdown()`` at exit so the batch processor flushes.
    """
    check_tracing_env(env)
    processor = otlp_span_processor(env)
    provider = make_tracer_provider(service_name, *([processor] if processor else []), env=env)
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


# Colibri's tracer per provider. Spans start per request and per step, and the SDK's get_tracer, though it hands
# back the same Tracer for the same scope, first re-registers a warnings filter and builds two scope objects
# (~20 us). Weak keys: a tracer does not refer to its provider, so a provider dropped takes its tracer along
# (one made with shutdown_on_exit=False: by default the SDK's exit hook keeps every provider alive anyway).
_tracers: weakref.WeakKeyDictionary[trace.TracerProvider, trace.Tracer] = weakref.WeakKeyDictionary()


def get_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """Colibri's tracer from `tracer_provider`, or from the global provider when None (the one set now: a
    tracer got before the global provider was set is the API's proxy, which follows it anyway)."""
    provider = trace.get_tracer_provider() if tracer_provider is None else tracer_provider
    try:
        return _tracers[provider]
    except KeyError:
        tracer = _tracers[provider] = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=provider)
        return tracer
    except TypeError:  # a provider that cannot be weakly referenced or hashed: asked every time, as before
        return trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=provider)


def inject_metadata(context: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """W3C trace context (traceparent, tracestate, baggage) as gRPC call metadata.

    `context` defaults to the current one; the router's batching loop passes the step span's context
    explicitly (``trace.set_span_in_context(step_span)``) since it runs outside any request's task.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


logger = logging.getLogger(__name__)
# OpenTelemetry logs a WARNING for each malformed traceparent, tracestate or baggage header it reads, and anyone who
# can send a request picks the headers: while extracting, those lines go through one rate-limited line instead.
MALFORMED_HEADER_LOG = RateLimitedLog(logger)
_OTEL_HEADER_LOGGERS = (
    "opentelemetry.trace.span",
    "opentelemetry.trace.propagation.tracecontext",
    "opentelemetry.baggage",
    "opentelemetry.baggage.propagation",
)
_extracting = contextvars.ContextVar("colibri_extracting_trace_context", default=False)


class _MalformedHeaderFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not _extracting.get():
            return True  # the same loggers' lines about the server's own spans stay as they are
        MALFORMED_HEADER_LOG.warning("malformed trace-context header left out: %.200r", record.getMessage())
        return False


_MALFORMED_HEADER_FILTER = _MalformedHeaderFilter()
for _name in _OTEL_HEADER_LOGGERS:
    logging.getLogger(_name).addFilter(_MALFORMED_HEADER_FILTER)


def extract_context(metadata: Iterable[Any] | None) -> otel_context.Context:
    """The remote parent context from gRPC metadata or HTTP headers (pairs or grpc's _Metadatum); empty when
    absent."""
    carrier: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        # "-bin" keys carry bytes; trace context and baggage are ASCII text. aiohttp hands header bytes that are
        # not UTF-8 on as surrogates, which OpenTelemetry's baggage propagator fails to encode.
        if isinstance(value, str) and value.isascii():
            carrier[key.lower()] = value
    token = _extracting.set(True)
    try:
        return propagate.extract(carrier)
    finally:
        _extracting.reset(token)


def links_from_contexts(
    items: Iterable[Span | SpanContext | otel_context.Context | None], attributes: Mapping[str, Any] | None = None
) -> list[Link]:
    """Span links (e.g. a batch step span → each member request span); invalid or missing ones skipped."""
    links = []
    for item in items:
        if item is None:
            continue
        if isinstance(item, Span):
            ctx = item.get_span_context()
        elif isinstance(item, SpanContext):
            ctx = item
        else:
            ctx = trace.get_current_span(item).get_span_context()
        if ctx.is_valid:
            links.append(Link(ctx, attributes=dict(attributes) if attributes else None))
    return links


@contextlib.contextmanager
def start_server_span(
    name: str,
    context_metadata: Iterable[Any] | None,
    attributes: Mapping[str, Any] | None = None,
    *,
    links: Iterable[Link] = (),
    kind: SpanKind = SpanKind.SERVER,
    tracer_provider: trace.TracerProvider | None = None,
    status_from_exception: bool = True,
) -> Iterator[Span]:
    """A current span whose parent is the caller's span carried in `context_metadata`.

    Worker handlers use it as ``with start_server_span("decode", context.invocation_metadata()):``.
    An exception sets the span status to ERROR, naming only its type, and is re-raised; with
    `status_from_exception` false the caller sets the status from the status code it answers
    (`set_request_status`), as an aborted call raises whether or not the server is at fault.
    """
    tracer = get_tracer(tracer_provider)
    # Not recorded: an exception's message and traceback (chained errors included) can quote the request,
    # its token ids or its grammar, and spans leave the process.
    with tracer.start_as_current_span(
        name,
        context=extract_context(context_metadata),
        kind=kind,
        attributes=dict(attributes or {}),
        links=list(links),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as e:
            if status_from_exception:
                span.set_status(Status(StatusCode.ERROR, type(e).__name__))
            raise


def set_request_status(span: Span, code: grpc.StatusCode) -> None:
    """ERROR, naming the code, only for a server-side fault (RPC semconv): a client's mistake, a full server or a
    client gone leaves the status unset."""
    if code in _SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, code.name))


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {RPC_SYSTEM: "grpc", RPC_SERVICE: service, RPC_METHOD: name}


_CODES_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def _end_rpc_span(span: Span, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
    """rpc.grpc.status_code from the servicer context; ERROR status only for server-side faults."""
    code = context.code()
    if isinstance(code, int):
        code = _CODES_BY_VALUE.get(code)
    if code is None:  # not set by abort/set_code: grpc reports OK, CANCELLED or UNKNOWN
        if error is None:
            code = grpc.StatusCode.OK
        else:
            cancelled = isinstance(error, (asyncio.CancelledError, GeneratorExit))
            code = grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.UNKNOWN
    span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
    if code in _SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, code.name))


@contextlib.contextmanager
def _rpc_span(name: str, method: str, metadata, context, provider) -> Iterator[Span]:
    tracer = get_tracer(provider)
    # Exceptions do not set ERROR by themselves: an aborted INVALID_ARGUMENT call raises too, and it is not our
    # fault (RPC semconv); _end_rpc_span decides from the status code. Nor are they recorded: a message or a
    # chained error can quote the request (its token ids, its grammar), and spans leave the process.
    with tracer.start_as_current_span(
        name,
        context=extract_context(metadata),
        kind=SpanKind.SERVER,
        attributes=_rpc_attributes(method),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as e:
            _end_rpc_span(span, context, e)
            raise
        _end_rpc_span(span, context, None)


class ServerTracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per unary-request RPC (unary and server-streaming), child of the caller's context.

    Span name `package.Service/Method` (RPC semconv). Health and reflection calls are not traced
    (probes every few seconds would drown the real spans). Client-streaming RPCs pass through untraced;
    neither service has any.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        exclude_prefixes: tuple[str, ...] = ("/grpc.health.", "/grpc.reflection."),
    ):
        self._provider = tracer_provider
        self._exclude = exclude_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._exclude):
            return handler
        metadata, name, provider = handler_call_details.invocation_metadata, method.lstrip("/"), self._provider

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                with _rpc_span(name, method, metadata, context, provider):
                    response = inner(request, context)
                    return await response if inspect.isawaitable(response) else response

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                with _rpc_span(name, method, metadata, context, provider):
                    result = inner_stream(request, context)
                    if hasattr(result, "__aiter__"):
                        async for response in result:
                            yield response
                    else:  # a coroutine that writes with context.write()
                        await result

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
