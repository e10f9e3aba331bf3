"""Hostile and careless callers of the worker, over real gRPC: every RPC with random and structurally wrong
messages (and raw bytes through a generic call), boundary requests, and a cancel/disconnect storm on
StepStream. Each case asserts: a proper status for that call alone (OK, INVALID_ARGUMENT or
RESOURCE_EXHAUSTED, one line), no ERROR or traceback in the logs, the worker still serving, and the KV pool
whole again once nothing holds a sequence. Reproducible: hypothesis runs derandomized, without a database."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from tests.expert_service.serving.worker_fuzz import (
    SERVICE,
    UNARY_METHODS,
    LogWatcher,
    foreign_bytes,
    kv_problem,
    rpc_error_problem,
    stream_steps,
    unary_calls,
)
from tests.helpers import BackgroundWorker

FUZZ = settings(
    max_examples=120, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)
GREEDY = pb.SamplingParams(top_p=1.0)


@pytest.fixture(scope="module")
def fuzzed(tiny_model):
    """(worker, stub, channel, log watcher): one in-process worker for the whole module, small step limits."""
    with LogWatcher() as watcher:
        worker = BackgroundWorker(tiny_model, max_batch_tokens=64, max_batch_size=8).start()
        channel = grpc.insecure_channel(worker.address)
        try:
            yield worker, worker_pb2_grpc.WorkerServiceStub(channel), channel, watcher
        finally:
            channel.close()
            worker.stop()


def still_serving(fuzzed, where: str) -> None:
    """The worker answers, can still generate, logged nothing alarming; unary sequences are then freed."""
    worker, stub, _, watcher = fuzzed
    assert worker.exit_code is None, f"{where}: the worker exited ({worker.exit_code})"
    assert stub.Health(pb.HealthRequest(), timeout=10).ready, f"{where}: not ready"
    canary = stub.Prefill(
        pb.PrefillRequest(
            chunks=[pb.PrefillChunk(request_id=2**64 - 1, token_ids=[5, 6, 7], sampling=GREEDY, is_last=True)]
        ),
        timeout=10,
    )
    assert canary.generations[0].has_token and not canary.generations[0].error, f"{where}: {canary}"
    stub.FilterBatch(pb.FilterBatchRequest(keep_request_ids=[]), timeout=10)
    found = watcher.take()
    assert not found, f"{where}: logged {found}"


def call_problem(fn) -> str | None:
    try:
        fn()
    except grpc.RpcError as e:
        return rpc_error_problem(e)
    return None


@FUZZ
@given(unary_calls)
def test_unary_rpcs_answer_random_messages(fuzzed, call):
    method, request = call
    stub = fuzzed[1]
    problem = call_problem(lambda: getattr(stub, method)(request, timeout=30))
    assert problem is None, f"{method}({request}): {problem}"
    still_serving(fuzzed, f"after {method}")


@FUZZ
@given(st.sampled_from(UNARY_METHODS + ("StepStream", "NoSuchMethod")), st.lists(foreign_bytes, min_size=1, max_size=3))
def test_raw_bytes_to_every_method(fuzzed, method, frames):
    channel = fuzzed[2]
    if method == "StepStream":
        call, responses = channel.stream_stream(SERVICE + method), []

        def stream():
            responses.extend(call(iter(frames), timeout=30))
            if len(responses) != len(frames):  # neither refused nor answered: dropped
                raise AssertionError(f"{len(frames)} frames, {len(responses)} answers, status OK")

        problem = call_problem(stream)
    else:
        call = channel.unary_unary(SERVICE + method)
        problem = call_problem(lambda: call(frames[0], timeout=30))
    if method == "NoSuchMethod" and problem and problem.startswith("UNIMPLEMENTED"):
        problem = None
    assert problem is None, f"{method}({frames}): {problem}"
    still_serving(fuzzed, f"after raw bytes to {method}")


@FUZZ
@given(st.lists(stream_steps, min_size=1, max_size=5))
def test_step_stream_random_steps(fuzzed, steps):
    stub = fuzzed[1]
    responses = []
    problem = call_problem(lambda: responses.extend(stub.StepStream(iter(steps), timeout=30)))
    assert problem is None, f"{steps}: {problem}"
    assert [r.step_id for r in responses] == [s.step_id for s in steps]
    for r in responses:
        assert "\n" not in r.step_error and len(r.step_error) < 400, r.step_error
    still_serving(fuzzed, "after a step stream")


def _chunk(request_id, tokens, sampling=GREEDY, is_last=True):
    return pb.PrefillChunk(request_id=request_id, token_ids=tokens, sampling=sampling, is_last=is_last)


def _plan(offsets_shape, indices_shape, data=b""):
    return pb.RoutingPlan(
        layers=[0, 1],
        offsets=pb.Tensor(data=data, dtype="int32", shape=offsets_shape),
        token_indices=pb.Tensor(data=data, dtype="int32", shape=indices_shape),
    )


BOUNDARY = {
    "empty decode": ("Decode", pb.DecodeRequest()),
    "empty prefill": ("Prefill", pb.PrefillRequest()),
    "stop id = vocab": (
        "Prefill",
        pb.PrefillRequest(
            chunks=[_chunk(1, [5], pb.SamplingParams(top_p=1.0, stop_token_ids=[259], min_new_tokens=3))]
        ),
    ),
    "stop id 2^32-1 sampled": (
        "Prefill",
        pb.PrefillRequest(
            chunks=[
                _chunk(
                    1, [5], pb.SamplingParams(temperature=0.7, top_p=0.9, stop_token_ids=[2**32 - 1], min_new_tokens=3)
                )
            ]
        ),
    ),
    "tokens past max_batch_tokens": ("Prefill", pb.PrefillRequest(chunks=[_chunk(1, [5] * 65)])),
    "2M tokens": ("Prefill", pb.PrefillRequest(chunks=[_chunk(1, [5] * 2_000_000)])),
    "too many sequences": ("Prefill", pb.PrefillRequest(chunks=[_chunk(i, [5]) for i in range(9)])),
    "duplicate chunk ids": ("Prefill", pb.PrefillRequest(chunks=[_chunk(1, [5]), _chunk(1, [6])])),
    "chunk and decode of one id": ("Prefill", pb.PrefillRequest(chunks=[_chunk(1, [5])], decode_request_ids=[1])),
    "shape product overflows to zero": (
        "Prefill",
        pb.PrefillRequest(chunks=[_chunk(1, [5])], routing_plan=_plan([2**32, 2**32], [2**32, 2**32])),
    ),
    "shape product wraps": (
        "Decode",
        pb.DecodeRequest(request_ids=[1], routing_plan=_plan([2, 2**62 + 3], [2, 2**63 - 1])),
    ),
    "plan for another token count": (
        "Prefill",
        pb.PrefillRequest(
            chunks=[_chunk(1, [5, 6])],
            routing_plan=pb.RoutingPlan(
                layers=[0, 1],
                offsets=pb.Tensor(data=np.array([[0, 1, 2, 2, 2]] * 2, "<i4").tobytes(), dtype="int32", shape=[2, 5]),
                token_indices=pb.Tensor(data=np.array([[0, 0]] * 2, "<i4").tobytes(), dtype="int32", shape=[2, 2]),
            ),
        ),
    ),
    "plan with k = 3": (
        "Prefill",
        pb.PrefillRequest(
            chunks=[_chunk(1, [5])],
            routing_plan=pb.RoutingPlan(
                layers=[0, 1],
                offsets=pb.Tensor(data=np.array([[0, 1, 2, 3, 3]] * 2, "<i4").tobytes(), dtype="int32", shape=[2, 5]),
                token_indices=pb.Tensor(data=np.zeros((2, 3), "<i4").tobytes(), dtype="int32", shape=[2, 3]),
            ),
        ),
    ),
    "plan with one expert twice": (
        "Prefill",
        pb.PrefillRequest(
            chunks=[_chunk(1, [5])],
            routing_plan=pb.RoutingPlan(
                layers=[0, 1],
                offsets=pb.Tensor(data=np.array([[0, 2, 2, 2, 2]] * 2, "<i4").tobytes(), dtype="int32", shape=[2, 5]),
                token_indices=pb.Tensor(data=np.zeros((2, 2), "<i4").tobytes(), dtype="int32", shape=[2, 2]),
            ),
        ),
    ),
    "nan temperature": (
        "Prefill",
        pb.PrefillRequest(chunks=[_chunk(1, [5], pb.SamplingParams(temperature=float("nan")))]),
    ),
    "warmup of 2^32-1 tokens": ("Warmup", pb.WarmupRequest(max_batch_tokens=2**32 - 1)),
    "filter keeping 100k ids": ("FilterBatch", pb.FilterBatchRequest(keep_request_ids=list(range(100_000)))),
}


@pytest.mark.parametrize("name", list(BOUNDARY))
def test_boundary_requests(fuzzed, name):
    method, request = BOUNDARY[name]
    problem = call_problem(lambda: getattr(fuzzed[1], method)(request, timeout=60))
    assert problem is None, f"{name}: {problem}"
    still_serving(fuzzed, name)


def test_tiny_temperature_samples_the_top_token(fuzzed):
    """1e-45 divides the logits into inf; the sampler must still pick the most likely token, as greedy does."""
    stub = fuzzed[1]
    greedy = stub.Prefill(pb.PrefillRequest(chunks=[_chunk(1, [5, 17, 42])])).generations[0].token_id
    tiny = stub.Prefill(
        pb.PrefillRequest(chunks=[_chunk(2, [5, 17, 42], pb.SamplingParams(temperature=1e-45, top_p=1.0, seed=3))])
    ).generations[0]
    assert tiny.token_id == greedy and not tiny.error
    still_serving(fuzzed, "tiny temperature")


def test_cancel_and_disconnect_storm_on_step_stream(fuzzed):
    """80 streams that start sequences and vanish at random points: cancelled before or after their first
    results, or their channel closed under them, 8 at a time. Every sequence is freed; the worker keeps
    serving and logs nothing alarming."""
    worker = fuzzed[0]

    def one(i: int) -> None:
        rng = random.Random(i)
        channel = grpc.insecure_channel(worker.address)
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        prompt = [3 + (i * 7 + j) % 250 for j in range(1 + i % 9)]

        def steps():
            yield pb.StepStreamRequest(step_id=1, chunks=[_chunk(1000 + i, prompt)])
            for s in range(2, 40):
                time.sleep(0.002)
                yield pb.StepStreamRequest(step_id=s, decode_request_ids=np.array([1000 + i], "<u8").tobytes())

        call = stub.StepStream(steps())
        try:
            for _ in range(rng.randint(0, 4)):
                next(call)
            time.sleep(rng.random() * 0.01)
            if rng.random() < 0.6:
                call.cancel()
        finally:
            channel.close()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(80)))
    deadline = time.monotonic() + 10
    while kv_problem(worker.engine) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_problem(worker.engine) is None, kv_problem(worker.engine)
    assert not worker.servicer.sequence_owners and worker.servicer.open_streams == 0
    still_serving(fuzzed, "after the storm")


def test_kv_pool_back_to_baseline(fuzzed):
    """Runs last: after every case above, nothing holds a block and the free list is the whole pool."""
    worker, stub = fuzzed[0], fuzzed[1]
    stub.FilterBatch(pb.FilterBatchRequest(keep_request_ids=[]))
    assert kv_problem(worker.engine) is None, kv_problem(worker.engine)
