"""`colibri router --worker ADDR [--model DIR]`: the public gRPC server in front of one expert worker.

Serves GenerationService, grpc.health.v1 and server reflection, over TLS when configured (router_service/
security.py), optionally with health alone on a plaintext `--health-port` for kubelet probes, and with
`--http-port` the OpenAI-compatible HTTP API on the same event loop (router_service/http_api.py). Health services:
`colibri.liveness` answers SERVING while the process and its event loop run (the answer comes from the loop, so
a wedged loop fails the probe); "", `colibri.readiness` and the GenerationService name are SERVING while the
worker is connected and ready and we are not draining ("" is what load balancers and meshes check by default:
it must mean "this server will serve a request now"). SIGTERM: readiness NOT_SERVING at once, new requests
UNAVAILABLE, in-flight requests get `drain_timeout_s` to finish (the rest end UNAVAILABLE), then exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace

from common.config import add_flags, flag_values, load_config_file, resolve
from common.connection_limits import fit_open_files, grpc_connection_options
from common.errors import ConfigError
from common.grpc_connections import counted_server
from common.heap import freeze_startup_heap
from common.lifecycle import STOP_SIGNALS, settle_tasks
from common.listen_address import bind_failure, grpc_listen_address, host_port
from common.logging_setup import configure_logging
from common.metrics import MetricsServer, new_registry, start_metrics_server
from common.pb import router_pb2, router_pb2_grpc
from common.reflection import enable_reflection
from common.tracing import configure_tracing
from router_service.batching_loop import BatchingLoop
from router_service.chat import ChatTemplate
from router_service.config import RouterConfig
from router_service.frontend import Frontend
from router_service.observability import BatchingLoopHooks, ChainedHooks, QueueSpanHooks, router_metrics
from router_service.protocol import decode_guard
from router_service.security import public_interceptors, public_tokens, server_credentials, worker_token_source
from router_service.servicer import GenerationServicer
from router_service.tokenizer import Tokenizer
from router_service.worker_client import WorkerClient

if TYPE_CHECKING:  # imported where --http-port asks for it: aiohttp loads only then
    from prometheus_client import CollectorRegistry

    from router_service.http_api import HttpFront

log = logging.getLogger("colibri.router")
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
LIVENESS = ("colibri.liveness",)
READINESS = ("", "colibri.readiness", SERVICE_NAME)


class _HealthHooks(BatchingLoopHooks):
    """Mirrors the worker's readiness into grpc.health."""

    def __init__(self, router: Router):
        self._router = router

    def on_worker_state(self, ready: bool) -> None:
        self._router.set_serving(ready)


@dataclass
class Router:
    """A running router: its server, port, batching loop and health servicer."""

    server: grpc.aio.Server
    port: int
    batching_loop: BatchingLoop
    health: health.aio.HealthServicer
    worker: WorkerClient
    draining: bool = False
    health_server: grpc.aio.Server | None = None
    health_port: int = 0
    http: HttpFront | None = None  # when --http-port is set
    http_port: int = 0
    metrics_server: MetricsServer | None = None  # when a metrics registry and --metrics-port are given
    metrics_port: int = 0
    frontend: Frontend | None = None  # its chat-template render processes end with the router

    worker_ready: bool = False  # the worker's last reported state (readiness also needs not draining)
    _health_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    _health_updates: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)

    def set_serving(self, serving: bool) -> None:
        """Records the worker's state; readiness follows in a task (the hook is synchronous)."""
        self.worker_ready = serving
        task = asyncio.ensure_future(self._publish_readiness())
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _publish_readiness(self) -> None:
        """Sets readiness from the state as it is when the update runs, one update at a time: an update that
        was scheduled first but runs last cannot bring back a status that is no longer true (SERVING mid-drain)."""
        async with self._health_lock:
            serving = self.worker_ready and not self.draining
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in READINESS:
                await self.health.set(name, status)

    async def drain(self, timeout: float | None = None) -> bool:
        """Stops admitting, waits for in-flight requests (True if all finished in time). Liveness stays SERVING:
        a draining router is alive, and must not be restarted mid-drain."""
        self.draining = True
        await self._publish_readiness()
        self.batching_loop.start_draining()
        finished = await self.batching_loop.wait_idle(
            self.batching_loop.config.drain_timeout_s if timeout is None else timeout
        )
        if not finished:
            log.warning("drain timeout: %d requests still in flight end UNAVAILABLE", self.batching_loop.num_active)
        return finished

    async def stop(self, grace: float = 1.0) -> None:
        await self.batching_loop.stop()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.http is not None:
            await self.http.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self.frontend is not None and self.frontend.chat_renderer is not None:
            self.frontend.chat_renderer.close()
        await self.worker.close()


