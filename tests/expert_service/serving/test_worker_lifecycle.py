"""The worker process's lifecycle: liveness vs readiness, the drain on SIGTERM (held sequences finish, new
ones are refused), bind failures that name the role and address, gauges that follow every free."""

from __future__ import annotations

import gc
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
from grpc_health.v1 import health_pb2 as pb_health

from common.pb import worker_pb2 as pb
from expert_service.serving.lifecycle import ModelThread, WorkerHealth
from expert_service.serving.servicer import WorkerServicer
from expert_service.serving.step_stream import MAX_STEPS_AHEAD, StepPump, StreamSession
from tests.expert_service.serving.worker_fuzz import LogWatcher
from tests.expert_service.serving.worker_process import (
    SERVING,
    free_port,
    health_status,
    start_worker,
    stub,
    wait_for,
    worker_env,
)
from tests.helpers import BackgroundWorker

GREEDY = pb.SamplingParams(top_p=1.0)
NOT_SERVING = 2


def _within(seconds: float, condition) -> bool:
    """Whether condition() holds at some poll within `seconds` (timing asserts that a loaded CI machine cannot
    fail by being slow, only by the condition never holding)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_liveness_follows_the_model_thread_readiness_the_warm_model():
    health = WorkerHealth(watchdog_s=0.2)
    assert health.is_live() and not health.is_ready()  # loading: alive, not ready
    health.model_thread = ModelThread()
    health.update(ready=True)
    assert health.is_ready()
    release = threading.Event()
    health.model_thread.submit(release.wait)
    time.sleep(0.4)  # a job past the watchdog: wedged (polled below: a loaded machine may start it late)
    assert _within(5.0, lambda: not health.is_live()) and not health.is_ready()
    release.set()
    assert _within(5.0, health.is_live) and health.is_ready()
    health.update(draining=True)
    assert health.is_live() and not health.is_ready()
    health.update(failed=True)
    assert not health.is_live()
    health.model_thread.shutdown()


def test_the_overall_health_name_means_ready_to_serve():
    """ "" is what balancers, meshes and grpc_health_probe check by default: SERVING only when a call would be
    served now; liveness keeps its own name."""
    health = WorkerHealth(watchdog_s=10.0)

    def status(service: str) -> int:
        return health.servicer.Check(pb_health.HealthCheckRequest(service=service), None).status

    assert (status(""), status("colibri.liveness")) == (NOT_SERVING, SERVING)  # loading
    health.update(ready=True)
    assert (status(""), status("colibri.liveness")) == (SERVING, SERVING)
    health.update(draining=True)
    assert (status(""), status("colibri.liveness")) == (NOT_SERVING, SERVING)


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
    process = start_worker(
        tiny_model,
        "--socket",
        str(sock),
        "--health-port",
        str(health_port),
        "--drain-timeout-s",
        "60",
        env=worker_env(COLIBRI_WORKER_TOKEN="t0k3n"),
    )
    probe = f"127.0.0.1:{health_port}"
    try:
        wait_for(probe, "colibri.readiness", process=process)
        worker, channel = stub(f"unix:{sock}", "t0k3n")
        held = Stream(worker)
        first = held.step(
            pb.StepStreamRequest(
                step_id=1, chunks=[pb.PrefillChunk(request_id=1, token_ids=[5, 6, 7], sampling=GREEDY, is_last=True)]
            )
        )
        assert not first.step_error and not first.errors
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while health_status(probe, "colibri.readiness") != NOT_SERVING:
            assert time.monotonic() < deadline, "readiness still SERVING while draining"
            time.sleep(0.05)
        assert health_status(probe, "colibri.liveness") == SERVING and health_status(probe, "") == NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:  # a new stream: refused
            next(worker.StepStream(iter([pb.StepStreamRequest(step_id=1)]), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not worker.Health(pb.HealthRequest(), timeout=10).ready
        one = np.array([1], "<u8").tobytes()
        mixed = held.step(
            pb.StepStreamRequest(
                step_id=2,
                decode_request_ids=one,
                chunks=[pb.PrefillChunk(request_id=2, token_ids=[8], sampling=GREEDY, is_last=True)],
            )
        )
        assert _errors(mixed) == {2: "DRAINING"}  # a new sequence: refused, the held one steps on
        for step_id in range(3, 30):
            assert not _errors(held.step(pb.StepStreamRequest(step_id=step_id, decode_request_ids=one)))
        assert process.poll() is None  # still serving the held sequence
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
            held = Stream(worker)  # holds a sequence and never frees it
            held.step(
                pb.StepStreamRequest(
                    step_id=1, chunks=[pb.PrefillChunk(request_id=9, token_ids=[5], sampling=GREEDY, is_last=True)]
                )
            )
            started = time.monotonic()
            for _ in range(signals):
                process.send_signal(signal.SIGTERM)
                time.sleep(0.3)
            assert process.wait(limit) == 0
            assert time.monotonic() - started < limit
            # The worker ends the stream itself before its server stops: cancelled by gRPC's core instead, it read
            # "Cancelling all calls" (or INTERNAL, a failed step to the router) and gRPC logged a traceback.
            with pytest.raises(grpc.RpcError) as ended:
                next(held.call)
            assert (ended.value.code(), ended.value.details()) == (
                grpc.StatusCode.UNAVAILABLE,
                "the worker is shutting down",
            )
            stderr = process.stderr.read()
            assert "Traceback" not in stderr and " ERROR " not in stderr, stderr
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
    flags = {
        "gRPC": ["--port", str(port)],
        "metrics": ["--port", "0", "--metrics-port", str(port)],
        "health": ["--port", "0", "--health-port", str(port), "--health-host", "127.0.0.1"],
    }[role]
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "colibri.cli",
                "worker",
                "--model",
                str(tiny_model),
                "--backend",
                "cpu",
                "--metrics-port",
                "0",
                *flags,
            ],
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        taken.close()
    assert result.returncode == 7, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"colibri worker: error: worker {role} 127.0.0.1:{port} is in use"
    assert "Traceback" not in result.stderr
    assert "worker stopped exit_code=7" in result.stderr  # the record tells the code the process exits with


def test_a_model_that_fails_to_load_is_logged_with_its_exit_code(tiny_model, tmp_path, caplog):
    """The worker's last record said exit_code 0 before the process exited 4 (or 2, 3, 7: any start-up error)."""
    import asyncio
    import logging
    import shutil

    from common.errors import ChecksumError
    from expert_service.engine.config import EngineConfig
    from expert_service.serving.main import WorkerConfig, serve

    model = shutil.copytree(tiny_model, tmp_path / "model")
    with open(model / "experts-L001.bin", "r+b") as f:
        f.seek(100)
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    config = WorkerConfig(port=0, metrics_port=0, warmup_tokens=4)
    with caplog.at_level(logging.INFO, logger="colibri.worker"), pytest.raises(ChecksumError):
        asyncio.run(serve(str(model), config, EngineConfig(backend="cpu", kv_cache_tokens=256)))
    [stopped] = [r for r in caplog.records if r.getMessage() == "worker stopped"]
    assert stopped.exit_code == ChecksumError.exit_code


