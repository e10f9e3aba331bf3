"""Batching-loop hooks and the router's metrics: the loop calls hooks, this file turns them into Prometheus
series.

The batching loop knows nothing about Prometheus; it calls `BatchingLoopHooks` at the moments that matter
(admission, first scheduling, every token, every step, the terminal status). All intervals use time.monotonic() stamps
taken in this one process (vLLM's rule: never compare monotonic clocks across processes).
"""

from __future__ import annotations

import time

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from common.metrics import RouterMetrics, new_registry, start_metrics_server
from common.tracing import get_tracer


class BatchingLoopHooks:
    """No-op observability hooks; `request` is the batching loop's RequestState."""

    def on_attached(self, batching_loop) -> None:
        """The loop starts; hooks may keep it to read its live state (gauges read at scrape time)."""

    def on_worker_state(self, ready: bool) -> None: ...

    def on_admitted(self, request) -> None: ...

    def on_scheduled(self, request, now: float) -> None: ...

    def on_token(self, request, now: float) -> None: ...

    def on_step(
        self,
        kind: str,
        num_seqs: int,
        num_tokens: int,
        router_seconds: float,
        worker_seconds: float | None,
        num_running: int,
        num_waiting: int,
        num_active: int,
    ) -> None: ...

    def on_request_done(self, request, outcome: str, now: float) -> None: ...

    def on_prefix_cache(self, query_tokens: int, hit_tokens: int, evicted_blocks: int) -> None:
        """Prefix-cache lookups and evictions since the last call."""

    def on_rejected(self, outcome: str) -> None:
        """A request refused before admission (validation, overload, draining): outcome = status, lower-case."""

    def on_http_connections(self, count) -> None:
        """The HTTP front starts; `count()` is its open connections, for hooks to read when they want."""

    def on_http_connection_refused(self) -> None:
        """The HTTP front refused a connection: http_max_connections were open."""

    def on_grpc_connections(self, port: str, count) -> None:
        """A gRPC server starts; `count()` is its open connections ("grpc": the public port, "health": the health
        port), for hooks to read when they want."""

    def on_http_body_bytes(self, count) -> None:
        """The HTTP front starts; `count()` is the body bytes it holds reserved now, for hooks to read."""

    def on_http_body_refused(self) -> None:
        """The HTTP front refused a request: its body did not fit http_max_body_bytes_in_flight."""


class MetricsHooks(BatchingLoopHooks):
    """BatchingLoopHooks that update common.metrics.RouterMetrics."""

    def __init__(self, metrics: RouterMetrics):
        self.m = metrics

    def on_attached(self, batching_loop) -> None:
        # Read at scrape time, not set at steps: a value set at the last step stayed (queue_size 1 when idle,
        # the last batch while the worker was down), and queue_size feeds the autoscaler.
        def scheduled(count: str):
            return lambda: getattr(batching_loop.scheduler, count) if batching_loop.scheduler is not None else 0

        self.m.queue_size.set_function(lambda: batching_loop.num_active)
        self.m.num_requests_running.set_function(scheduled("num_running"))
        self.m.num_requests_waiting.set_function(scheduled("num_waiting"))
        self.m.prefix_cache_blocks.set_function(
            lambda: batching_loop.scheduler.prefix_cache.num_cached_blocks if batching_loop.prefix_caching else 0
        )

    def on_admitted(self, request) -> None:
        self.m.prompt_tokens.inc(len(request.req.prompt_ids))

    def on_scheduled(self, request, now: float) -> None:
        self.m.request_queue_duration.observe(now - request.arrived_at)

    def on_token(self, request, now: float) -> None:
        self.m.generation_tokens.inc()
        if request.last_token_at is None:
            self.m.time_to_first_token.observe(now - request.arrived_at)
        else:
            self.m.time_per_output_token.observe(now - request.last_token_at)

    def on_step(
        self, kind, num_seqs, num_tokens, router_seconds, worker_seconds, num_running, num_waiting, num_active
    ) -> None:
        self.m.observe_step(kind, router_seconds, worker_seconds, num_seqs, num_tokens)

    def on_request_done(self, request, outcome: str, now: float) -> None:
        self.m.observe_finished(outcome, now - request.arrived_at)

    def on_prefix_cache(self, query_tokens: int, hit_tokens: int, evicted_blocks: int) -> None:
        self.m.prefix_cache_queries.inc(query_tokens)
        self.m.prefix_cache_hits.inc(hit_tokens)
        self.m.prefix_cache_evictions.inc(evicted_blocks)

    def on_rejected(self, outcome: str) -> None:
        self.m.requests.labels(outcome=outcome).inc()

    def on_http_connections(self, count) -> None:
        self.m.http_connections.set_function(count)

    def on_http_connection_refused(self) -> None:
        self.m.http_connections_refused.inc()

    def on_grpc_connections(self, port: str, count) -> None:
        (self.m.grpc_connections if port == "grpc" else self.m.grpc_health_connections).set_function(count)

    def on_http_body_bytes(self, count) -> None:
        self.m.http_body_bytes.set_function(count)

    def on_http_body_refused(self) -> None:
        self.m.http_bodies_refused.inc()


class QueueSpanHooks(BatchingLoopHooks):
    """The request span's `queue` child: arrival to the first step that carries the request, or to its end when
    none did (a queue timeout, a cancel). Made once its end is known, from the loop's monotonic stamps."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None):
        self._tracer = get_tracer(tracer_provider)

    def on_scheduled(self, request, now: float) -> None:
        self._record(request, now)

    def on_request_done(self, request, outcome: str, now: float) -> None:
        if request.scheduled_at is None:
            self._record(request, now)

    def _record(self, request, now: float) -> None:
        parent = request.span_context
        if parent is None or not parent.is_valid:  # no request span to hang it on
            return
        # Span times are wall-clock ns; the loop's stamps are monotonic: shift them by the clocks' offset.
        end_ns = time.time_ns() - int((time.monotonic() - now) * 1e9)
        start_ns = end_ns - int((now - request.arrived_at) * 1e9)
        span = self._tracer.start_span(
            "queue",
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
            kind=trace.SpanKind.INTERNAL,
            start_time=start_ns,
        )
        span.end(end_time=end_ns)


class ChainedHooks(BatchingLoopHooks):
    """Calls several hooks objects in order (health mirroring + metrics)."""

    def __init__(self, *hooks: BatchingLoopHooks):
        self.hooks = hooks

    def __getattribute__(self, name):
        if name.startswith("on_"):
            hooks = object.__getattribute__(self, "hooks")
            return lambda *args: [getattr(h, name)(*args) for h in hooks] and None
        return object.__getattribute__(self, name)


def router_metrics(
    model_name: str, port: int, registry: CollectorRegistry | None = None, host: str = "127.0.0.1"
) -> tuple[MetricsHooks, int]:
    """Metrics hooks on a fresh registry, served on http://host:port/metrics (port 0 = a free one, -1 = none)."""
    registry = registry or new_registry()
    hooks = MetricsHooks(RouterMetrics(registry, model_name))
    bound = start_metrics_server(registry, port, host, role="router metrics").server_port if port >= 0 else -1
    return hooks, bound
