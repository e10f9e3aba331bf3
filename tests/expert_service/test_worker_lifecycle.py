"""The worker process's lifecycle: liveness vs readiness, the drain on SIGTERM (held sequences finish, new
ones are refused), bind failures that name the role and address, gauges that follow every free."""
from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from common.pb import worker_pb2 as pb
from expert_service.lifecycle import ModelThread, WorkerHealth
from tests.expert_service.worker_process import (SERVING, free_port, health_status, start_worker, stub, wait_for,
                                                 worker_env)
from tests.helpers import BackgroundWorker

GREEDY = pb.SamplingParams(top_p=1.0)
NOT_SERVING = 2


def test_liveness_follows_the_model_thread_readiness_the_warm_model():
    health = WorkerHealth(watchdog_s=0.2)
    assert health.is_live() and not health.is_ready()        # loading: alive, not ready
    health.model_thread = ModelThread()
    health.update(ready=True)
    assert health.is_ready()
    release = threading.Event()
    health.model_thread.submit(release.wait)
    time.sleep(0.4)                                           # a job past the watchdog: wedged
    assert not health.is_live() and not health.is_ready()
    release.set()
    time.sleep(0.05)
    assert health.is_live() and health.is_ready()
    health.update(draining=True)
    assert health.is_live() and not health.is_ready()
    health.update(failed=True)
    assert not health.is_live()
    health.model_thread.shutdown()


class Stream:
    """A step stream the test feeds one request at a time."""

    def __init__(self, worker_stub):
        self.requests: queue.Queue = queue.Queue()
        self.call = worker_stub.StepStream(iter(self.requests.get, None))

    def step(self, request: pb.StepStreamRequest) -> pb.StepStreamResponse:
        self.requests.put(request)
        return next(self.call)

    def close(self) -> None:
        self.requests.put(None)


def _errors(response) -> dict[int, str]:
    return {e.request_id: e.code for e in response.errors}


def test_sigterm_drains_held_sequences_and_refuses_new_ones(tiny_model, tmp_path):
    sock, health_port = tmp_path / "w.sock", free_port()
    process = start_worker(tiny_model, "--socket", str(sock), "--health-port", str(health_port),
                           "--drain-timeout-s", "60", env=worker_env(COLIBRI_WORKER_TOKEN="t0k3n"))
    probe = f"127.0.0.1:{health_port}"
    try:
        wait_for(probe, "colibri.readiness", process=process)
        worker, channel = stub(f"unix:{sock}", "t0k3n")
        held = Stream(worker)
        first = held.step(pb.StepStreamRequest(step_id=1, chunks=[pb.PrefillChunk(
            request_id=1, token_ids=[5, 6, 7], sampling=GREEDY, is_last=True)]))
        assert not first.step_error and not first.errors
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while health_status(probe, "colibri.readiness") != NOT_SERVING:
            assert time.monotonic() < deadline, "readiness still SERVING while draining"
            time.sleep(0.05)
        assert health_status(probe, "colibri.liveness") == SERVING and health_status(probe, "") == SERVING
        with pytest.raises(grpc.RpcError) as e:                 # a new stream: refused
            next(worker.StepStream(iter([pb.StepStreamRequest(step_id=1)]), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not worker.Health(pb.HealthRequest(), timeout=10).ready
        one = np.array([1], "<u8").tobytes()
        mixed = held.step(pb.StepStreamRequest(step_id=2, decode_request_ids=one, chunks=[pb.PrefillChunk(
            request_id=2, token_ids=[8], sampling=GREEDY, is_last=True)]))
        assert _errors(mixed) == {2: "DRAINING"}                 # a new sequence: refused, the held one steps on
        for step_id in range(3, 30):
            assert not _errors(held.step(pb.StepStreamRequest(step_id=step_id, decode_request_ids=one)))
        assert process.poll() is None                           # still serving the held sequence
        held.step(pb.StepStreamRequest(step_id=30, free_request_ids=one))
        held.close()
        channel.close()
        assert process.wait(20) == 0
        assert "drained" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_drain_timeout_and_a_second_signal_end_the_drain(tiny_model, tmp_path):
    for extra, signals, limit in ((["--drain-timeout-s", "1"], 1, 15.0), (["--drain-timeout-s", "120"], 2, 15.0)):
        sock = tmp_path / f"w{signals}.sock"
        process = start_worker(tiny_model, "--socket", str(sock), *extra)
        try:
            wait_for(f"unix:{sock}", "colibri.readiness", process=process)
            worker, channel = stub(f"unix:{sock}")
            held = Stream(worker)       # holds a sequence and never frees it
            held.step(pb.StepStreamRequest(step_id=1, chunks=[pb.PrefillChunk(
                request_id=9, token_ids=[5], sampling=GREEDY, is_last=True)]))
            started = time.monotonic()
            for _ in range(signals):
                process.send_signal(signal.SIGTERM)
                time.sleep(0.3)
            assert process.wait(limit) == 0
            assert time.monotonic() - started < limit
            held.close()
            channel.close()
        finally:
            if process.poll() is None:
                process.kill()


def _occupied_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("role", ["gRPC", "metrics", "health"])
def test_a_taken_port_names_the_role_and_address_and_exits_7(tiny_model, role):
    taken = _occupied_port()
    port = taken.getsockname()[1]
    flags = {"gRPC": ["--port", str(port)],
             "metrics": ["--port", "0", "--metrics-port", str(port)],
             "health": ["--port", "0", "--health-port", str(port), "--health-host", "127.0.0.1"]}[role]
    try:
        result = subprocess.run([sys.executable, "-m", "colibri.cli", "worker", "--model", str(tiny_model),
                                 "--backend", "cpu", "--metrics-port", "0", *flags], env=worker_env(),
                                capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert result.returncode == 7, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"colibri worker: error: worker {role} 127.0.0.1:{port} is in use"
    assert "Traceback" not in result.stderr


def test_gauges_follow_every_free(tiny_model):
    worker = BackgroundWorker(tiny_model).start()
    try:
        used = worker.servicer.metrics.kv_blocks_used
        s, channel = stub(worker.address)
        s.Prefill(pb.PrefillRequest(chunks=[pb.PrefillChunk(request_id=3, token_ids=list(range(5, 30)),
                                                            sampling=GREEDY, is_last=True)]), timeout=10)
        assert used._value.get() > 0
        s.FilterBatch(pb.FilterBatchRequest(), timeout=10)
        assert used._value.get() == 0                     # at once, no step needed
        held = Stream(s)
        held.step(pb.StepStreamRequest(step_id=1, chunks=[pb.PrefillChunk(request_id=4, token_ids=[5, 6],
                                                                          sampling=GREEDY, is_last=True)]))
        assert used._value.get() > 0
        held.step(pb.StepStreamRequest(step_id=2, free_request_ids=np.array([4], "<u8").tobytes()))
        assert used._value.get() == 0                     # a frees-only step
        held.step(pb.StepStreamRequest(step_id=3, chunks=[pb.PrefillChunk(request_id=5, token_ids=[5],
                                                                          sampling=GREEDY, is_last=True)]))
        held.close()
        deadline = time.monotonic() + 5
        while used._value.get() != 0:                     # the stream's end freed it
            assert time.monotonic() < deadline, used._value.get()
            time.sleep(0.05)
        channel.close()
    finally:
        worker.stop()
