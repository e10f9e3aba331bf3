"""The worker listens on a TCP port or on a Unix socket: a --port flag beside a socket from the environment or the
config file was silently unused (the worker took the socket), so a router dialling the port waited for ever
(`COLIBRI_WORKER_SOCKET` set around `colibri serve --worker-port`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import free_port, serve_env


def _run(tmp_path, *flags: str, env: dict | None = None, command: str = "worker") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri.cli", command, "--model", str(tmp_path / "no-model"), *flags],
        env={**serve_env("COLIBRI_WORKER_SOCKET", "COLIBRI_WORKER_PORT"), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("source", ["environment", "config", "flag"])
def test_a_port_flag_beside_a_socket_is_refused_naming_both(tmp_path, source):
    sock = str(tmp_path / "w.sock")
    flags, env, named = ["--port", "47011", "--metrics-port", "0"], {}, f"--socket {sock}"
    if source == "environment":
        env, named = {"COLIBRI_WORKER_SOCKET": sock}, f"environment COLIBRI_WORKER_SOCKET {sock}"
    elif source == "config":
        (tmp_path / "c.yaml").write_text(f"worker:\n  socket: {sock}\n")
        flags, named = [*flags, "--config", str(tmp_path / "c.yaml")], f"--config's socket {sock}"
    else:
        flags = [*flags, "--socket", sock]
    done = _run(tmp_path, *flags, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"colibri worker: error: --port 47011 and {named} exclude each other: the worker listens on one or the other"
    )


def test_serve_refuses_a_worker_port_beside_a_socket_from_the_environment(tmp_path, tiny_model):
    sock, port = str(tmp_path / "w.sock"), free_port()
    done = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "serve", "--model", str(tiny_model), "--worker-port", str(port)],
        env={**serve_env(), "COLIBRI_WORKER_SOCKET": sock},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"colibri serve: error: --worker-port {port} and environment COLIBRI_WORKER_SOCKET {sock} exclude each "
        "other: the worker listens on one or the other"
    ]
