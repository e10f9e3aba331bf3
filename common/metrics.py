"""Prometheus metrics: names, types, labels and buckets in one place, one class per process.

Every metric is prefixed ``colibri_`` and carries a ``model_name`` label. Each lives in exactly one
process (router or worker), so summing across a pod never counts a thing twice. Each process builds its
own ``CollectorRegistry`` (never prometheus_client's global one), which lets tests build several.

Attributes without extra labels are already bound to ``model_name`` (``m.queue_size.set(3)``); those with
one (outcome, kind, layer, item) are ``_Family`` objects: ``m.requests.labels(outcome="ok").inc()``.
docs/observability.md lists every metric with its meaning.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from common.listen_address import bind_error, bind_targets, bound_address, host_port, listen_host, set_v6only

PREFIX = "colibri_"

# OTel GenAI semantic conventions (GitHub open-telemetry/semantic-conventions @7b0c0fe, docs/gen-ai/gen-ai-metrics.md),
# ExplicitBucketBoundaries of gen_ai.server.{time_to_first_token, time_per_output_token, request.duration}.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GENAI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# A small-batch decode step on an H200 takes a few ms, all below the semconv's first 10 ms boundary; these
# three extra boundaries resolve it while keeping every semconv boundary (series stay comparable).
TPOT_BUCKETS = (0.001, 0.0025, 0.005) + GENAI_TPOT_BUCKETS

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TRANSPORT_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKENS_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
RECALL_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0)
STALL_BUCKETS = (0.0, 0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# Request outcomes = the terminal gRPC status of the request's stream (docs/api.md, status codes), lower-cased.
OUTCOMES = ("ok", "invalid_argument", "resource_exhausted", "unavailable", "deadline_exceeded", "cancelled", "internal")
STEP_KINDS = ("prefill", "decode")


class _Family:
    """A labelled metric with model_name bound: `.labels(outcome="ok")` returns the child to inc/set/observe."""

    def __init__(self, metric, model_name: str, allowed: Mapping[str, Sequence[str]] | None = None):
        self._metric, self._model_name, self._allowed = metric, model_name, allowed or {}

    def labels(self, **labels: str | int):
        for key, values in self._allowed.items():
            # A typo in a fixed label would silently start a new series; fail loudly instead.
            if str(labels.get(key)) not in values:
                raise ValueError(f"{self._metric._name}: {key}={labels.get(key)!r} (expected one of {values})")
        return self._metric.labels(model_name=self._model_name, **{k: str(v) for k, v in labels.items()})


class _Builder:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry, self.model_name = registry, model_name

    def _make(self, cls, name, doc, labels=(), **kw):
        metric = cls(PREFIX + name, doc, ("model_name", *labels), registry=self.registry, **kw)
        return metric if labels else metric.labels(model_name=self.model_name)

    def counter(self, name, doc, labels=()):
        return self._make(Counter, name, doc, labels)

    def gauge(self, name, doc, labels=()):
        return self._make(Gauge, name, doc, labels)

    def histogram(self, name, doc, buckets, labels=()):
        return self._make(Histogram, name, doc, labels, buckets=buckets)

    def family(self, metric, allowed=None, precreate: Iterable[Mapping[str, str]] = ()) -> _Family:
        fam = _Family(metric, self.model_name, allowed)
        for labels in precreate:  # zero-valued series exist from the start, so rate() and alerts see them
            fam.labels(**labels)
        return fam


def new_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A fresh registry, with the standard process_* metrics (RSS, CPU, fds) unless told otherwise."""
    registry = CollectorRegistry()
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