def test_gauges_follow_every_free(tiny_model):
    worker = BackgroundWorker(tiny_model).start()
    try:
        used = worker.servicer.metrics.kv_blocks_used
        s, channel = stub(worker.address)
        s.Prefill(
            pb.PrefillRequest(
                chunks=[pb.PrefillChunk(request_id=3, token_ids=list(range(5, 30)), sampling=GREEDY, is_last=True)]
            ),
            timeout=10,
        )
        assert used._value.get() > 0
        s.FilterBatch(pb.FilterBatchRequest(), timeout=10)
        assert used._value.get() == 0  # at once, no step needed
        held = Stream(s)
        held.step(
            pb.StepStreamRequest(
                step_id=1, chunks=[pb.PrefillChunk(request_id=4, token_ids=[5, 6], sampling=GREEDY, is_last=True)]
            )
        )
        assert used._value.get() > 0
        held.step(pb.StepStreamRequest(step_id=2, free_request_ids=np.array([4], "<u8").tobytes()))
        assert used._value.get() == 0  # a frees-only step
        held.step(
            pb.StepStreamRequest(
                step_id=3, chunks=[pb.PrefillChunk(request_id=5, token_ids=[5], sampling=GREEDY, is_last=True)]
            )
        )
        held.close()
        deadline = time.monotonic() + 5
        while used._value.get() != 0:  # the stream's end freed it
            assert time.monotonic() < deadline, used._value.get()
            time.sleep(0.05)
        channel.close()
    finally:
        worker.stop()


def _decode_steps(first: int, count: int, request_id: int = 1) -> list[pb.StepStreamRequest]:
    return [
        pb.StepStreamRequest(step_id=i, decode_request_ids=np.array([request_id], "<u8").tobytes())
        for i in range(first, first + count)
    ]


def _prompt_step(request_id: int = 1) -> pb.StepStreamRequest:
    return pb.StepStreamRequest(
        step_id=1, chunks=[pb.PrefillChunk(request_id=request_id, token_ids=[5, 6, 7], sampling=GREEDY, is_last=True)]
    )


