"""A second caller of the worker's RPCs (another router, an operator's grpcurl) next to a router's live step stream,
over real gRPC on loopback: whatever it calls, the stream's running sequences step on exactly as they would alone."""

import queue

import grpc
import numpy as np
import pytest

from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from tests.expert_service.serving.test_worker_service import _outputs, _stream_step


@pytest.fixture
def stub(worker):
    channel = grpc.insecure_channel(worker.address)
    yield worker_pb2_grpc.WorkerServiceStub(channel)
    channel.close()


class _Stream:
    """A step stream held open: each `step` is sent and answered before the next (the caller sends them)."""

    def __init__(self, stub):
        self._steps: queue.Queue = queue.Queue()
        self._answers = stub.StepStream(iter(self._steps.get, None))
        self._next_id = 1

    def step(self, **fields):
        self._steps.put(_stream_step(self._next_id, **fields))
        self._next_id += 1
        return next(self._answers)

    def close(self):
        self._steps.put(None)
        return list(self._answers)


def _random_prompt(vocab: int) -> tuple[int, list[int]]:
    rng = np.random.default_rng()
    return int(rng.integers(1, 1 << 40)), rng.integers(0, vocab, int(rng.integers(3, 12))).tolist()


def _generate(stub, request_id, prompt, decodes, between=lambda: None, sampling=None):
    """Greedy tokens of a prompt and `decodes` decodes on a stream of its own; `between()` runs after the prefill,
    while the stream holds the sequence."""
    sampling = sampling or pb.SamplingParams(top_p=1.0)
    chunk = pb.PrefillChunk(request_id=request_id, token_ids=prompt, sampling=sampling, is_last=True)
    stream = _Stream(stub)
    answers = [stream.step(chunks=[chunk])]
    between()
    answers += [stream.step(decodes=[request_id]) for _ in range(decodes)]
    stream.close()
    return [(token, error) for answer in answers for _, token, error in _outputs(answer)]


def test_clear_cache_while_a_stream_runs_sequences_is_refused_and_they_step_on_exactly(stub):
    """ClearCache from another caller used to free every sequence, the live stream's included: its next decode
    failed UNKNOWN_SEQUENCE. It is refused now (FAILED_PRECONDITION naming the running sequences), nothing is freed,
    and the stream's tokens equal an undisturbed run's; once no stream holds sequences, it clears."""
    vocab = stub.Info(pb.InfoRequest()).vocab_size
    request_id, prompt = _random_prompt(vocab)
    alone = _generate(stub, request_id, prompt, 4)
    assert all(token >= 0 and not error for token, error in alone)
    refusals = []

    def clear_from_another_caller():
        with pytest.raises(grpc.RpcError) as refused:
            stub.ClearCache(pb.ClearCacheRequest())
        refusals.append(refused.value)

    assert _generate(stub, request_id, prompt, 4, clear_from_another_caller) == alone
    assert refusals[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "1 sequences of 1 open step stream are running" in refusals[0].details()
    # the unary calls' sequences are the reset's to free (no stream holds them)
    unary = pb.PrefillChunk(request_id=request_id, token_ids=prompt, sampling=pb.SamplingParams(), is_last=True)
    stub.Prefill(pb.PrefillRequest(chunks=[unary]))
    assert stub.ClearCache(pb.ClearCacheRequest()).freed_sequences == 1


def test_another_callers_warmup_leaves_a_running_penalised_sequence_exact(stub, worker, monkeypatch):
    """The Warmup RPC ran the backend's start-up warm-up again, with a stream's sequences live: on cuda that zeroes
    penalty slot 0, the penalty state (prompt marks, output counts) of the sequence holding it. It runs only its
    throw-away step now; the backend's warm-up runs at start-up alone."""
    vocab = stub.Info(pb.InfoRequest()).vocab_size
    request_id, prompt = _random_prompt(vocab)
    penalised = pb.SamplingParams(top_p=1.0, repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=2.0)
    alone = _generate(stub, request_id, prompt, 6, sampling=penalised)
    backend_warmups = []
    decoder = worker.engine.decoder
    monkeypatch.setattr(decoder, "warmup", lambda: backend_warmups.append(decoder))
    warmed = []

    def warm_up_from_another_caller():
        warmed.append(stub.Warmup(pb.WarmupRequest(max_batch_tokens=16)).warmup_ms)

    assert _generate(stub, request_id, prompt, 6, warm_up_from_another_caller, penalised) == alone
    assert warmed and not backend_warmups
    assert not worker.engine.sequences and worker.engine.allocator.num_used_blocks == 0
