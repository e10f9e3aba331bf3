"""`colibri serve --model DIR`: worker and router as two processes on this machine, for local use.

It plays the part Kubernetes plays in production:

- The router reaches the worker over a Unix socket in a private directory (mode 0700), and both processes
  get a random per-run token in their environment (COLIBRI_WORKER_TOKEN), never in argv (`ps` shows none).
- A worker that exits with a fault (1, or killed by a signal) is restarted with a growing delay while the
  router answers UNAVAILABLE; after MAX_FAILED_STARTS failures in a row serve gives up (exit 1); a worker that
  stayed up HEALTHY_AFTER_S starts the count again. Codes a restart cannot fix (2 configuration, 3/4 model,
  7 address in use) stop serve with that code.
- SIGTERM/SIGINT: the router drains first (its in-flight requests finish), then the worker stops; exit 0.
  A second signal kills both at once (exit 128 + signal). The children run in their own process group, so
  a terminal's Ctrl-C reaches serve alone and the stop runs in that order; were they signalled too, they
  drain on their own and serve still exits 0. They get SIGTERM if serve dies (Linux PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import signal
import sys

# A signal during the imports below (a second or more on a loaded machine) must not kill serve with the
# default action: it is recorded and the run ends at once with 0.
_EARLY_SIGNALS: list[int] = []
if sys.argv[1:2] == ["serve"]:
    for _sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_sig, lambda signum, _frame: _EARLY_SIGNALS.append(signum))

import argparse  # noqa: E402 (after the early handlers on purpose)
import ctypes  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from common.config import (  # noqa: E402
    LOG_LEVEL_ENV,
    add_flags,
    check_distinct_ports,
    env_value,
    flag_name,
    flag_values,
    load_process_config,
    resolve,
)
from common.errors import ConfigError  # noqa: E402
from common.listen_address import unix_socket_path_problem  # noqa: E402
from common.logging_setup import configure_logging  # noqa: E402
from expert_service.engine.config import (  # noqa: E402 (numpy-only: serve never loads numba itself)
    EngineConfig,
    RoutingMode,
)
from router_service.config import RouterConfig, step_timeouts_problem  # noqa: E402

log = logging.getLogger("colibri.serve")
TOKEN_ENV = "COLIBRI_WORKER_TOKEN"
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
MAX_FAILED_STARTS = 5
HEALTHY_AFTER_S = 60.0
NOT_RESTARTED = (2, 3, 4, 7)  # ConfigError, ModelFormatError, ChecksumError, AddressInUseError
STOP_MARGIN_S = 15.0  # beyond a child's drain timeout before it is killed
# Router settings serve gives the router itself.
ROUTER_SET_BY_SERVE = ("worker", "model")
# Router settings that are engine flags too: serve's parser has them once (as EngineConfig's), and their value goes
# to both processes. The router caps its batch limits to the worker's but never raises them, so a --max-batch-tokens
# given to the worker alone left the router's step budget at its own default.
ROUTER_AND_ENGINE = ("max_batch_tokens", "max_batch_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="Colibri model directory")
    parser.add_argument("--config", metavar="FILE", help="JSON/YAML config file passed to both processes")
    parser.add_argument(
        "--worker-port",
        type=int,
        default=0,
        help="serve the worker on this loopback TCP port instead of a private Unix socket (default: the socket)",
    )
    parser.add_argument(
        "--worker-metrics-port",
        type=int,
        default=9091,
        help="the worker's Prometheus /metrics port on 127.0.0.1; 0 = off (default: 9091)",
    )
    add_flags(parser, RouterConfig, skip=ROUTER_SET_BY_SERVE + ROUTER_AND_ENGINE)
    add_flags(parser, EngineConfig)


def _flags_for(cls, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None and "help" in f.metadata and f.name not in skip:
            out += [f"--{flag_name(f)}", str(value)]
    return out


def _die_with_parent_hook():
    """A preexec_fn asking Linux to SIGTERM the child when serve dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: nothing to load after
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.private_dir = Path(tempfile.mkdtemp(prefix="colibri-serve-"))  # mode 0700
        common = ["--config", args.config] if args.config else []
        base = [sys.executable, "-m", "colibri.cli"]
        if args.worker_port:
            # the host as a flag: one from the environment or the config file left the router dialling nobody
            listen = ["--host", "127.0.0.1", "--port", str(args.worker_port)]
            address = f"127.0.0.1:{args.worker_port}"
        else:
            sock = self.private_dir / "worker.sock"
            if (problem := unix_socket_path_problem(str(sock))) is not None:  # the path is serve's choice, not theirs
                shutil.rmtree(self.private_dir, ignore_errors=True)
                raise ConfigError(
                    f"the worker's socket {problem}: set TMPDIR to a shorter directory, or give --worker-port"
                )
            listen, address = ["--socket", str(sock)], f"unix://{sock}"
        self.worker_address = address
        self.worker_cmd = base + [
            "worker",
            "--model",
            args.model,
            *listen,
            "--metrics-port",
            str(args.worker_metrics_port),
            "--parent-pid",
            str(os.getpid()),
            *common,
            *_flags_for(EngineConfig, args),
        ]
        self.router_cmd = base + [
            "router",
            "--worker",
            address,
            "--model",
            args.model,
            *common,
            *_flags_for(RouterConfig, args, skip=ROUTER_SET_BY_SERVE),
        ]
        # One secret per run, for both children, in their environment only.
        self.env = {**os.environ, TOKEN_ENV: secrets.token_urlsafe(32)}
        self.router_port = args.port or 50051  # for the hint: run() puts the router's resolved port here
        self.router_stop_s = (args.drain_timeout_s or 30.0) + STOP_MARGIN_S
        self.worker_stop_s = 30.0 + STOP_MARGIN_S
        self.signals: list[int] = []
        self._preexec = _die_with_parent_hook()

    @property
    def stopping(self) -> bool:
        return bool(self.signals)

    def _on_signal(self, signum, _frame) -> None:
        self.signals.append(signum)

    def _spawn(self, cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=self.env, process_group=0, preexec_fn=self._preexec)

    def _sleep(self, seconds: float) -> None:
        """Sleeps in short slices, returning early once a signal has come."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.signals += _EARLY_SIGNALS
        try:
            if self.stopping:
                log.info("signal received before the processes started; nothing to stop")
                return 0
            return self._supervise()
        finally:
            shutil.rmtree(self.private_dir, ignore_errors=True)

    def _supervise(self) -> int:
        worker, router = self._spawn(self.worker_cmd), self._spawn(self.router_cmd)
        started, failed_starts = time.monotonic(), 0
        log.info(
            "serving %s: router pid %d, worker pid %d on %s",
            self.args.model,
            router.pid,
            worker.pid,
            self.worker_address,
        )
        port = self.router_port or "PORT"
        where = f"localhost:{port}" if self.router_port else "a free port (its 'router listening on' line names it)"
        _print_hint(
            f"colibri serve: the router answers on {where} once the worker is ready. Try:\n"
            f'  colibri generate --target localhost:{port} "Hello" --max-new-tokens 16\n'
            f'  grpcurl -plaintext -d \'{{"text": "Hello"}}\' localhost:{port} '
            f"colibri.router.v1.GenerationService/Generate"
        )
        while True:
            self._sleep(0.2)
            if self.stopping:  # checked before the children: one that exits on the same signal is no failure
                return self._shut_down(router, worker)
            if (code := router.poll()) is not None:
                log.log(logging.INFO if code == 0 else logging.ERROR, "router %s; stopping the worker", _ended(code))
                self._stop(worker, self.worker_stop_s)
                return _exit_status(code)
            code = worker.poll()
            if code is None:
                continue
            up_s = time.monotonic() - started
            if code == 0 or code in NOT_RESTARTED:  # stopped on its own signal, or a restart cannot help
                log.log(logging.INFO if code == 0 else logging.ERROR, "worker %s; stopping", _ended(code))
                self._stop(router, self.router_stop_s)
                return code
            failed_starts = 1 if up_s >= HEALTHY_AFTER_S else failed_starts + 1
            if failed_starts >= MAX_FAILED_STARTS:
                log.error("worker %s, %d failures in a row; giving up", _ended(code), failed_starts)
                self._stop(router, self.router_stop_s)
                return 1
            delay = RESTART_BACKOFF_S[min(failed_starts - 1, len(RESTART_BACKOFF_S) - 1)]
            log.warning(
                "worker %s after %.0f s (fault %d of %d in a row); restarting in %.0f s",
                _ended(code),
                up_s,
                failed_starts,
                MAX_FAILED_STARTS,
                delay,
            )
            self._sleep(delay)
            if not self.stopping:
                worker, started = self._spawn(self.worker_cmd), time.monotonic()

    def _shut_down(self, router: subprocess.Popen, worker: subprocess.Popen) -> int:
        """The router drains first, then the worker goes; exit codes the signal caused are not failures."""
        log.info("signal received: the router drains, then the worker stops")
        self._stop(router, self.router_stop_s)
        self._stop(worker, self.worker_stop_s)
        return 128 + self.signals[1] if len(self.signals) > 1 else 0

    def _stop(self, process: subprocess.Popen, timeout: float) -> None:
        """SIGTERM, then waits (a second signal to serve, or `timeout`, turns it into SIGKILL)."""
        if process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        deadline, seen = time.monotonic() + timeout, len(self.signals)
        while process.poll() is None:
            if len(self.signals) > max(seen, 1) or time.monotonic() >= deadline:
                log.warning("killing pid %d", process.pid)
                process.kill()
                process.wait()
                return
            time.sleep(0.05)


def _print_hint(text: str) -> None:
    """The start-up hint, for a person: a stdout that cannot take it (a full disk, a closed pipe) must not stop
    serve, which would leave its children behind."""
    try:
        print(text, flush=True)
    except OSError as e:
        log.warning("the start-up hint could not be written to stdout: %s", e.strerror or e)
        # The unwritten bytes stay buffered and would fail again at exit (status 120): stdout goes nowhere now.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _check_ports(args: argparse.Namespace, file_values: dict) -> RouterConfig:
    """The router's settings as it will resolve them (`file_values`: the config file's router section, environment,
    flags), and the ports of both children apart: a clash showed as one child's bind failing 'in use' (exit 7), as
    if another program held the port."""
    worker_port, worker_metrics_port = getattr(args, "worker_port", 0), getattr(args, "worker_metrics_port", 0)
    for flag, value in (("--worker-port", worker_port), ("--worker-metrics-port", worker_metrics_port)):
        if not 0 <= value <= 65535:
            raise ConfigError(f"{flag}: must be in [0, 65535], got {value}")
    flags = {**flag_values(args, RouterConfig), "worker": "127.0.0.1:1", "model": args.model}
    router = resolve(RouterConfig, file_values=file_values, flags=flags)
    check_distinct_ports(
        "",
        {
            **{"--" + name.replace("_", "-"): address for name, address in router.listeners().items()},
            "--worker-port": ("127.0.0.1", worker_port),  # the worker serves loopback; serve's router dials it
            "--worker-metrics-port": ("127.0.0.1", worker_metrics_port),
        },
    )
    return router


def _ended(code: int) -> str:
    """How a child ended, from its return code: 'exited with code N', or 'killed by SIGKILL' (a negative code)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _check_routing(args: argparse.Namespace, router: RouterConfig, file_values: dict) -> None:
    """A worker under routing=lut routes by the router's plans alone, and serve's router makes plans only from a
    routing table: without one it never takes the worker, and serve would start and stay not ready.
    `file_values`: the config file's engine section."""
    engine = resolve(EngineConfig, file_values=file_values, flags=flag_values(args, EngineConfig))
    if engine.routing is RoutingMode.LUT and not router.routing_table:
        raise ConfigError(
            "--routing lut needs --routing-table: the worker then takes each token's experts from the router's "
            "table, and the router has none"
        )


