"""`colibri worker --model DIR`: the expert worker process (owns the model, the KV cache and the GPU)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import add_flags, flag_values, load_config_file, resolve, setting
from common.errors import ConfigError
from common.logging_setup import configure_logging
from common.metrics import WorkerMetrics, new_registry, start_metrics_server
from common.model_format import ModelDir
from common.pb import worker_pb2, worker_pb2_grpc
from common.tracing import ServerTracingInterceptor, configure_tracing
from expert_service.config import EngineConfig
from expert_service.engine import Engine
from expert_service.server import SERVICE_NAME, WorkerServicer

log = logging.getLogger("colibri.worker")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    host: str = setting("127.0.0.1", "address to bind the worker's gRPC port (loopback: only the router "
                        "sidecar should reach it)", env=("COLIBRI_WORKER_HOST",))
    port: int = setting(50052, "worker gRPC port (0 = pick a free one)", env=("COLIBRI_WORKER_PORT",))
    metrics_port: int = setting(9091, "worker Prometheus /metrics port; 0 = off",
                                env=("COLIBRI_WORKER_METRICS_PORT",))
    model_name: str = setting("", "served model name (default: the model directory's name)",
                              env=("COLIBRI_MODEL_NAME", "MODEL_ID"))
    step_timeout_s: float = setting(300.0, "watchdog: a step running longer is a worker fault",
                                    env=("COLIBRI_STEP_TIMEOUT_S",))
    max_message_bytes: int = setting(64 * 1024 * 1024, "largest gRPC message either way",
                                     env=("COLIBRI_MAX_MESSAGE_BYTES",))
    warmup_tokens: int = setting(64, "prompt tokens of the start-up warm-up step", env=("COLIBRI_WARMUP_TOKENS",))
    parent_pid: int = setting(0, "exit when this process is gone (set by `colibri serve`)", flag="parent-pid")
    log_level: str = setting("INFO", "log level", env=("COLIBRI_LOG_LEVEL", "LOG_LEVEL"))

    def __post_init__(self):
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name}: must be in [0, 65535], got {getattr(self, name)}")
        if self.step_timeout_s <= 0:
            raise ConfigError(f"step_timeout_s: must be > 0, got {self.step_timeout_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="Colibri model directory")
    parser.add_argument("--config", metavar="FILE", help="JSON/YAML file with `worker:` and `engine:` sections")
    add_flags(parser, WorkerConfig)
    add_flags(parser, EngineConfig)


async def serve(model_dir: str, config: WorkerConfig, engine_config: EngineConfig, *,
                stop: asyncio.Event | None = None, on_ready: Callable[[int, WorkerServicer], None] | None = None,
                tracer_provider=None) -> int:
    """Loads the model, serves until SIGTERM/SIGINT or `stop` (exit 0) or a worker fault (exit 1).
    `on_ready(port, servicer)` runs once the worker is warmed up and SERVING; `tracer_provider` defaults to
    the process's (OTLP export only when configured)."""
    model = ModelDir.open(model_dir, verify=engine_config.verify_checksums, progress=True)
    engine = Engine(model, engine_config)
    name = config.model_name or Path(model_dir).resolve().name
    registry = new_registry()
    metrics = WorkerMetrics(registry, name)
    owns_provider = tracer_provider is None
    tracer_provider = tracer_provider or configure_tracing("colibri-worker")
    stop = stop or asyncio.Event()
    exit_code = [0]

    def on_fatal(error: BaseException) -> None:
        exit_code[0] = 1
        stop.set()

    options = [("grpc.max_send_message_length", config.max_message_bytes),
               ("grpc.max_receive_message_length", config.max_message_bytes)]
    server = grpc.aio.server(interceptors=[ServerTracingInterceptor(tracer_provider)], options=options)
    health_servicer = health.HealthServicer()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = WorkerServicer(engine, health_servicer, name, on_fatal, config.step_timeout_s, metrics,
                              tracer_provider)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name, reflection.SERVICE_NAME,
         health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise ConfigError(f"port: cannot bind {config.host}:{config.port}")
    await server.start()
    metrics_server = None
    if config.metrics_port:
        metrics_server, _, metrics_port = start_metrics_server(registry, config.metrics_port)
        log.info("metrics on :%d/metrics", metrics_port)
    metrics.set_memory_plan(dict(servicer.memory_plan()))
    for item, num_bytes in servicer.memory_plan():
        log.info("memory plan: %s %.1f MiB", item, num_bytes / 2**20, extra={"item": item, "bytes": num_bytes})
    warm_ms = await asyncio.get_running_loop().run_in_executor(servicer.executor, servicer.warmup,
                                                               config.warmup_tokens)
    servicer.mark_ready()
    log.info("worker serving %s on %s:%d (backend %s, %d KV blocks of %d tokens, warm-up %.0f ms)", name,
             config.host, port, engine.backend, engine.allocator.num_blocks, engine_config.kv_block_size, warm_ms,
             extra={"port": port})
    if on_ready is not None:
        on_ready(port, servicer)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):   # not the main thread (tests)
            pass
    watch = asyncio.create_task(_watch_parent(config.parent_pid, stop)) if config.parent_pid else None
    await stop.wait()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=5.0)
    if watch:
        watch.cancel()
    if metrics_server is not None:
        metrics_server.shutdown()
    servicer.executor.shutdown(wait=False, cancel_futures=True)
    if owns_provider:
        tracer_provider.shutdown()
    log.info("worker stopped", extra={"exit_code": exit_code[0]})
    return exit_code[0]


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    """Exit with the process that started us (`colibri serve`), so no orphan keeps the GPU."""
    while not stop.is_set():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("parent process %d is gone; stopping", pid)
            stop.set()
            return
        await asyncio.sleep(1.0)


def run(args: argparse.Namespace) -> int:
    file_values = load_config_file(args.config, "worker")
    config = resolve(WorkerConfig, file_values=file_values, flags=flag_values(args, WorkerConfig))
    engine_config = resolve(EngineConfig, file_values=load_config_file(args.config, "engine"),
                            flags=flag_values(args, EngineConfig))
    configure_logging("colibri-worker", config.log_level)
    return asyncio.run(serve(args.model, config, engine_config))