@pytest.mark.parametrize("run", range(4))  # the answer raced the servers' stop: a few runs, fresh workers
def test_a_fault_fails_its_stream_with_internal_and_is_logged_once(tiny_model, run):
    """A device fault in the fourth launch of a pipelined stream (steps launched behind others): the stream
    ends INTERNAL (a fault, not UNAVAILABLE, which the router would retry into the same fault), the fault is
    logged once however many calls waited on it, the steps queued behind it leave no unretrieved error, and
    the worker exits 1."""
    worker = BackgroundWorker(tiny_model).start()
    decoder = worker.engine.decoder
    decoder.supports_overlap = True
    launch, launches = decoder.launch, []

    def failing_launch(*args, **kwargs):
        launches.append(1)
        if len(launches) == 4:
            raise RuntimeError("device lost")
        return launch(*args, **kwargs)

    decoder.launch = failing_launch
    s, channel = stub(worker.address)
    with LogWatcher() as watcher:
        with pytest.raises(grpc.RpcError) as failed:
            list(s.StepStream(iter([_prompt_step()] + _decode_steps(2, 10)), timeout=30))
        assert worker.stop() == 1
        channel.close()
        gc.collect()  # an unretrieved future's error is logged when it is collected
        findings = watcher.take()
    assert failed.value.code() == grpc.StatusCode.INTERNAL, failed.value.details()
    assert len(findings) == 1 and "worker fault, exiting" in findings[0], findings


def test_a_stream_reads_no_further_than_max_steps_ahead_of_its_answers(tiny_model, monkeypatch):
    """A client that sends steps and does not read the answers: the worker stops reading the stream once
    MAX_STEPS_AHEAD steps wait for their answers (gRPC flow control then holds the client), so it never holds
    more than that many results, each with its logits on the cpu backend."""
    counts, submit, respond = (
        {"submitted": 0, "answered": 0, "most": 0},
        StepPump.submit,
        WorkerServicer._stream_response,
    )

    def counting_submit(self, step):
        counts["submitted"] += 1
        counts["most"] = max(counts["most"], counts["submitted"] - counts["answered"])
        return submit(self, step)

    def counting_response(self, outcome):
        counts["answered"] += 1
        return respond(self, outcome)

    monkeypatch.setattr(StepPump, "submit", counting_submit)
    monkeypatch.setattr(WorkerServicer, "_stream_response", counting_response)
    worker = BackgroundWorker(tiny_model).start()
    try:
        s, channel = stub(worker.address)
        call = s.StepStream(iter([_prompt_step()] + _decode_steps(2, 150)), timeout=60)
        first = next(call)
        time.sleep(1.0)  # the client reads nothing meanwhile
        answers = [first, *call]
        assert [a.step_id for a in answers] == list(range(1, 152)) and not any(a.errors for a in answers)
        assert counts["submitted"] == 151 and counts["most"] <= MAX_STEPS_AHEAD + 1, counts
        channel.close()
    finally:
        worker.stop()


def test_the_worker_gives_its_engine_back_when_it_stops(tiny_model):
    """The engine's copy threads (expert cache), device memory and pinned ranges are released on stop."""
    before = set(threading.enumerate())
    worker = BackgroundWorker(tiny_model, expert_cache_slots=2).start()
    assert any(t.name.startswith("colibri-expert-copy") for t in set(threading.enumerate()) - before)
    assert worker.stop() == 0
    deadline = time.monotonic() + 5
    while left := [t.name for t in set(threading.enumerate()) - before if t.name.startswith("colibri-expert")]:
        assert time.monotonic() < deadline, left
        time.sleep(0.05)


def test_a_caller_going_away_while_its_streams_close_runs_is_no_fault(tiny_model, monkeypatch):
    """The caller cancels the call after its last answer, while the worker frees the stream's sequences (slowed
    here): the close still runs and settles, the worker stays up and logs no error."""
    close = StreamSession.close

    def slow_close(self):
        time.sleep(0.5)
        close(self)

    monkeypatch.setattr(StreamSession, "close", slow_close)
    worker = BackgroundWorker(tiny_model).start()
    try:
        s, channel = stub(worker.address)
        with LogWatcher() as watcher:
            call = s.StepStream(iter([_prompt_step()] + _decode_steps(2, 2)), timeout=30)
            assert [next(call).step_id for _ in range(3)] == [1, 2, 3]
            time.sleep(0.2)  # the requests ended: the worker is in the stream's close
            call.cancel()
            time.sleep(0.6)
            gc.collect()
            assert not watcher.take()
        assert not worker.servicer.health.failed and worker.engine.allocator.num_used_blocks == 0
        assert s.ClearCache(pb.ClearCacheRequest(), timeout=10).freed_sequences == 0
        channel.close()
    finally:
        assert worker.stop() == 0


def test_the_metrics_address_is_logged_as_a_url(tiny_model, caplog):
    """The worker logged 'metrics on 127.0.0.1:P/metrics' where the router logs a URL: both log
    'metrics on http://HOST:PORT/metrics'."""
    import logging

    port = free_port()
    with caplog.at_level(logging.INFO, logger="colibri.worker"):
        BackgroundWorker(tiny_model, metrics_port=port).start().stop()
    assert f"metrics on http://127.0.0.1:{port}/metrics" in caplog.messages