def _check_step_timeouts(args: argparse.Namespace, router: RouterConfig, file_values: dict) -> None:
    """A router step deadline the worker's watchdog outlasts is refused before either starts (the comparison and its
    reasons: router_service.config.step_timeouts_problem). `file_values`: the config file's worker section (serve
    passes the worker no watchdog flag)."""
    from expert_service.serving.main import WorkerConfig, refuse_port_beside_socket  # here: grpc's server parts

    port, metrics_port = getattr(args, "worker_port", 0), getattr(args, "worker_metrics_port", 0)  # as _check_ports
    listen = {"port": port} if port else {"socket": "serve's private socket"}
    flags = {**listen, "metrics_port": metrics_port}
    worker = resolve(WorkerConfig, file_values=file_values, flags=flags)
    refuse_port_beside_socket(f"--worker-port {port}" if port else "", None, worker.socket)
    if (problem := step_timeouts_problem(router.worker_step_timeout_s, worker.step_timeout_s)) is not None:
        raise ConfigError(problem)


def _exit_status(code: int) -> int:
    """A child's return code as serve's exit status (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def run(args: argparse.Namespace) -> int:
    # The level both children read: a bad one is refused here, before they start.
    name, level = env_value(LOG_LEVEL_ENV) or ("LOG_LEVEL", "INFO")
    configure_logging("colibri-serve", level, level_name=name)
    if not os.path.isdir(args.model):
        found = os.path.exists(args.model)
        raise ConfigError(
            f"--model: {args.model} is not a directory" if found else f"--model: directory {args.model} not found"
        )
    # the file both children read, checked before they start (and read once here for serve's own checks)
    from expert_service.serving.main import WorkerConfig  # here: loads grpc's server parts serve needs nowhere else

    sections = load_process_config(
        getattr(args, "config", None),
        {"router": RouterConfig, "worker": WorkerConfig, "engine": EngineConfig},
        sections_needed="serve gives it to both processes, and each reads its own sections",
    )
    router = _check_ports(args, sections["router"])
    _check_routing(args, router, sections["engine"])
    _check_step_timeouts(args, router, sections["worker"])
    supervisor = Supervisor(args)
    supervisor.router_port = router.port
    code = supervisor.run()
    # The exit status is decided. Python puts back the default handlers while it shuts down, so a signal that
    # arrives then (the operator's, sent late to every process) would turn a clean exit into death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return code
