"""A tiny in-process WorkerService for router tests (deterministic tokens, real KV block accounting), and the
router against it (`harness`).

It speaks the tiny model's byte-level vocabulary (tests.helpers.byte_ids): each sequence's next token is the
id after its last one, skipping the special ids (so text walks through characters); past the vocabulary's last
id it produces EOS, unless EOS is a stop id still suppressed by min_new_tokens, in which case it produces 0.
With a `script` (token ids), every sequence generates the script instead, then EOS: a reply scripted this way
drives the router's parsing and streaming of a model's output (tool calls) through the real router.
Every call is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np

from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc, worker_pb2_grpc
from common.pb import worker_pb2 as pb
from expert_service.tools.tiny_model import EOS_ID as EOS
from expert_service.tools.tiny_model import NUM_SPECIAL, VOCAB_SIZE
from router_service.config import RouterConfig
from router_service.main import start_router
from tests.grpc_teardown import stopped


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        vocab_size=VOCAB_SIZE,
        block_size=4,
        num_blocks=256,
        max_batch_tokens=64,
        max_batch_size=8,
        max_position_embeddings=4096,
        step_delay=0.0,
        script=None,
    ):
        self.vocab_size, self.block_size, self.num_blocks = vocab_size, block_size, num_blocks
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.max_position_embeddings = max_position_embeddings
        self.step_delay = step_delay
        self.script = list(script) if script is not None else None
        self.ready = True
        self.fail_next: grpc.StatusCode | None = None  # the next step aborts with this code
        self.seqs: dict[int, dict] = {}
        self.seen_ids: set[int] = set()
        self.calls: list[str] = []
        self.filter_keeps: list[list[int]] = []
        self.freed: list[int] = []  # ids freed through the step stream
        self.extra_samples = 0  # tokens sampled for a sequence after its EOS / stop id
        self.max_queued = 0  # most step-stream requests received and not yet answered
        self.open_streams = 0  # step-stream handlers still running (the harness lets them end before stopping)
        self.draining = False  # new sequences on the step stream get DRAINING, as a signalled worker answers
        self.health_delay = 0.0  # Health answers this late, with the readiness it had when asked
        self.health_in_flight = 0
        self.sampling: dict[int, pb.SamplingParams] = {}
        self.step_started = asyncio.Event()

    def blocks_used(self) -> int:
        return sum(-(-len(s["tokens"]) // self.block_size) for s in self.seqs.values())

    async def Info(self, request, context):
        self.calls.append("Info")
        return pb.InfoResponse(
            family="mixtral",
            dtype="float32",
            hf_config_json='{"num_local_experts": 8, "num_experts_per_tok": 2}',
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            eos_token_ids=[EOS],
            kv_block_size=self.block_size,
            num_kv_blocks=self.num_blocks,
            max_batch_tokens=self.max_batch_tokens,
            max_batch_size=self.max_batch_size,
            backend="cpu",
            routing="exact",
            model_name="fake",
            expert_dtypes=["float8_e4m3fn/block128", "int8"],  # a mixed 8-bit model: the router passes them on
            head_dtype="int8",  # an 8-bit LM head: passed on too
            attention_dtype="float8_e4m3fn",  # and 8-bit attention projections
        )

    async def Health(self, request, context):
        ready = self.ready
        self.health_in_flight += 1
        try:
            await asyncio.sleep(self.health_delay)
        finally:
            self.health_in_flight -= 1
        return pb.HealthResponse(ready=ready)

    async def Warmup(self, request, context):
        self.calls.append("Warmup")
        return pb.WarmupResponse(warmup_ms=1.0)

    async def ClearCache(self, request, context):
        self.calls.append("ClearCache")
        n = len(self.seqs)
        self.seqs.clear()
        return pb.ClearCacheResponse(freed_sequences=n)

    async def FilterBatch(self, request, context):
        keep = list(request.keep_request_ids)
        self.calls.append("FilterBatch")
        self.filter_keeps.append(keep)
        freed = [i for i in self.seqs if i not in keep]
        for i in freed:
            del self.seqs[i]
        return pb.FilterBatchResponse(freed_request_ids=freed, kv_blocks_used=self.blocks_used())

    def _sample(self, rid: int) -> int:
        s = self.seqs[rid]
        nxt = max(s["tokens"][-1] + 1, NUM_SPECIAL)
        if self.script is not None:
            nxt = self.script[s["generated"]] if s["generated"] < len(self.script) else EOS
        if nxt >= self.vocab_size:
            nxt = EOS
        params = s["sampling"]
        if nxt in params.stop_token_ids and s["generated"] < params.min_new_tokens:
            nxt = 0
        s["generated"] += 1
        s["last"] = nxt
        if s.get("stopped"):
            self.extra_samples += 1
        s["stopped"] = s.get("stopped") or nxt == EOS or nxt in params.stop_token_ids
        return nxt

    async def _step(self, context, name):
        self.calls.append(name)
        self.step_started.set()
        if self.step_delay:
            await asyncio.sleep(self.step_delay)
        if self.fail_next is not None:
            code, self.fail_next = self.fail_next, None
            self.seqs.clear()
            await context.abort(code, "injected failure")

    async def Prefill(self, request, context):
        await self._step(context, "Prefill")
        out = []
        for chunk in request.chunks:
            rid = chunk.request_id
            if rid not in self.seqs:
                if not chunk.HasField("sampling"):
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown sequence {rid}")
                self.seqs[rid] = {"tokens": [], "sampling": chunk.sampling, "generated": 0}
                self.sampling[rid] = chunk.sampling
                self.seen_ids.add(rid)
            self.seqs[rid]["tokens"] += list(chunk.token_ids)
            if chunk.is_last:
                out.append(pb.Generation(request_id=rid, has_token=True, token_id=self._sample(rid), logprob=-0.5))
            else:
                out.append(pb.Generation(request_id=rid, has_token=False))
        out += await self._decode(request.decode_request_ids, context)
        return pb.PrefillResponse(
            generations=out,
            kv_blocks_used=self.blocks_used(),
            timings=pb.StepTimings(total_ms=max(self.step_delay * 1e3, 0.1)),
        )

    async def Decode(self, request, context):
        await self._step(context, "Decode")
        out = await self._decode(request.request_ids, context)
        return pb.DecodeResponse(
            generations=out,
            kv_blocks_used=self.blocks_used(),
            timings=pb.StepTimings(total_ms=max(self.step_delay * 1e3, 0.1)),
        )

    async def _decode(self, ids, context):
        out = []
        for rid in ids:
            if rid not in self.seqs:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown sequence {rid}")
            s = self.seqs[rid]
            s["tokens"].append(s["last"])
            out.append(pb.Generation(request_id=rid, has_token=True, token_id=self._sample(rid), logprob=-0.25))
        return out

    async def StepStream(self, request_iterator, context):
        """The step stream: frees, then chunks, then decodes; unknown decodes fail alone (UNKNOWN_SEQUENCE)."""
        queued: asyncio.Queue = asyncio.Queue()

        async def receive():
            async for request in request_iterator:
                queued.put_nowait(request)
                self.max_queued = max(self.max_queued, queued.qsize() + busy[0])
            queued.put_nowait(None)

        busy = [0]
        receiver = asyncio.create_task(receive())
        self.open_streams += 1
        try:
            async for response in self._step_responses(queued, busy, context):
                yield response
        finally:
            # However the stream ends (an injected abort, the router cancelling), the reader goes with it and
            # its error is retrieved: nothing is left for the loop to report at close.
            self.open_streams -= 1
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)

    async def _step_responses(self, queued: asyncio.Queue, busy: list[int], context):
        while (request := await queued.get()) is not None:
            busy[0] = 1
            await self._step(context, "StepStream")
            yield self.answer(request)
            busy[0] = 0

    def answer(self, request: pb.StepStreamRequest) -> pb.StepStreamResponse:
        """One step message's effects (frees, then chunks, then decodes) and its answer."""
        for rid in np.frombuffer(request.free_request_ids, "<u8").tolist():
            self.freed.append(rid)
            self.seqs.pop(rid, None)
        ids, tokens, logprobs, errors = [], [], [], []
        for chunk in request.chunks:
            rid = chunk.request_id
            if rid not in self.seqs and self.draining:  # a draining worker starts nothing new
                ids.append(rid)
                tokens.append(-1)
                logprobs.append(0.0)
                errors.append(pb.SequenceError(request_id=rid, code="DRAINING"))
                continue
            if rid not in self.seqs:
                self.seqs[rid] = {"tokens": [], "sampling": chunk.sampling, "generated": 0}
                self.sampling[rid] = chunk.sampling
                self.seen_ids.add(rid)
            self.seqs[rid]["tokens"] += list(chunk.token_ids)
            ids.append(rid)
            tokens.append(self._sample(rid) if chunk.is_last else -1)
            logprobs.append(-0.5)
        for rid in np.frombuffer(request.decode_request_ids, "<u8").tolist():
            ids.append(rid)
            logprobs.append(-0.25)
            if rid not in self.seqs:
                tokens.append(-1)
                errors.append(pb.SequenceError(request_id=rid, code="UNKNOWN_SEQUENCE"))
                continue
            s = self.seqs[rid]
            s["tokens"].append(s["last"])
            tokens.append(self._sample(rid))
        return pb.StepStreamResponse(
            step_id=request.step_id,
            request_ids=np.asarray(ids, "<u8").tobytes(),
            token_ids=np.asarray(tokens, "<i4").tobytes(),
            logprobs=np.asarray(logprobs, "<f4").tobytes(),
            errors=errors,
            kv_blocks_used=self.blocks_used(),
            timings=pb.StepTimings(total_ms=max(self.step_delay * 1e3, 0.1)),
        )


