"""`colibri worker --model DIR`: the expert worker process (owns the model, the KV cache and the GPU).

Start-up: bind every endpoint first (a taken port fails in seconds, not after a model load), answer health
at once (liveness SERVING, readiness NOT_SERVING), load and verify the model, warm up, then readiness
SERVING. SIGTERM/SIGINT: readiness NOT_SERVING, new streams and new sequences refused, the sequences held
by the router's streams keep stepping until they are done or `drain_timeout_s` passes, then exit 0 (a second
signal skips the rest of the drain). A worker fault exits 1. docs/security.md says who may call it.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2_grpc

from common.auth import HEALTH_PREFIX, REFLECTION_PREFIX, BearerAuthInterceptor, Refusal, TokenSet
from common.auth import WORKER_TOKEN_ENV as TOKEN_ENV
from common.config import (
    LOG_LEVEL_ENV,
    WORKER_MAX_MESSAGE_BYTES,
    add_flags,
    check_distinct_ports,
    check_message_limit,
    env_value,
    flag_values,
    load_process_config,
    resolve,
    setting,
)
from common.connection_limits import MAX_CONNECTIONS, fit_open_files, grpc_connection_options
from common.errors import ColibriError, ConfigError
from common.grpc_connections import counted_server
from common.grpc_guard import MalformedRequestGuard
from common.heap import freeze_startup_heap
from common.lifecycle import STOP_SIGNALS, settle_tasks
from common.listen_address import ADDRESS_HELP, bind_address_problem, host_port
from common.logging_setup import configure_logging
from common.metrics import WorkerMetrics, new_registry, start_metrics_server
from common.model_format import ModelDir
from common.model_identity import TOKENIZER, ModelDigests, vocabulary_digest
from common.pb import worker_pb2
from common.reflection import enable_reflection
from common.tracing import ServerTracingInterceptor, check_tracing_env, configure_tracing
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import Engine
from expert_service.experts.routing_plan import check_plan_table
from expert_service.experts.slots import plan_slots
from expert_service.serving.endpoints import SERVER_OPTIONS, bind_socket, bind_tcp, is_loopback
from expert_service.serving.lifecycle import WorkerHealth, close_engine, quiet_cancelled_streams, watch_parent
from expert_service.serving.servicer import SERVICE_NAME, WorkerServicer, add_to_server
from expert_service.serving.step_stream import UNARY

log = logging.getLogger("colibri.worker")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    host: str = setting(
        "127.0.0.1",
        f"address to bind the worker's gRPC port (loopback: only the router sidecar should reach it): {ADDRESS_HELP}",
        env=("COLIBRI_WORKER_HOST",),
    )
    port: int = setting(
        50052, "worker gRPC port (0 = pick a free one); unused with --socket", env=("COLIBRI_WORKER_PORT",)
    )
    socket: str = setting(
        "",
        "serve the RPCs on this Unix socket instead of TCP (absolute path of at most 107 bytes; created with "
        "mode 0600 in an existing directory; a stale socket file is replaced)",
        env=("COLIBRI_WORKER_SOCKET",),
    )
    health_port: int = setting(
        0,
        "plaintext TCP port answering only grpc.health.v1 (for kubelet probes when "
        "the RPCs are on a Unix socket); 0 = off",
        env=("COLIBRI_WORKER_HEALTH_PORT",),
    )
    health_host: str = setting(
        "::",
        f"address of the health-only port (probes reach the pod IP): {ADDRESS_HELP}",
        env=("COLIBRI_WORKER_HEALTH_HOST",),
    )
    metrics_port: int = setting(9091, "worker Prometheus /metrics port; 0 = off", env=("COLIBRI_WORKER_METRICS_PORT",))
    metrics_host: str = setting(
        "127.0.0.1",
        f"address of the /metrics port (:: to let Prometheus scrape it from outside the host or pod): {ADDRESS_HELP}",
        env=("COLIBRI_WORKER_METRICS_HOST",),
    )
    auth_token_file: str = setting(
        "",
        f"file of accepted bearer tokens, one per line, re-read when it "
        f"changes (or one token in env {TOKEN_ENV}); callers send "
        f"`authorization: Bearer TOKEN`",
        env=("COLIBRI_WORKER_TOKEN_FILE",),
    )
    allow_unauthenticated: bool = setting(
        False,
        "serve a non-loopback TCP address without a token (refused otherwise)",
        env=("COLIBRI_WORKER_ALLOW_UNAUTHENTICATED",),
    )
    drain_timeout_s: float = setting(
        30.0,
        "on SIGTERM/SIGINT, seconds the sequences held get to finish (new ones are refused)",
        env=("COLIBRI_WORKER_DRAIN_TIMEOUT",),
    )
    model_name: str = setting(
        "", "served model name (default: the model directory's name)", env=("COLIBRI_MODEL_NAME", "MODEL_ID")
    )
    step_timeout_s: float = setting(
        300.0,
        "watchdog: a step running longer is a worker fault (liveness fails too); keep it below the router's "
        "worker_step_timeout_s",
        env=("COLIBRI_STEP_TIMEOUT_S",),
    )
    max_message_bytes: int = setting(
        WORKER_MAX_MESSAGE_BYTES,
        "largest gRPC message either way (Info reports it: the router keeps each step under it)",
        env=("COLIBRI_MAX_MESSAGE_BYTES",),
    )
    warmup_tokens: int = setting(64, "prompt tokens of the start-up warm-up step", env=("COLIBRI_WARMUP_TOKENS",))
    grpc_max_connections: int = setting(
        64,
        "connections open at once on the RPC port or socket, and apart on the health port (idle ones and ones "
        "still in their handshake included; a router holds one); past it a new connection is closed as it opens. "
        "The open-file limit is raised to fit it when the hard limit allows",
        env=("COLIBRI_WORKER_GRPC_MAX_CONNECTIONS",),
    )
    parent_pid: int = setting(0, "exit when this process is gone (set by `colibri serve`)", flag="parent-pid")
    log_level: str = setting("INFO", "log level", env=LOG_LEVEL_ENV)

    def __post_init__(self):
        for name in ("port", "metrics_port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name}: must be in [0, 65535], got {getattr(self, name)}")
        for name in ("host", "health_host", "metrics_host"):  # a typo would surface only as a port not bound
            if problem := bind_address_problem(getattr(self, name)):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)!r} {problem}")
        check_distinct_ports(
            "",
            {
                "port": (self.host, 0 if self.socket else self.port),
                "health_port": (self.health_host, self.health_port),
                "metrics_port": (self.metrics_host, self.metrics_port),
            },
        )
        if not self.step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s: must be > 0, got {self.step_timeout_s}")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        check_message_limit("max_message_bytes:", self.max_message_bytes)
        if not 1 <= self.grpc_max_connections <= MAX_CONNECTIONS:
            raise ConfigError(
                f"grpc_max_connections: must be in [1, {MAX_CONNECTIONS}], got {self.grpc_max_connections}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="Colibri model directory")
    parser.add_argument("--config", metavar="FILE", help="JSON/YAML file with `worker:` and `engine:` sections")
    add_flags(parser, WorkerConfig)
    add_flags(parser, EngineConfig)


def worker_tokens(auth_token_file: str) -> TokenSet:
    """The tokens the worker accepts: the file's and the one in TOKEN_ENV, each refused at start-up (ConfigError
    naming the file or variable) when gRPC metadata could not carry it."""
    return TokenSet(auth_token_file, os.environ.get(TOKEN_ENV, ""), TOKEN_ENV)


def worker_interceptors(tokens: TokenSet, tracer_provider=None) -> list[grpc.aio.ServerInterceptor]:
    """Auth first (an unauthenticated caller's bytes are never parsed; health and reflection are exempt: probes
    carry no token), then the guard against bytes that do not parse, then tracing."""
    refusal = Refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")
    auth = [BearerAuthInterceptor(tokens, refusal, (HEALTH_PREFIX, REFLECTION_PREFIX))] if tokens else []
    # The router polls Health about once a second outside any request: each poll would be a root span.
    tracing = ServerTracingInterceptor(
        tracer_provider, exclude_prefixes=("/grpc.health.", "/grpc.reflection.", f"/{SERVICE_NAME}/Health")
    )
    return [*auth, MalformedRequestGuard(), tracing]


def check_exposure(config: WorkerConfig, tokens: TokenSet) -> None:
    """Refuses an unauthenticated worker that other hosts can reach."""
    if config.socket or tokens or is_loopback(config.host):
        if not config.socket and not tokens:
            log.warning(
                "the worker on %s:%d has no token: every local process can call it (give "
                "--auth-token-file or %s, or use --socket)",
                config.host,
                config.port,
                TOKEN_ENV,
            )
        return
    if not config.allow_unauthenticated:
        raise ConfigError(
            f"host: refusing to serve {config.host}:{config.port} (not loopback) without a token; "
            f"give --auth-token-file or {TOKEN_ENV}, use --socket, or pass --allow-unauthenticated "
            f"true"
        )
    log.warning("the worker serves %s:%d without a token (--allow-unauthenticated)", config.host, config.port)


def _in_daemon_thread(fn, *args) -> asyncio.Future:
    """`fn(*args)` on a thread of its own that never holds up the process's exit (a model load)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="colibri-load", daemon=True).start()
    return asyncio.wrap_future(future)


