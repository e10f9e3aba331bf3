"""A worker whose stderr cannot be written (a full disk, a log reader gone) still serves and still exits on
SIGTERM: a failed log or progress write must not wedge it (health would stay down, and no supervisor restarts a
process that never exits)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.expert_service.serving.worker_process import free_port, start_worker, wait_for


@pytest.fixture(params=["dev-full", "closed-pipe"])
def unwritable_stderr(request):
    if request.param == "dev-full":
        with open("/dev/full", "w") as full:
            yield full
        return
    reader, writer = os.pipe()
    os.close(reader)  # every write now fails with EPIPE
    yield writer
    os.close(writer)


def test_worker_serves_and_stops_with_stderr_unwritable(tiny_model, unwritable_stderr):
    port = free_port()
    process = start_worker(tiny_model, "--port", str(port), stderr=unwritable_stderr)
    try:
        wait_for(f"127.0.0.1:{port}", "colibri.readiness", timeout=120, process=process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
