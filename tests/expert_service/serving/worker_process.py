"""`colibri worker` as a real process, for the lifecycle, auth and soak tests: start it, probe its health the
way the kubelet does, call it with a token."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb import worker_pb2_grpc
from tests.helpers import free_port  # noqa: F401 (re-exported: the worker process tests take it from here)

SERVING = health_pb2.HealthCheckResponse.SERVING


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "COLIBRI_WORKER_TOKEN")}
    return {**env, "LOG_FORMAT": "text", **extra}


def start_worker(model, *args: str, env: dict[str, str] | None = None, stderr=subprocess.PIPE) -> subprocess.Popen:
    """`colibri worker` on the CPU backend with small KV and warm-up, plus `args`."""
    cmd = [
        sys.executable,
        "-m",
        "colibri.cli",
        "worker",
        "--model",
        str(model),
        "--backend",
        "cpu",
        "--kv-block-size",
        "4",
        "--kv-cache-tokens",
        "4096",
        "--warmup-tokens",
        "8",
        "--metrics-port",
        "0",
        *args,
    ]
    return subprocess.Popen(cmd, env=env or worker_env(), stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def health_status(target: str, service: str = "", timeout: float = 2.0) -> int | None:
    """The status of `service` at `target` (None when nothing answers): a kubelet gRPC probe."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
            return reply.status
    except grpc.RpcError:
        return None


def wait_for(
    target: str, service: str = "colibri.readiness", timeout: float = 120.0, process: subprocess.Popen | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_status(target, service) == SERVING:
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process exited ({process.returncode}): {_stderr(process)}")
        time.sleep(0.1)
    raise AssertionError(f"{target} {service} never SERVING")


def _stderr(process: subprocess.Popen) -> str:
    try:
        return (process.communicate(timeout=5)[1] or "")[-2000:]
    except (subprocess.TimeoutExpired, ValueError):
        return ""


def stub(target: str, token: str | None = None):
    """(WorkerService stub, channel) sending `authorization: Bearer token` on every call."""
    channel = grpc.insecure_channel(target)
    if token:
        channel = grpc.intercept_channel(channel, _Bearer(token))
    return worker_pb2_grpc.WorkerServiceStub(channel), channel


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)
