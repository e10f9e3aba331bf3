"""`colibri serve` stopping: SIGTERM or Ctrl-C to every process at once loses no stream and exits 0, whatever
order the processes see it in (the supervisor late, during start-up, under CPU contention); a taken port is
not restarted; a worker failing at start-up is given up after a few tries; the token never shows in argv."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from colibri import serve as serve_module
from common.pb import router_pb2_grpc
from tests.colibri.test_serve import child_pids, free_port, request, wait_serving
from tests.helpers import LoggedProcess, serve_command, serve_env

pytestmark = pytest.mark.slow
TOKEN_ENV = "COLIBRI_WORKER_TOKEN"


def start_serve(model, *extra: str) -> tuple[LoggedProcess, int]:
    port = free_port()
    env = serve_env(TOKEN_ENV)
    process = LoggedProcess(
        serve_command(str(model), str(port), "--worker-retry-s", "0.1", *extra), {**env, "LOG_FORMAT": "text"}
    )
    return process, port


def stream_while_signalled(model, signum: int, serve_late_s: float = 0.0) -> None:
    """Four streams run; once each has a token, `signum` goes to the router and the worker, and to serve
    `serve_late_s` later: every stream completes and serve exits 0."""
    process, port = start_serve(model)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        wait_serving(channel)
        stub = router_pb2_grpc.GenerationServiceStub(channel)
        started = threading.Barrier(5)

        def generate(i: int) -> int:
            tokens = 0
            for n, message in enumerate(stub.GenerateStream(request([5 + i, 6, 7], 150), timeout=120)):
                tokens += len(message.token_ids)
                if n == 0:
                    started.wait(60)
            return tokens

        with ThreadPoolExecutor(4) as pool:
            results = [pool.submit(generate, i) for i in range(4)]
            started.wait(60)
            children = child_pids(process.pid)
            assert len(children) == 2
            for pid in children:
                os.kill(pid, signum)
            time.sleep(serve_late_s)
            process.send_signal(signum)
            assert [r.result(timeout=120) for r in results] == [150] * 4
        channel.close()
        code = process.wait(90)
        assert code == 0, process.log()
    finally:
        if process.poll() is None:
            process.kill()


def test_sigterm_to_every_process_at_once_loses_no_stream(tiny_model):
    stream_while_signalled(tiny_model, signal.SIGTERM)


def test_ctrl_c_to_every_process_loses_no_stream(tiny_model):
    stream_while_signalled(tiny_model, signal.SIGINT)


def test_children_stopping_before_serve_sees_the_signal_is_still_exit_0(tiny_model):
    """The supervisor descheduled on a busy machine: router and worker have stopped on the signal before
    serve runs its handler. Serve used to read that as the router failing (`0 or 1`) and exit 1."""
    stream_while_signalled(tiny_model, signal.SIGTERM, serve_late_s=1.5)


def test_sigterm_during_start_up_under_cpu_contention(tiny_model):
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for delay in (0.0, 0.2, 1.0, 2.5):  # after serve has started its children (it is running then)
            process, _ = start_serve(tiny_model)
            while not child_pids(process.pid):
                assert process.poll() is None, process.log(10**6)
                time.sleep(0.01)
            time.sleep(delay)
            children = child_pids(process.pid)
            process.send_signal(signal.SIGTERM)
            code = process.wait(90)
            assert code == 0, f"after {delay} s: exit {code}: {process.log(2000)}"
            for pid in children:  # no orphan left behind
                assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"child {pid} outlived serve"
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")
    except OSError:
        return True


def test_token_travels_in_the_environment_never_in_argv(tiny_model):
    process, port = start_serve(tiny_model)
    try:
        wait_serving(grpc.insecure_channel(f"127.0.0.1:{port}"))
        tokens = set()
        for pid in child_pids(process.pid):
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            token = env[TOKEN_ENV.encode()]
            assert len(token) >= 32
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert token not in f.read()
            tokens.add(token)
        assert len(tokens) == 1
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True).stdout
        assert tokens.pop() not in ps
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_a_taken_worker_port_is_not_restarted(tiny_model):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        process, _ = start_serve(tiny_model, "--worker-port", str(port))
        code = process.wait(90)
        stderr = process.log(10**6)
    finally:
        taken.close()
    assert code == 7, stderr[-2000:]
    assert f"colibri worker: error: worker gRPC 127.0.0.1:{port} is in use" in stderr
    assert "restarting" not in stderr


# --- the supervisor with stand-in children -------------------------------------------------------------------


def _supervisor(tmp_path, worker: str, router: str) -> serve_module.Supervisor:
    args = argparse.Namespace(
        model=str(tmp_path), config=None, worker_port=0, worker_metrics_port=0, port=0, drain_timeout_s=5.0
    )
    supervisor = serve_module.Supervisor(args)
    supervisor.worker_cmd = [sys.executable, "-c", worker]
    supervisor.router_cmd = [sys.executable, "-c", router]
    return supervisor


@pytest.fixture
def restore_signals():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


SLEEPER = "import time; time.sleep(120)"


@contextlib.contextmanager
def sigterm_when(condition, timeout: float, then: tuple[tuple[float, int], ...] = ()):
    """SIGTERM to this process (the supervisor under test) once `condition()` holds, or at `timeout` so a run
    that never gets there still ends; then each (delay, signal) of `then` that long after the one before; nothing
    is sent after the block has ended (a late signal would land in the next test)."""
    done = threading.Event()

    def watch():
        deadline = time.monotonic() + timeout
        while not done.is_set() and not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        for delay, sig in ((0.0, signal.SIGTERM), *then):
            if done.wait(delay):
                return
            os.kill(os.getpid(), sig)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def test_a_worker_failing_at_start_up_is_given_up(tmp_path, monkeypatch, restore_signals):
    monkeypatch.setattr(serve_module, "RESTART_BACKOFF_S", (0.05,))
    starts = tmp_path / "starts"
    supervisor = _supervisor(tmp_path, f"open({str(starts)!r}, 'a').write('x'); raise SystemExit(1)", SLEEPER)
    assert supervisor.run() == 1
    assert starts.read_text() == "x" * serve_module.MAX_FAILED_STARTS


def test_a_worker_killed_by_a_signal_is_logged_by_the_signal_name(tmp_path, monkeypatch, restore_signals, caplog):
    """A worker killed by SIGKILL was logged as 'exited with code -9'."""
    monkeypatch.setattr(serve_module, "RESTART_BACKOFF_S", (0.05,))
    supervisor = _supervisor(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", SLEEPER)
    with caplog.at_level(logging.INFO, logger="colibri.serve"):
        assert supervisor.run() == 1
    assert any(m.startswith("worker killed by SIGKILL after ") for m in caplog.messages), caplog.messages
    assert f"worker killed by SIGKILL, {serve_module.MAX_FAILED_STARTS} failures in a row; giving up" in caplog.messages
    assert not any("code -9" in m for m in caplog.messages)  # (a bare "-9" matches pytest-9 in a tmp path)


def test_a_healthy_period_resets_the_failure_count(tmp_path, monkeypatch, restore_signals):
    """Each run lasts past HEALTHY_AFTER_S before failing, so the count never grows: serve keeps restarting
    it until told to stop."""
    monkeypatch.setattr(serve_module, "RESTART_BACKOFF_S", (0.05,))
    monkeypatch.setattr(serve_module, "HEALTHY_AFTER_S", 0.2)
    starts = tmp_path / "starts"
    supervisor = _supervisor(
        tmp_path, f"import time; open({str(starts)!r}, 'a').write('x'); time.sleep(0.5); raise SystemExit(1)", SLEEPER
    )

    def count() -> int:
        return len(starts.read_text()) if starts.exists() else 0

    # Stop once more runs than MAX_FAILED_STARTS have been seen (however slow the box), not after a fixed time.
    with sigterm_when(lambda: count() > serve_module.MAX_FAILED_STARTS, timeout=120.0):
        assert supervisor.run() == 0
    assert count() > serve_module.MAX_FAILED_STARTS


def test_a_child_slow_to_exit_is_waited_for_and_a_second_signal_kills(tmp_path, restore_signals):
    # the signals go once the router has its SIGTERM handler (it writes `ready`): a router still starting on a
    # loaded machine died of the default action, serve returned 0 before the SIGINT, and that landed in the next test
    ready = tmp_path / "ready"
    signalled: list[float] = []

    def router_ready() -> bool:
        if ready.exists():
            signalled.append(time.monotonic())
            return True
        return False

    mark = f"open({str(ready)!r}, 'w').close()"
    slow = f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), sys.exit(0))); {mark}; time.sleep(120)"
    with sigterm_when(router_ready, timeout=60.0):
        assert _supervisor(tmp_path, SLEEPER, slow).run() == 0
    assert signalled and time.monotonic() - signalled[0] >= 1.4  # waited for the router's 1.5 s
    ready.unlink()
    signalled.clear()
    stubborn = f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); {mark}; time.sleep(120)"
    with sigterm_when(router_ready, timeout=60.0, then=((1.0, signal.SIGINT),)):
        assert _supervisor(tmp_path, SLEEPER, stubborn).run() == 128 + signal.SIGINT
    assert signalled and time.monotonic() - signalled[0] < 10


def test_a_signal_after_the_exit_status_is_decided_cannot_change_it(tmp_path, monkeypatch, restore_signals):
    """Python restores the default handlers while it shuts down; a SIGTERM sent late to every process could
    land then and kill serve (-15) after it had decided on 0. Once `run` returns, both signals are ignored."""

    class Decided:
        def __init__(self, args):
            pass

        def run(self) -> int:
            return 0

    monkeypatch.setattr(serve_module, "Supervisor", Decided)
    monkeypatch.setattr(serve_module, "configure_logging", lambda *_, **__: None)
    assert serve_module.run(argparse.Namespace(model=str(tmp_path))) == 0
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
