"""The served side of the serving benchmarks (bench/serve.py and its workloads): the models they serve, the worker
and router processes (commands, start, readiness, logs) and the machine's name."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.serve_clients import log  # noqa: E402
from common.pb import router_pb2 as rpb  # noqa: E402

ROUTER_READY = rpb.DESCRIPTOR.services_by_name["GenerationService"].full_name  # health names: ready to serve
WORKER_READY = "colibri.worker.v1.WorkerService"


def prepare_models(args, workdir: Path):
    """Yields (name, model directory) one at a time, each built just before it is measured (cuda: its experts in
    `args.expert_dtype` where the benchmark has that flag, else bf16)."""
    if args.model:
        yield Path(args.model).name, Path(args.model)
        return
    if args.backend == "cpu":
        from expert_service.tools.tiny_model import make_tiny

        yield "tiny", make_tiny(workdir / "models" / "tiny", family="mixtral", seed=0, progress=False)
        return
    import torch

    from bench.engine import SHAPES, build_hf, write_colibri

    for name in args.shapes.split(","):
        family, params = SHAPES[name]
        started = time.monotonic()
        hf = build_hf(family, params)
        model_dir = write_colibri(hf, workdir / "models" / name, expert_dtype=getattr(args, "expert_dtype", None))
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        log(f"{name}: built and converted in {time.monotonic() - started:.0f} s")
        yield name, model_dir
        shutil.rmtree(model_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(model_dir: Path, cfg: dict, port: int) -> list[str]:
    """`colibri worker` as `colibri serve --worker-port PORT` starts it (public flags only)."""
    return [
        sys.executable,
        "-m",
        "colibri.cli",
        "worker",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--parent-pid",
        str(os.getpid()),
        "--verify-checksums",
        "false",
        "--backend",
        cfg["backend"],
        "--kv-block-size",
        str(cfg["kv_block_size"]),
        "--kv-cache-tokens",
        str(cfg["kv_cache_tokens"]),
        *batch_flags(cfg),
        *(["--config", cfg["config_file"]] if cfg.get("config_file") else []),
    ]


def cuda_options_file(options: dict, workdir: Path) -> str | None:
    """A worker --config file whose engine section holds these CudaOptions fields (None when there are none)."""
    if not options:
        return None
    path = workdir / "worker-cuda-options.json"
    path.write_text(json.dumps({"worker": {}, "engine": {"cuda_options": options}}))
    return str(path)


def router_command(model_dir: Path, cfg: dict, worker_port: int, port: int, metrics_port: int, depth: int):
    return [
        sys.executable,
        "-m",
        "colibri.cli",
        "router",
        "--worker",
        f"127.0.0.1:{worker_port}",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--max-concurrent-requests",
        str(cfg["max_concurrent_requests"]),
        "--pipeline-depth",
        str(depth),
        *batch_flags(cfg),
    ]


def batch_flags(cfg: dict) -> list[str]:
    return ["--max-batch-tokens", str(cfg["max_batch_tokens"]), "--max-batch-size", str(cfg["max_batch_size"])]


class Process:
    """A service subprocess with its log file; stopped with SIGTERM (then killed) on exit."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, token: str):
        self.name, self.log_path = name, log_path
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            COLIBRI_WORKER_TOKEN=token,  # as `colibri serve` does
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        )
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the {self.name} exited with code {self.proc.returncode}:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_serving(target: str, process: Process, timeout: float, service: str) -> float:
    """Waits for `target`'s gRPC health check of `service` to say SERVING; returns the seconds waited."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    started = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - started < timeout:
            process.check()
            with contextlib.suppress(grpc.RpcError):
                if (
                    health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return time.monotonic() - started
            time.sleep(0.2)
    raise RuntimeError(f"the {process.name} at {target} is not SERVING after {timeout:.0f} s:\n{process.tail()}")


def device_name(backend: str) -> str:
    if backend == "cuda":  # torch, as bench/engine.py (the shapes are built with it)
        import torch

        return torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()}"
    return f"cpu: {platform.processor() or platform.machine()}"