async def start_fake_worker(worker: FakeWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def harness(fake=None, tokenizer=None, wait_ready=True, hooks=None, **overrides):
    """Yields (router, fake worker, GenerationService stub, channel): an in-process router on loopback."""
    fake = fake or FakeWorker()
    worker_server, address = await start_fake_worker(fake)
    config = RouterConfig(**{"host": "127.0.0.1", "port": 0, "metrics_port": 0, "worker_retry_s": 0.05, **overrides})
    router = await start_router(config, address, tokenizer=tokenizer, hooks=hooks)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    stub = router_pb2_grpc.GenerationServiceStub(channel)
    try:
        if wait_ready:
            await wait_for(lambda: router.batching_loop.is_worker_ready)
        yield router, fake, stub, channel
    finally:
        await channel.close()
        await router.stop(grace=0.1)
        # the router's end cancels its step stream; a handler the server's own stop cancelled instead (mid-step)
        # would be logged by grpc as an unhandled error, which tests that assert a clean log then see
        deadline = asyncio.get_running_loop().time() + 2.0
        while fake.open_streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await stopped(worker_server)


async def wait_for(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def ids_request(ids, request_id="", **params):
    return rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=ids), request_id=request_id, parameters=rpb.SamplingParameters(**params)
    )


async def burst_behind(stub, loop, first_ids, gap_s: float, n: int = 5) -> list[int]:
    """Sends a request of `first_ids`, then, once the batching `loop` has sent its first step, `n` two-token
    requests `gap_s` apart; returns how many prompts each step the loop sent started (its first chunks)."""
    new_per_step, send = [], loop._send

    async def recording_send(step, *late):
        new_per_step.append(sum(chunk.is_first for chunk in step.prefill_chunks))
        await send(step, *late)

    loop._send = recording_send
    calls = [asyncio.ensure_future(stub.Generate(ids_request(first_ids, max_new_tokens=2)))]
    await wait_for(lambda: new_per_step)
    for i in range(n):
        await asyncio.sleep(gap_s)
        calls.append(asyncio.ensure_future(stub.Generate(ids_request([10 + i, 11], max_new_tokens=2))))
    await asyncio.gather(*calls)
    return new_per_step