def _routing_planner(config: RouterConfig):
    """The static routing table, checked against the model before serving anything."""
    if not config.routing_table:
        return None
    if not config.model:
        raise ConfigError("routing_table: needs --model (the table is checked against the model)")
    from common.model_format import read_manifest_config
    from common.routing_table import RoutingTable, model_digest
    from router_service.routing import RoutingPlanner

    model_config, _ = read_manifest_config(config.model)
    table = RoutingTable.load(config.routing_table, model_config, model_digest(config.model))
    return RoutingPlanner(table, model_config.num_experts_per_tok)


async def start_router(
    config: RouterConfig,
    worker_address: str | None = None,
    tokenizer: Tokenizer | None = None,
    hooks: BatchingLoopHooks | None = None,
    metrics_registry: CollectorRegistry | None = None,
) -> Router:
    """Builds and starts the router (the batching loop connects to the worker in the background).

    `worker_address` overrides config.worker; `tokenizer` overrides the one from config.model. With
    config.port == 0 a free port is chosen: read it from the returned Router.port. `metrics_registry` is served
    on config.metrics_port (when set). Every file (model, template, tokens, TLS, routing table) is read before
    any port is bound: a bad file is its own one-line error, never hidden behind a port in use.
    """
    if worker_address:
        config = replace(config, worker=worker_address)
    if tokenizer is None and config.model:
        tokenizer = Tokenizer.from_model_dir(config.model)
    worker = WorkerClient(
        config.worker,
        max_message_bytes=config.worker_max_message_bytes,
        step_timeout_s=config.worker_step_timeout_s,
        token=worker_token_source(config),
    )
    tokens = public_tokens(config)
    tls = server_credentials(config)
    _fit_open_files(config)
    connections = grpc_connection_options(config.grpc_max_connections)
    server, grpc_connections = counted_server(
        lambda: grpc.aio.server(
            interceptors=public_interceptors(tokens),
            options=[
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                # Long-lived client connections get re-balanced across replicas behind a Service.
                ("grpc.max_connection_age_ms", 600_000),
                ("grpc.max_connection_age_grace_ms", int(config.request_timeout_s * 1000)),
                # gRPC's SO_REUSEPORT would let a second router on this port share it: it must fail instead
                ("grpc.so_reuseport", 0),
                *connections,
            ],
            maximum_concurrent_rpcs=config.max_concurrent_requests * 2 + 16,
        )
    )
    health_servicer = health.aio.HealthServicer()
    batching_loop = BatchingLoop(config, worker, tokenizer, planner=_routing_planner(config))
    router = Router(server, 0, batching_loop, health_servicer, worker)
    batching_loop.hooks = ChainedHooks(_HealthHooks(router), QueueSpanHooks(), *([hooks] if hooks is not None else []))
    batching_loop.hooks.on_grpc_connections("grpc", grpc_connections.gauge_value)
    model_name = config.model_name or (Path(config.model).name if config.model else "")
    frontend = Frontend(batching_loop, model_name, ChatTemplate.load(config.model, config.chat_template))
    router.frontend = frontend
    servicer = GenerationServicer(batching_loop, frontend=frontend)
    router_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [router_pb2.DESCRIPTOR.services_by_name["GenerationService"]])
    for name in LIVENESS:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    for name in READINESS:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if config.http_port:  # the OpenAI-compatible front, on this event loop, through the same frontend
        from router_service.http_api import HttpFront, ssl_context

        router.http = HttpFront(frontend, tokens, ssl_context(config))
    try:
        await _listen(router, config, tls, connections, metrics_registry)
    except BaseException:
        # a port that cannot be bound (or a signal) after others were: what was started is stopped, so no
        # listening socket, metrics thread or worker channel outlives the failed start-up
        await router.stop(grace=0)
        raise
    log.info(
        "router listening on %s (%s%s), worker %s",
        host_port(config.host, router.port),
        "mutual TLS" if config.tls_client_ca_file else "TLS" if tls else "plaintext",
        ", bearer tokens" if tokens.enabled else "",
        config.worker,
        extra={"health_port": router.health_port} if config.health_port else None,
    )
    return router