class RouterMetrics:
    """Request lifecycle and scheduling, as the router sees it."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        b = _Builder(registry, model_name)
        self.requests = b.family(
            b.counter("requests", "Finished requests by terminal status", ("outcome",)),
            allowed={"outcome": OUTCOMES},
            precreate=[{"outcome": o} for o in OUTCOMES],
        )
        self.queue_size = b.gauge(
            "queue_size", "Admitted requests not yet finished (waiting + running); capped by max_concurrent_requests"
        )
        self.num_requests_running = b.gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = b.gauge(
            "num_requests_waiting", "Admitted requests waiting for their first prefill step"
        )
        self.time_to_first_token = b.histogram(
            "time_to_first_token_seconds", "Arrival to first generated token", TTFT_BUCKETS
        )
        self.time_per_output_token = b.histogram(
            "time_per_output_token_seconds", "Time between consecutive output tokens of a request", TPOT_BUCKETS
        )
        self.request_duration = b.histogram(
            "request_duration_seconds", "Arrival to terminal status", REQUEST_DURATION_BUCKETS
        )
        self.request_queue_duration = b.histogram(
            "request_queue_duration_seconds", "Arrival to first scheduled step", REQUEST_DURATION_BUCKETS
        )
        self.prompt_tokens = b.counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = b.counter("generation_tokens", "Generated tokens")
        # Prefix cache, in tokens as vLLM counts them: hit rate = rate(hits) / rate(queries).
        self.prefix_cache_queries = b.counter(
            "prefix_cache_queries", "Prompt tokens of requests that looked the prefix cache up (tokens)"
        )
        self.prefix_cache_hits = b.counter(
            "prefix_cache_hits", "Prompt tokens sequences started on from the prefix cache, once the worker ran them"
        )
        self.prefix_cache_evictions = b.counter(
            "prefix_cache_evictions", "Cached KV blocks evicted to make room for new requests"
        )
        self.prefix_cache_blocks = b.gauge("prefix_cache_blocks", "KV blocks held by the prefix cache")
        self.http_connections = b.gauge("http_connections", "Open connections of the OpenAI-compatible HTTP port")
        self.http_connections_refused = b.counter(
            "http_connections_refused", "HTTP connections refused (503) because http_max_connections were open"
        )
        self.grpc_connections = b.gauge("grpc_connections", "Open connections of the public gRPC port (channelz)")
        self.grpc_health_connections = b.gauge(
            "grpc_health_connections", "Open connections of the gRPC health port (channelz)"
        )
        self.http_body_bytes = b.gauge(
            "http_body_bytes", "Bytes of HTTP request bodies reserved now (being read or parsed)"
        )
        self.http_bodies_refused = b.counter(
            "http_bodies_refused",
            "HTTP requests refused (503) because their body did not fit http_max_body_bytes_in_flight",
        )
        self.batch_size = b.histogram("batch_size", "Sequences per worker step", BATCH_SIZE_BUCKETS)
        self.batch_tokens = b.histogram("batch_tokens", "Tokens per worker step", BATCH_TOKENS_BUCKETS)
        kinds = {"kind": STEP_KINDS}
        self.step_duration = b.family(
            b.histogram(
                "step_duration_seconds",
                "Worker step as measured by the router (call round trip)",
                STEP_BUCKETS,
                ("kind",),
            ),
            allowed=kinds,
        )
        self.step_transport_overhead = b.family(
            b.histogram(
                "step_transport_overhead_seconds",
                "Router-measured step time minus the worker-reported step time (gRPC + serialisation)",
                TRANSPORT_BUCKETS,
                ("kind",),
            ),
            allowed=kinds,
        )

    def observe_step(
        self, kind: str, router_seconds: float, worker_seconds: float | None, num_seqs: int, num_tokens: int
    ) -> None:
        """One worker call: its duration, overhead (when the worker reported its own time) and batch shape."""
        self.step_duration.labels(kind=kind).observe(router_seconds)
        if worker_seconds is not None:
            # Clock jitter can make the difference slightly negative; a histogram needs >= 0.
            overhead = max(0.0, router_seconds - worker_seconds)
            self.step_transport_overhead.labels(kind=kind).observe(overhead)
        self.batch_size.observe(num_seqs)
        self.batch_tokens.observe(num_tokens)

    def observe_finished(self, outcome: str, duration_seconds: float) -> None:
        """A request reached its terminal status (every stream ends with exactly one, so once per request)."""
        self.requests.labels(outcome=outcome).inc()
        self.request_duration.observe(duration_seconds)


class WorkerMetrics:
    """Model execution, KV cache, expert cache and routing quality, as the worker sees them."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        b = _Builder(registry, model_name)
        self.worker_step_duration = b.family(
            b.histogram(
                "worker_step_duration_seconds",
                "Step time on the worker, request in to response out",
                STEP_BUCKETS,
                ("kind",),
            ),
            allowed={"kind": STEP_KINDS},
        )
        self.kv_cache_usage_ratio = b.gauge("kv_cache_usage_ratio", "KV blocks in use / KV blocks in the pool")
        self.kv_blocks_used = b.gauge("kv_blocks_used", "KV blocks in use")
        self.worker_grpc_connections = b.gauge(
            "worker_grpc_connections", "Open connections of the worker's RPC port or socket (channelz)"
        )
        self.worker_grpc_health_connections = b.gauge(
            "worker_grpc_health_connections", "Open connections of the worker's health port (channelz)"
        )
        self.expert_cache_hits = b.counter("expert_cache_hits", "Expert uses served by a resident expert slot")
        self.expert_cache_misses = b.counter(
            "expert_cache_misses", "Expert uses that needed a host-to-device copy first"
        )
        self.expert_cache_copied_bytes = b.counter(
            "expert_cache_copied_bytes", "Bytes of expert weights copied host to device"
        )
        self.expert_cache_stall_seconds = b.counter(
            "expert_cache_stall_seconds", "Compute time lost waiting for expert copies (not hidden by overlap)"
        )
        self.expert_cache_prefetches_issued = b.counter(
            "expert_cache_prefetches_issued", "Expert copies issued by prefetch (routing plan and lookahead)"
        )
        self.expert_cache_prefetches_used = b.counter(
            "expert_cache_prefetches_used", "Prefetched experts that a step then used (hit)"
        )
        self.expert_cache_step_stall = b.histogram(
            "expert_cache_step_stall_seconds", "Expert-copy stall per step", STALL_BUCKETS
        )
        self.routing_plan_recall = b.gauge(
            "routing_plan_recall",
            "Share of the exact routing the expert cache's plan predicted (the worker's own table lookup, else the "
            "router's plan), last step",
        )
        self.routing_plan_recall_per_step = b.histogram(
            "routing_plan_recall_per_step", "Routing plan recall, per step", RECALL_BUCKETS
        )
        self.expert_load_imbalance = b.family(
            b.gauge(
                "expert_load_imbalance", "Max expert load / mean expert load in the last step (1 = even)", ("layer",)
            )
        )
        self.memory_plan_bytes = b.family(
            b.gauge("worker_memory_plan_bytes", "Start-up device memory plan, bytes per item", ("item",))
        )

    def observe_expert_cache(
        self,
        hits: int,
        misses: int,
        copied_bytes: int,
        stall_seconds: float,
        prefetches_issued: int = 0,
        prefetches_used: int = 0,
    ) -> None:
        """One step's expert-cache counts (all uses are hits, the rest zeros, when all experts are resident)."""
        self.expert_cache_prefetches_issued.inc(prefetches_issued)
        self.expert_cache_prefetches_used.inc(prefetches_used)
        self.expert_cache_hits.inc(hits)
        self.expert_cache_misses.inc(misses)
        self.expert_cache_copied_bytes.inc(copied_bytes)
        self.expert_cache_stall_seconds.inc(stall_seconds)
        self.expert_cache_step_stall.observe(stall_seconds)

    def observe_recall(self, recall: float) -> None:
        self.routing_plan_recall.set(recall)
        self.routing_plan_recall_per_step.observe(recall)

    def set_kv_usage(self, blocks_used: int, num_blocks: int) -> None:
        self.kv_blocks_used.set(blocks_used)
        self.kv_cache_usage_ratio.set(blocks_used / num_blocks if num_blocks else 0.0)

    def set_load_imbalance(self, per_layer_counts: Iterable[Sequence[int]]) -> None:
        """Per-layer token counts per expert ([layer][expert]) -> one gauge per layer."""
        for layer, counts in enumerate(per_layer_counts):
            self.expert_load_imbalance.labels(layer=layer).set(load_imbalance(counts))

    def set_memory_plan(self, items: Mapping[str, int]) -> None:
        for item, num_bytes in items.items():
            self.memory_plan_bytes.labels(item=item).set(num_bytes)