async def _unless_stopped(work: asyncio.Future, stop: asyncio.Event):
    """The result of `work`, or None when `stop` comes first (the work is then left to the daemon thread)."""
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if work.done():
        return work.result()
    work.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits for it any more
    return None


# How long the servers' stop waits for calls still answering (a call a fault failed sending its INTERNAL) before
# cancelling them: half a second was not always enough on a loaded machine, and the call then read as a lost worker.
STOP_GRACE_S = 2.0


async def _drain(servicer: WorkerServicer, timeout: float, hurry: asyncio.Event) -> None:
    """Waits while the router's streams still hold sequences (they keep stepping), up to `timeout`."""
    servicer.health.update(draining=True)

    def held() -> int:
        return sum(owner != UNARY for owner in list(servicer.sequence_owners.values()))

    if not held():
        return
    log.info("draining: %d sequences held, up to %.0f s", held(), timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while held() and servicer.open_streams and not hurry.is_set():
        if loop.time() >= deadline:
            log.warning("drain timeout: %d sequences still held end with the worker", held())
            return
        try:
            await asyncio.wait_for(hurry.wait(), 0.05)
        except TimeoutError:
            pass
    log.info("drained")


async def serve(
    model_dir: str,
    config: WorkerConfig,
    engine_config: EngineConfig,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int, WorkerServicer], None] | None = None,
    tracer_provider=None,
    freeze_heap: bool = False,
) -> int:
    """Serves until SIGTERM/SIGINT or `stop` (drain, then 0) or a worker fault (1). `on_ready(port,
    servicer)` runs once the worker is warm and SERVING (port 0 on a Unix socket); `tracer_provider` defaults
    to the process's (OTLP export only when configured); `freeze_heap`: the process is the worker's own (`colibri
    worker`), so what start-up left alive is frozen out of garbage collection before it turns SERVING
    (common/heap.py)."""
    loop = asyncio.get_running_loop()
    stop, hurry, exit_code = stop or asyncio.Event(), asyncio.Event(), [0]

    def on_signal() -> None:
        if stop.is_set():
            hurry.set()
        stop.set()

    STOP_SIGNALS.attach(loop, lambda _signum: on_signal())
    model = ModelDir.open(model_dir, verify=False)  # the structure, before anything binds; bytes below
    slot_plan = plan_slots(model, engine_config.expert_cache_gb, engine_config.expert_cache_slots)
    check_plan_table(model, engine_config, slot_plan.is_cached)  # loaded with the engine, after the bytes: told now
    digests = ModelDigests(model.digest, vocabulary_digest(model.path / TOKENIZER))  # what Info reports
    tokens = worker_tokens(config.auth_token_file)
    check_exposure(config, tokens)
    name = config.model_name or Path(model_dir).resolve().name
    registry = new_registry()
    metrics = WorkerMetrics(registry, name)
    owns_provider = tracer_provider is None
    tracer_provider = tracer_provider or configure_tracing("colibri-worker")

    def on_fatal(error: BaseException) -> None:
        exit_code[0] = 1
        hurry.set()
        stop.set()

    quiet_cancelled_streams()
    health = WorkerHealth(config.step_timeout_s)
    servicer = WorkerServicer(
        health, on_fatal, config.step_timeout_s, metrics, tracer_provider, max_message_bytes=config.max_message_bytes
    )
    connections = [*SERVER_OPTIONS, *grpc_connection_options(config.grpc_max_connections)]
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        *connections,
    ]
    server, rpc_connections = counted_server(
        lambda: grpc.aio.server(interceptors=worker_interceptors(tokens, tracer_provider), options=options)
    )
    metrics.worker_grpc_connections.set_function(rpc_connections.gauge_value)
    add_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    enable_reflection(server, [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]])
    servers, tasks, metrics_server, port = [server], [], None, 0
    fit_open_files(config.grpc_max_connections * (2 if config.health_port else 1), "grpc_max_connections")
    try:
        if config.socket:
            where = f"unix:{bind_socket(server, 'worker gRPC', config.socket)}"
        else:
            port = bind_tcp(server, "worker gRPC", config.host, config.port)
            where = host_port(config.host, port)
        if config.health_port:
            health_server, health_connections = counted_server(
                lambda: grpc.aio.server(interceptors=[MalformedRequestGuard()], options=connections)
            )
            metrics.worker_grpc_health_connections.set_function(health_connections.gauge_value)
            health_pb2_grpc.add_HealthServicer_to_server(health.servicer, health_server)
            bind_tcp(health_server, "worker health", config.health_host, config.health_port)
            servers.append(health_server)
        if config.metrics_port:
            metrics_server = start_metrics_server(
                registry, config.metrics_port, config.metrics_host, role="worker metrics"
            )
            metrics_port = metrics_server.server_port
            log.info("metrics on http://%s/metrics", host_port(config.metrics_host, metrics_port))
        for s in servers:
            await s.start()
        tasks.append(asyncio.create_task(health.watch(servicer.update_gauges)))
        if config.parent_pid:
            tasks.append(asyncio.create_task(watch_parent(config.parent_pid, stop)))
        log.info(
            "worker listening on %s%s; loading %s",
            where,
            f", health on {host_port(config.health_host, config.health_port)}" if config.health_port else "",
            model_dir,
        )

        def load() -> Engine:
            if engine_config.verify_checksums:
                # A bar only for a person at a terminal: one that fails to write (a full disk, a closed pipe)
                # leaves tqdm's lock held and its finalizer then hangs the process's exit.
                model.verify(progress=sys.stderr.isatty())
            return build_engine(model, engine_config, slot_plan)

        engine = await _unless_stopped(_in_daemon_thread(load), stop)
        if engine is None:
            return exit_code[0]
        servicer.attach(engine, name, digests)
        metrics.set_memory_plan(dict(servicer.memory_plan()))
        for item, num_bytes in servicer.memory_plan():
            log.info("memory plan: %s %.1f MiB", item, num_bytes / 2**20, extra={"item": item, "bytes": num_bytes})
        warm_ms = await _unless_stopped(
            loop.run_in_executor(servicer.executor, servicer.warmup, config.warmup_tokens), stop
        )
        if warm_ms is None:
            return exit_code[0]
        if freeze_heap:  # before the first step can arrive: the collection holds the interpreter while it runs
            freeze_startup_heap("worker")
        servicer.mark_ready()
        log.info(
            "worker serving %s on %s (backend %s, %d KV blocks of %d tokens, warm-up %.0f ms)",
            name,
            where,
            engine.backend,
            engine.allocator.num_blocks,
            engine_config.kv_block_size,
            warm_ms,
            extra={"port": port},
        )
        if on_ready is not None:
            on_ready(port, servicer)
        await stop.wait()
        if exit_code[0] == 0:
            await _drain(servicer, config.drain_timeout_s, hurry)
        return exit_code[0]
    except Exception as e:
        # The record below names the code the process exits with: the CLI's for an expected error, else 1.
        exit_code[0] = e.exit_code if isinstance(e, ColibriError) else 1
        raise
    finally:
        STOP_SIGNALS.ignore()  # the exit status is decided: a late signal must not turn it into death by signal
        health.update(draining=True)
        servicer.end_streams()
        for s in servers:  # the grace lets a call failed by a fault answer INTERNAL before the rest are cancelled
            await s.stop(STOP_GRACE_S)
        for task in tasks:
            task.cancel()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        servicer.executor.shutdown()
        await close_engine(servicer.engine, servicer.executor)
        if owns_provider:
            tracer_provider.shutdown()
        await settle_tasks()
        log.info("worker stopped", extra={"exit_code": exit_code[0]})