async def _listen(router: Router, config: RouterConfig, tls, connections, metrics_registry) -> None:
    """Binds and starts every listener, then the batching loop."""
    server, batching_loop, health_servicer = router.server, router.batching_loop, router.health
    if metrics_registry is not None and config.metrics_port:
        router.metrics_server = start_metrics_server(
            metrics_registry, config.metrics_port, config.metrics_host, role="router metrics"
        )
        router.metrics_port = router.metrics_server.server_port
        log.info("metrics on http://%s/metrics", host_port(config.metrics_host, router.metrics_port))
    router.port = _bind(server, "router gRPC", config.host, config.port, tls.credentials if tls is not None else None)
    if config.health_port:
        router.health_server, health_connections = counted_server(
            lambda: grpc.aio.server(interceptors=[decode_guard()], options=[("grpc.so_reuseport", 0), *connections])
        )
        batching_loop.hooks.on_grpc_connections("health", health_connections.gauge_value)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, router.health_server)
        router.health_port = _bind(router.health_server, "router health", config.host, config.health_port)
        await router.health_server.start()
    if router.http is not None:
        router.http_port = await router.http.start(config.host, config.http_port)
        log.info("OpenAI-compatible HTTP API on %s", host_port(config.host, router.http_port))
    await server.start()
    await batching_loop.start()


def _bind(server: grpc.aio.Server, role: str, host: str, port: int, credentials=None) -> int:
    """Adds a port (TLS with `credentials`); a port that cannot be bound is AddressInUseError naming role and
    address (exit code 7, which `colibri serve` does not restart on)."""
    address, port_wanted = grpc_listen_address(host, port), port
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if not port:
        raise bind_failure(role, host, port_wanted)
    return port


def _fit_open_files(config: RouterConfig) -> None:
    """Sizes the open-file limit for every port's connections at once (each cap alone would undercount)."""
    grpc_ports = 2 if config.health_port else 1
    http = config.http_max_connections if config.http_port else 0
    fit_open_files(grpc_ports * config.grpc_max_connections + http, "grpc_max_connections and http_max_connections")


async def serve(
    config: RouterConfig, hooks: BatchingLoopHooks | None = None, metrics_registry: CollectorRegistry | None = None
) -> int:
    """Serves until SIGTERM or SIGINT (one during start-up included), drains, exits 0. Further signals change
    nothing: a supervisor and a kill of every process may both send one, and the drain must not be cut short."""
    stop = asyncio.Event()
    STOP_SIGNALS.attach(asyncio.get_running_loop(), lambda _signum: stop.set())
    await asyncio.sleep(0)  # a signal kept since the process started is handed over now
    if stop.is_set():
        log.info("signal received before start-up: nothing to stop")
        STOP_SIGNALS.ignore()
        return 0
    router = await start_router(config, hooks=hooks, metrics_registry=metrics_registry)
    if not stop.is_set():
        freeze_startup_heap("router")
    await stop.wait()
    log.info("signal received: draining for up to %.0f s", config.drain_timeout_s)
    await router.drain()
    STOP_SIGNALS.ignore()  # the exit status is 0 now
    await router.stop()
    await settle_tasks()
    return 0


def _setup_observability(config: RouterConfig) -> tuple[BatchingLoopHooks, CollectorRegistry]:
    """JSON logs (LOG_FORMAT), the tracer provider (OTLP only when configured) and the metrics registry
    (start_router serves it on /metrics once the start-up files have been read)."""
    configure_logging("router", config.log_level)
    configure_tracing(os.environ.get("OTEL_SERVICE_NAME", "colibri-router"))
    model_name = config.model_name or (Path(config.model).name if config.model else "colibri")
    registry = new_registry()
    hooks, _ = router_metrics(model_name, -1, registry)
    return hooks, registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="JSON/YAML config file (its `router` section is used)")
    add_flags(parser, RouterConfig)


def run(args: argparse.Namespace) -> int:
    STOP_SIGNALS.hold()
    config = resolve(
        RouterConfig, file_values=load_config_file(args.config, "router"), flags=flag_values(args, RouterConfig)
    )
    hooks, registry = _setup_observability(config)
    if getattr(args, "auth_token", None):
        log.warning(
            "--auth-token on the command line is visible to every local user (ps, /proc): use "
            "--auth-token-file or COLIBRI_AUTH_TOKEN"
        )
    try:
        return asyncio.run(serve(config, hooks, registry))
    finally:
        getattr(trace.get_tracer_provider(), "shutdown", lambda: None)()  # flush batched spans
