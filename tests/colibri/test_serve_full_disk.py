"""`colibri serve` with output it cannot write (a full disk, a closed pipe): it serves, and stops cleanly on
SIGTERM. Its start-up hint on stdout used to kill it (exit 1) before anything was served."""

from __future__ import annotations

import os
import signal
import subprocess

import grpc
import pytest

from tests.colibri.test_serve import wait_serving
from tests.helpers import free_port, serve_command, serve_env

pytestmark = pytest.mark.slow


@pytest.fixture(params=["stdout-closed-pipe", "stdout-and-stderr-dev-full"])
def unwritable(request):
    """(stdout, stderr) for serve."""
    if request.param == "stdout-closed-pipe":
        reader, writer = os.pipe()
        os.close(reader)  # every write now fails with EPIPE
        yield writer, subprocess.DEVNULL
        os.close(writer)
        return
    with open("/dev/full", "w") as full:
        yield full, full


def test_serve_serves_and_stops_with_output_unwritable(tiny_model, unwritable):
    stdout, stderr = unwritable
    port = free_port()
    env = serve_env()
    serve = subprocess.Popen(
        serve_command(str(tiny_model), str(port), "--worker-retry-s", "0.1"),
        env=env,
        stdout=stdout,
        stderr=stderr,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_serving(channel, timeout=120)
        assert serve.poll() is None
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(90) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