def refuse_port_beside_socket(port_named: str, socket_flag: str | None, socket: str) -> None:
    """A TCP port given as a flag (`port_named`, '--port 5'; empty: none) beside a socket from any source: the worker
    took the socket and left the port unused, so a router dialling the port waited for ever."""
    if not port_named or not socket:
        return
    socket_env = next(f for f in dataclasses.fields(WorkerConfig) if f.name == "socket").metadata["env"]
    if socket_flag:
        source = "--socket"
    elif (found := env_value(socket_env)) is not None:
        source = f"environment {found[0]}"
    else:
        source = "--config's socket"
    raise ConfigError(f"{port_named} and {source} {socket} exclude each other: the worker listens on one or the other")


def run(args: argparse.Namespace) -> int:
    STOP_SIGNALS.hold()
    file_values = load_process_config(args.config, {"worker": WorkerConfig, "engine": EngineConfig})
    config = resolve(WorkerConfig, file_values=file_values["worker"], flags=flag_values(args, WorkerConfig))
    engine_config = resolve(EngineConfig, file_values=file_values["engine"], flags=flag_values(args, EngineConfig))
    refuse_port_beside_socket("" if args.port is None else f"--port {args.port}", args.socket, config.socket)
    configure_logging("colibri-worker", config.log_level)
    check_tracing_env()  # before the model loads, as the other settings are
    return asyncio.run(serve(args.model, config, engine_config, freeze_heap=True))
