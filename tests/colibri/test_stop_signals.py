"""`colibri router` and `colibri worker` stop with 0 and no traceback whenever SIGTERM or SIGINT comes: during their
imports and start-up (the default actions killed them: exit -15, or a KeyboardInterrupt traceback), and once they
are stopping (a signal after the drain, from a supervisor or a kill of every process, killed them the same way)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.expert_service.serving.worker_process import start_worker
from tests.helpers import LoggedProcess, free_port, serve_env


def start_router(*extra: str) -> LoggedProcess:
    """A router whose worker never comes (a closed port): it drains at once when asked."""
    cmd = [sys.executable, "-m", "colibri.cli", "router", "--worker", f"127.0.0.1:{free_port()}", "--host",
           "127.0.0.1", "--port", "0", "--metrics-port", "0", "--worker-retry-s", "0.1", *extra]  # fmt: skip
    return LoggedProcess(cmd, {**serve_env(), "LOG_FORMAT": "text"})


def signal_during_imports(process: subprocess.Popen, signum: int, timeout: float = 30.0) -> None:
    """Sends `signum` once gRPC's extension is mapped in the process: the service's own imports are under way,
    long before its event loop runs."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{process.pid}/maps") as f:
            if "cygrpc" in f.read():
                break
        assert process.poll() is None and time.monotonic() < deadline, "gRPC was never loaded"
        time.sleep(0.001)
    process.send_signal(signum)


def spam_until_exit(process: subprocess.Popen, signum: int, timeout: float = 30.0) -> int:
    """`signum` every 2 ms until the process exits: some land during its drain and stop, some after."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            process.send_signal(signum)
        except ProcessLookupError:
            break
        time.sleep(0.002)
    return process.wait(30)


def wait_logged(process: LoggedProcess, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in process.log(10**6):
        assert process.poll() is None and time.monotonic() < deadline, process.log()
        time.sleep(0.02)


def assert_clean(code: int, log: str) -> None:
    assert code == 0, log
    assert "Traceback" not in log and "Exception ignored" not in log and "KeyboardInterrupt" not in log, log


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_router_signalled_during_start_up_exits_0(signum):
    process = start_router()
    try:
        signal_during_imports(process, signum)
        assert_clean(process.wait(30), process.log(10**6))
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_router_signalled_again_and_again_while_it_stops_exits_0(signum):
    process = start_router()
    try:
        wait_logged(process, "router listening")
        assert_clean(spam_until_exit(process, signum), process.log(10**6))
    finally:
        if process.poll() is None:
            process.kill()


def _worker(model) -> subprocess.Popen:
    return start_worker(model, "--host", "127.0.0.1", "--port", str(free_port()))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_worker_signalled_during_start_up_exits_0(tiny_model, signum):
    process = _worker(tiny_model)
    try:
        signal_during_imports(process, signum)
        code = process.wait(30)
        assert_clean(code, process.communicate(timeout=10)[1])
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_worker_signalled_again_and_again_while_it_stops_exits_0(tiny_model, signum):
    process = _worker(tiny_model)
    try:
        seen: list[str] = []

        def log() -> str:
            return "".join(seen)

        # the worker logs little before it serves: read its lines as they come
        assert process.stderr is not None
        while "worker serving" not in log():
            line = process.stderr.readline()
            assert line, log()
            seen.append(line)
        code = spam_until_exit(process, signum)
        assert_clean(code, log() + process.stderr.read())
    finally:
        if process.poll() is None:
            process.kill()
