"""A tiny in-process WorkerService for router tests: deterministic tokens, real KV block accounting.

Each sequence's next token is its last token + 1; from byte 255 on it produces EOS (256), unless EOS is a
stop id still suppressed by min_new_tokens, in which case it produces 0. Every call is recorded.
"""
from __future__ import annotations

import asyncio

import grpc

from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc

EOS = 256


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, vocab_size=258, block_size=4, num_blocks=256, max_batch_tokens=64, max_batch_size=8,
                 max_position_embeddings=4096, step_delay=0.0):
        self.vocab_size, self.block_size, self.num_blocks = vocab_size, block_size, num_blocks
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.max_position_embeddings = max_position_embeddings
        self.step_delay = step_delay
        self.ready = True
        self.fail_next: grpc.StatusCode | None = None  # the next step aborts with this code
        self.seqs: dict[int, dict] = {}
        self.seen_ids: set[int] = set()
        self.calls: list[str] = []
        self.filter_keeps: list[list[int]] = []
        self.sampling: dict[int, pb.SamplingParams] = {}
        self.step_started = asyncio.Event()

    def blocks_used(self) -> int:
        return sum(-(-len(s["tokens"]) // self.block_size) for s in self.seqs.values())

    async def Info(self, request, context):
        self.calls.append("Info")
        return pb.InfoResponse(family="mixtral", dtype="float32", hf_config_json='{"num_local_experts": 8, '
                               '"num_experts_per_tok": 2}', vocab_size=self.vocab_size,
                               max_position_embeddings=self.max_position_embeddings, eos_token_ids=[EOS],
                               kv_block_size=self.block_size, num_kv_blocks=self.num_blocks,
                               max_batch_tokens=self.max_batch_tokens, max_batch_size=self.max_batch_size,
                               backend="cpu", routing="exact", model_name="fake")

    async def Health(self, request, context):
        return pb.HealthResponse(ready=self.ready)

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
        nxt = s["tokens"][-1] + 1
        if nxt >= 256:
            nxt = EOS
        params = s["sampling"]
        if nxt in params.stop_token_ids and s["generated"] < params.min_new_tokens:
            nxt = 0
        s["generated"] += 1
        s["last"] = nxt
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
        return pb.StepResponse(generations=out, kv_blocks_used=self.blocks_used(),
                               timings=pb.StepTimings(total_ms=0.1))

    async def Decode(self, request, context):
        await self._step(context, "Decode")
        out = await self._decode(request.request_ids, context)
        return pb.StepResponse(generations=out, kv_blocks_used=self.blocks_used(),
                               timings=pb.StepTimings(total_ms=0.1))

    async def _decode(self, ids, context):
        out = []
        for rid in ids:
            if rid not in self.seqs:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown sequence {rid}")
            s = self.seqs[rid]
            s["tokens"].append(s["last"])
            out.append(pb.Generation(request_id=rid, has_token=True, token_id=self._sample(rid), logprob=-0.25))
        return out


async def start_fake_worker(worker: FakeWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
