"""The worker's spans: its calls are traced, the router's health polls of it are not (about one a second,
each a root span of its own: they would bury the real traces)."""

from __future__ import annotations

import grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from common.tracing import make_tracer_provider
from tests.helpers import BackgroundWorker

SERVICE = "colibri.worker.v1.WorkerService"


def test_health_polls_make_no_spans(tiny_model):
    exporter = InMemorySpanExporter()
    worker = BackgroundWorker(
        tiny_model, tracer_provider=make_tracer_provider("test-worker", SimpleSpanProcessor(exporter))
    ).start()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            for _ in range(3):
                assert stub.Health(pb.HealthRequest(), timeout=10).ready
            stub.Info(pb.InfoRequest(), timeout=10)
    finally:
        worker.stop()
    names = [s.name for s in exporter.get_finished_spans()]
    assert f"{SERVICE}/Info" in names  # the interceptor is on
    assert f"{SERVICE}/Health" not in names, names
