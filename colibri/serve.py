"""`colibri serve --model DIR`: worker and router as two processes on this machine, for local use.

It plays the part Kubernetes plays in production: a worker that exits non-zero (a fault) is restarted
while the router keeps answering UNAVAILABLE; SIGTERM drains the router first, then stops the worker.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from common.config import add_flags, flag_name
from common.errors import ConfigError
from common.logging_setup import configure_logging
from expert_service.config import EngineConfig      # numpy-only: serve never loads numba itself
from router_service.config import RouterConfig

log = logging.getLogger("colibri.serve")
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="Colibri model directory")
    parser.add_argument("--config", metavar="FILE", help="JSON/YAML config file passed to both processes")
    parser.add_argument("--worker-port", type=int, default=0,
                        help="the worker's loopback gRPC port (default: a free port)")
    parser.add_argument("--worker-metrics-port", type=int, default=9091,
                        help="the worker's Prometheus /metrics port; 0 = off (default: 9091)")
    # The router caps its batch limits to the worker's (Info), so those two flags go to the worker only.
    add_flags(parser, RouterConfig, skip=("worker", "model", "max_batch_tokens", "max_batch_size"))
    add_flags(parser, EngineConfig)


def _flags_for(cls, args: argparse.Namespace) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None and "help" in f.metadata:
            out += [f"--{flag_name(f)}", str(value)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.worker_port = args.worker_port or free_port()
        common = ["--config", args.config] if args.config else []
        base = [sys.executable, "-m", "colibri.cli"]
        self.worker_cmd = base + ["worker", "--model", args.model, "--port", str(self.worker_port),
                                  "--metrics-port", str(args.worker_metrics_port), "--parent-pid", str(os.getpid()),
                                  *common, *_flags_for(EngineConfig, args)]
        self.router_cmd = base + ["router", "--worker", f"127.0.0.1:{self.worker_port}", "--model", args.model,
                                  *common, *_flags_for(RouterConfig, args)]
        self.stopping = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        worker = subprocess.Popen(self.worker_cmd)
        router = subprocess.Popen(self.router_cmd)
        restarts = 0
        log.info("serving %s: router pid %d, worker pid %d on 127.0.0.1:%d", self.args.model, router.pid,
                 worker.pid, self.worker_port)
        port = self.args.port or 50051
        print(f"colibri serve: the router answers on localhost:{port} once the worker is ready. Try:\n"
              f"  colibri generate --target localhost:{port} \"Hello\" --max-new-tokens 16\n"
              f"  grpcurl -plaintext -d '{{\"text\": \"Hello\"}}' localhost:{port} "
              f"colibri.router.v1.GenerationService/Generate", flush=True)
        while not self.stopping:
            time.sleep(0.2)
            if router.poll() is not None:
                log.log(logging.INFO if router.returncode == 0 else logging.ERROR,
                        "router exited with code %d; stopping the worker", router.returncode)
                self._stop(worker)
                return router.returncode or 1
            if worker.poll() is not None:
                code = worker.returncode
                if code == 0 or code in (2, 3, 4):    # stopped, or a config/model error a restart cannot fix
                    log.error("worker exited with code %d; stopping", code)
                    self._stop(router)
                    return code or 1
                delay = RESTART_BACKOFF_S[min(restarts, len(RESTART_BACKOFF_S) - 1)]
                log.warning("worker exited with code %d (fault); restarting in %.0f s", code, delay)
                time.sleep(delay)
                restarts += 1
                worker = subprocess.Popen(self.worker_cmd)
        # Drain: the router finishes in-flight requests (or its drain timeout passes), then the worker goes.
        self._stop(router)
        self._stop(worker)
        return 0

    @staticmethod
    def _stop(process: subprocess.Popen, timeout: float = 60.0) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run(args: argparse.Namespace) -> int:
    configure_logging("colibri-serve")
    if not os.path.isdir(args.model):
        raise ConfigError(f"--model: directory {args.model} not found")
    return Supervisor(args).run()