def load_imbalance(counts: Sequence[int]) -> float:
    """max / mean of tokens per expert over all experts of a layer; 1.0 when even or empty."""
    total = sum(counts)
    if not counts or total == 0:
        return 1.0
    return max(counts) * len(counts) / total


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # every scrape would be a line on stderr
        pass


class MetricsServer:
    """The /metrics listeners of one process: one per address its host resolves to, all on one port and one
    registry. Stop with ``shutdown(); server_close()``."""

    def __init__(self) -> None:
        self.servers: list[WSGIServer] = []
        self.threads: list[threading.Thread] = []

    @property
    def server_port(self) -> int:
        return self.servers[0].server_port

    def shutdown(self) -> None:
        for server in self.servers:
            server.shutdown()

    def server_close(self) -> None:
        for server in self.servers:
            server.server_close()


def _bind(app, bound_host: str, family: socket.AddressFamily, sockaddr: tuple) -> WSGIServer:
    class Server(ThreadingWSGIServer):
        address_family = family

        def server_bind(self):
            set_v6only(self.socket, bound_host)
            self.server_address = sockaddr  # with an IPv6 zone's scope id, which (host, port) lacks
            super().server_bind()

    return make_server(sockaddr[0], sockaddr[1], app, Server, handler_class=_QuietHandler)


def start_metrics_server(
    registry: CollectorRegistry, port: int, host: str = "127.0.0.1", role: str = "metrics"
) -> MetricsServer:
    """Serves the registry as Prometheus text on http://host:port/metrics from daemon threads; `::` is every
    interface, IPv6 and IPv4 (common/listen_address.py: prometheus_client's own server leaves IPV6_V6ONLY to the
    platform), and a host name is every address it resolves to (localhost: 127.0.0.1 and ::1), as gRPC binds it.

    Port 0 binds a free port, then that same port on the other addresses; `server_port` is the port bound. A port
    that cannot be bound on any address raises AddressInUseError naming `role` and that address ("worker metrics
    [::]:9091 is in use"), with whatever was bound already closed.
    """
    bound_host = listen_host(host)
    app = make_wsgi_app(registry)
    metrics = MetricsServer()
    where = host_port(bound_host, port)
    try:
        targets = bind_targets(bound_host, port)
        for family, sockaddr in targets:
            if metrics.servers:  # one port for every address, so a scrape config names one
                sockaddr = (sockaddr[0], metrics.server_port, *sockaddr[2:])
            where = bound_address(bound_host, sockaddr, len(targets) > 1)
            metrics.servers.append(_bind(app, bound_host, family, sockaddr))
    except OSError as e:
        metrics.server_close()
        raise bind_error(role, where, e) from None
    for server in metrics.servers:
        thread = threading.Thread(target=server.serve_forever, name=f"colibri-{role.replace(' ', '-')}", daemon=True)
        thread.start()
        metrics.threads.append(thread)
    return metrics
