"""get_tracer keeps one tracer per provider: the same tracer for the same provider (the SDK's own), another for
another provider, the new global provider's once it changes, and nothing kept for a provider that is gone."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from common import tracing
from common.tracing import INSTRUMENTATION_NAME, get_tracer, make_tracer_provider


def provider_with_exporter(name: str):
    exporter = InMemorySpanExporter()
    return make_tracer_provider(name, SimpleSpanProcessor(exporter), env={}), exporter


@pytest.fixture
def no_global_provider():
    """OpenTelemetry lets a process set the global provider once: reset it the way its own test utilities do,
    and put the previous one back after."""
    saved = trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER
    trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = Once(), None
    yield
    trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = saved


def set_global(provider) -> None:
    trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = Once(), None
    trace.set_tracer_provider(provider)


def test_the_same_provider_gives_the_same_tracer():
    provider, exporter = provider_with_exporter("colibri-router")
    tracer = get_tracer(provider)
    assert get_tracer(provider) is tracer
    assert tracer is trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=provider)  # the SDK's for our scope
    tracer.start_span("decode").end()
    (span,) = exporter.get_finished_spans()
    assert (span.instrumentation_scope.name, span.instrumentation_scope.version) == (INSTRUMENTATION_NAME, "")
    assert span.resource.attributes["service.name"] == "colibri-router"


def test_each_provider_has_its_own_tracer():
    names = [f"service-{random.randrange(10**9)}" for _ in range(3)]
    made = [provider_with_exporter(name) for name in names]
    tracers = [get_tracer(provider) for provider, _ in made]
    assert len({id(t) for t in tracers}) == 3
    for (provider, exporter), tracer, name in zip(made, tracers, names):
        assert get_tracer(provider) is tracer
        tracer.start_span("step").end()
        (span,) = exporter.get_finished_spans()
        assert span.resource.attributes["service.name"] == name


@pytest.mark.usefixtures("no_global_provider")
def test_the_global_provider_is_read_at_each_call():
    early = get_tracer()  # no global provider yet: the API's proxy, which follows the one set later
    first, first_spans = provider_with_exporter("first")
    set_global(first)
    assert get_tracer() is get_tracer(first)
    early.start_span("queued").end()
    get_tracer().start_span("prefill").end()
    assert [s.name for s in first_spans.get_finished_spans()] == ["queued", "prefill"]

    second, second_spans = provider_with_exporter("second")
    set_global(second)
    assert get_tracer() is get_tracer(second) and get_tracer() is not get_tracer(first)
    get_tracer().start_span("decode").end()
    assert [s.name for s in second_spans.get_finished_spans()] == ["decode"]
    assert len(first_spans.get_finished_spans()) == 2


def test_a_dropped_provider_takes_its_tracer_along():
    provider = TracerProvider(shutdown_on_exit=False)  # by default the SDK's exit hook keeps every provider alive
    get_tracer(provider)
    gone = weakref.ref(provider)
    assert provider in tracing._tracers
    del provider
    gc.collect()
    assert gone() is None  # the cached tracer did not keep its provider alive


def test_an_unhashable_provider_is_asked_each_time():
    class UnhashableProvider(trace.TracerProvider):
        __hash__ = None

        def __init__(self):
            self.calls = 0

        def get_tracer(self, *args, **kwargs):
            self.calls += 1
            return trace.NoOpTracer()

    provider = UnhashableProvider()
    assert isinstance(get_tracer(provider), trace.NoOpTracer)
    assert isinstance(get_tracer(provider), trace.NoOpTracer)
    assert provider.calls == 2
