"""A BatchingLoop run against a worker the test operates by hand: it sees each step message the router sends and
answers it when and how the test says (tokens, per-sequence errors), so message-by-message protocol cases need no
timing."""

from __future__ import annotations

import asyncio

import numpy as np

from common.pb import router_pb2 as rpb
from common.pb import worker_pb2 as pb
from expert_service.tools.tiny_model import NUM_SPECIAL, VOCAB_SIZE
from router_service.batching_loop import BatchingLoop
from router_service.config import RouterConfig
from router_service.validation import validate_request
from tests.router_service.fake_worker import FakeWorker


def b(ch: str) -> int:
    return NUM_SPECIAL + ord(ch)


class ManualStream:
    def __init__(self, worker):
        self.worker = worker
        self.answers: asyncio.Queue = asyncio.Queue()

    async def send(self, request):
        self.worker.sent.append(request)

    async def receive(self):
        return await self.answers.get()

    def close(self):
        pass

    def on_end(self, callback):
        pass  # the test answers every step: the stream never ends under the router

    async def end_error(self):
        return None


class ManualWorker:
    address = "manual"

    def __init__(self, num_blocks=256, block_size=4, max_batch_tokens=512, max_batch_size=8):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.sent: list = []
        self.stream: ManualStream | None = None

    async def info(self, timeout=None):
        fake = FakeWorker(VOCAB_SIZE, self.block_size, self.num_blocks, self.max_batch_tokens, self.max_batch_size)
        return await fake.Info(None, None)  # the same description as the fake worker's

    async def health(self, timeout=None):
        return True

    async def clear_cache(self, timeout=None):
        return 0

    async def warmup(self, max_batch_tokens, timeout=None):
        return 1.0

    def open_step_stream(self):
        self.stream = ManualStream(self)
        return self.stream

    async def next_sent(self, n_before: int, timeout=2.0):
        """Waits until more than n_before messages were sent; returns the newest."""

        async def wait():
            while len(self.sent) <= n_before:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(wait(), timeout)
        return self.sent[n_before]

    def answer(self, request, tokens: dict[int, int], errors: dict[int, str] | None = None, total_ms=1.0):
        """Answers `request`: tokens {seq_id: token} (for decodes and last chunks), errors {seq_id: code}."""
        errors = errors or {}
        ids, toks = [], []
        for c in request.chunks:
            ids.append(c.request_id)
            toks.append(tokens.get(c.request_id, -1) if c.is_last else -1)
        for rid in np.frombuffer(request.decode_request_ids, "<u8").tolist():
            ids.append(rid)
            toks.append(tokens.get(rid, -1))
        resp = pb.StepStreamResponse(
            step_id=request.step_id,
            request_ids=np.asarray(ids, "<u8").tobytes(),
            token_ids=np.asarray(toks, "<i4").tobytes(),
            logprobs=np.zeros(len(ids), "<f4").tobytes(),
            errors=[pb.SequenceError(request_id=r, code=c) for r, c in errors.items()],
            timings=pb.StepTimings(total_ms=total_ms),
        )
        self.stream.answers.put_nowait(resp)


def decode_ids(request) -> list[int]:
    return np.frombuffer(request.decode_request_ids, "<u8").tolist()


def free_ids(request) -> list[int]:
    return np.frombuffer(request.free_request_ids, "<u8").tolist()


def late_ids(request) -> list[int]:
    return np.frombuffer(request.late_mask_request_ids, "<u8").tolist()


async def start_loop(tokenizer, worker=None, **overrides):
    worker = worker or ManualWorker()
    config = RouterConfig(
        **{
            "host": "127.0.0.1",
            "port": 0,
            "metrics_port": 0,
            "worker_retry_s": 0.05,
            "warmup": False,
            "pipeline_depth": 2,
            **overrides,
        }
    )
    loop = BatchingLoop(config, worker, tokenizer)
    await loop.start()
    for _ in range(500):
        if loop.is_worker_ready:
            break
        await asyncio.sleep(0.01)
    assert loop.is_worker_ready
    return loop, worker


def submit(loop, prompt, **params):
    constraint = params.pop("constraint", None)
    p = rpb.SamplingParameters(**params)
    if constraint is not None:
        p.constraint.CopyFrom(constraint)
    req = validate_request(
        rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=prompt), parameters=p), loop.config, loop.limits
    )
    return loop.submit(req)
