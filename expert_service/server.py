"""The expert worker's gRPC service: a thin pb <-> engine adapter.

All model work runs on one dedicated executor thread, so health checks and Info answer during long
steps. Expected errors map to gRPC codes; anything else is a worker fault: the failing call gets INTERNAL,
health turns NOT_SERVING and the process exits non-zero so Kubernetes (or `colibri serve`) restarts it.
A watchdog treats a step that runs past ``step_timeout_s`` the same way.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2

from common.errors import CapacityError, ColibriError, InvalidRequestError
from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from common.routing_plan import RoutingPlan
from common.tracing import COLIBRI_STEP_KIND, extract_context, get_tracer
from expert_service.engine import Engine, PrefillInput, StepResult
from expert_service.step_stream import StepOutcome, StreamSession, StreamStep
from expert_service.routing_plan import warmup_routing_plan
from expert_service.sampling import SamplingParams

log = logging.getLogger("colibri.worker")
SERVICE_NAME = "colibri.worker.v1.WorkerService"


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, engine: Engine, health_servicer: health.HealthServicer, model_name: str,
                 on_fatal: Callable[[BaseException], None], step_timeout_s: float = 300.0, metrics=None,
                 tracer_provider=None):
        self.engine = engine
        self.health = health_servicer
        self.model_name = model_name
        self.on_fatal = on_fatal
        self.step_timeout_s = step_timeout_s
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-model")
        self.ready = False
        self.sequence_owners: dict[int, int] = {}    # sequence id -> the step-stream session that started it

    async def run_on_model_thread(self, context: grpc.aio.ServicerContext, fn, *args):
        """Runs `fn` on the model thread; maps errors to status codes, treats the unexpected as fatal."""
        future = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.step_timeout_s)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except CapacityError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ColibriError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except asyncio.TimeoutError:
            self._fatal(TimeoutError(f"watchdog: a model call ran past {self.step_timeout_s:.0f} s"))
            await context.abort(grpc.StatusCode.INTERNAL, "worker step timed out; the worker is restarting")
        except Exception as e:   # a worker fault (bug, CUDA error, OOM): fail fast
            self._fatal(e)
            await context.abort(grpc.StatusCode.INTERNAL, f"worker fault: {type(e).__name__}: {e}")

    def _fatal(self, error: BaseException) -> None:
        log.error("worker fault, exiting", exc_info=error)
        self.ready = False
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.on_fatal(error)

    def mark_ready(self) -> None:
        self.ready = True
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    def memory_plan(self) -> list[tuple[str, int]]:
        return self.engine.decoder.memory_plan()

    async def Info(self, request, context):
        e, mc = self.engine, self.engine.model_config
        return pb.InfoResponse(
            family=mc.family, dtype=e.model.dtype, hf_config_json=json.dumps(e.model.hf_config),
            vocab_size=mc.vocab_size, max_position_embeddings=mc.max_position_embeddings,
            eos_token_ids=list(mc.eos_token_ids), kv_block_size=e.config.kv_block_size,
            num_kv_blocks=e.allocator.num_blocks, max_batch_tokens=e.config.max_batch_tokens,
            max_batch_size=e.config.max_batch_size, backend=e.backend, routing=e.config.routing,
            memory_plan=[pb.MemoryItem(name=n, bytes=b) for n, b in self.memory_plan()],
            model_name=self.model_name,
            expert_slots=e.slot_plan.to_pb(e.config.expert_cache_policy, e.config.prefetch_sources))

    def warmup(self, num_tokens: int) -> float:
        """One throw-away prefill of `num_tokens` tokens (bounded by the KV pool), then free it."""
        started = time.perf_counter()
        cfg, mc = self.engine.config, self.engine.model_config
        n = max(1, min(num_tokens, cfg.max_batch_tokens, mc.max_position_embeddings,
                       self.engine.allocator.num_free_blocks * cfg.kv_block_size))
        ids = np.random.default_rng(0).integers(0, mc.vocab_size, size=n)
        self.engine.warmup()
        routing_plan = warmup_routing_plan(mc.moe_layers, mc.num_experts, mc.num_experts_per_tok, n) \
            if self.engine.config.routing == "lut" else None
        try:
            self.engine.step([PrefillInput(-1, ids, SamplingParams(), True)], routing_plan=routing_plan)
        finally:
            self.engine.release([-1])
        return (time.perf_counter() - started) * 1e3

    async def Warmup(self, request, context):
        ms = await self.run_on_model_thread(context, self.warmup, request.max_batch_tokens or 16)
        return pb.WarmupResponse(warmup_ms=ms)

    def _routing_plan(self, request) -> RoutingPlan | None:
        if not request.HasField("routing_plan"):
            return None
        return RoutingPlan.from_pb(request.routing_plan, self.engine.model_config.moe_layers)

    def _run_prefill(self, request: pb.PrefillRequest) -> StepResult:
        return self.engine.step([PrefillInput.from_pb(c) for c in request.chunks], list(request.decode_request_ids),
                                self._routing_plan(request))

    def _run_decode(self, request: pb.DecodeRequest) -> StepResult:
        return self.engine.step([], list(request.request_ids), self._routing_plan(request))

    async def _step(self, context, kind: str, fn, request):
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is not ready")
        started = time.perf_counter()
        result = await self.run_on_model_thread(context, fn, request)
        response = result.to_pb(self.engine.allocator.num_used_blocks, (time.perf_counter() - started) * 1e3)
        if self.metrics is not None:
            self._observe(kind, result, response.timings.total_ms / 1e3)
        return response

    def _observe(self, kind: str, result: StepResult, seconds: float) -> None:
        m, e = self.metrics, self.engine
        m.worker_step_duration.labels(kind=kind).observe(seconds)
        if result.routing_plan_recall is not None:
            m.observe_recall(result.routing_plan_recall)
        m.set_kv_usage(e.allocator.num_used_blocks, e.allocator.num_blocks)
        stats = result.expert_cache
        if stats is not None:
            m.observe_expert_cache(stats.hits, stats.misses, stats.bytes_copied, stats.stall_seconds,
                                   stats.prefetches_issued, stats.prefetches_used)
        else:   # all experts resident: every use is a hit that costs nothing
            m.observe_expert_cache(sum(len(np.unique(ids)) for ids in result.trace.expert_ids.values()), 0, 0, 0.0)
        num_experts = e.model_config.num_experts
        m.set_load_imbalance([np.bincount(ids.reshape(-1), minlength=num_experts).tolist()
                              for ids in result.trace.expert_ids.values()])

    async def Prefill(self, request, context):
        return await self._step(context, "prefill", self._run_prefill, request)

    async def Decode(self, request, context):
        return await self._step(context, "decode", self._run_decode, request)

    async def StepStream(self, request_iterator, context):
        """Steps queue on the model thread as they arrive; results go back in order as they complete."""
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is not ready")
        session = StreamSession(self.engine, self.sequence_owners)
        queued: asyncio.Queue = asyncio.Queue()
        moe_layers = self.engine.model_config.moe_layers

        async def receive():
            try:
                async for request in request_iterator:
                    span = tracer.start_span("step", context=extract_context(request.trace_context.items()))
                    try:
                        step = StreamStep.from_pb(request, moe_layers)
                    except ColibriError as e:   # malformed: refuse this step alone
                        queued.put_nowait((span, StepOutcome(request.step_id, None, str(e), 0.0)))
                        continue
                    queued.put_nowait((span, asyncio.wrap_future(self.executor.submit(session.run, step))))
            finally:
                queued.put_nowait(None)
        tracer = get_tracer(self.tracer_provider)
        receiver = asyncio.create_task(receive())
        try:
            while (item := await queued.get()) is not None:
                span, work = item
                outcome = work if isinstance(work, StepOutcome) else await self._await_step(work, context)
                span.update_name(f"worker {outcome.kind}")
                span.set_attribute(COLIBRI_STEP_KIND, outcome.kind)
                span.end()
                yield self._stream_response(outcome)
        finally:
            receiver.cancel()
            self.executor.submit(session.close)     # after every step it queued

    async def _await_step(self, future, context) -> StepOutcome:
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.step_timeout_s)
        except asyncio.TimeoutError:
            self._fatal(TimeoutError(f"watchdog: a step ran past {self.step_timeout_s:.0f} s"))
            await context.abort(grpc.StatusCode.INTERNAL, "worker step timed out; the worker is restarting")
        except Exception as e:   # a worker fault (bug, CUDA error, OOM): fail fast
            self._fatal(e)
            await context.abort(grpc.StatusCode.INTERNAL, "worker fault; the worker is restarting")

    def _stream_response(self, outcome: StepOutcome) -> pb.StepStreamResponse:
        result, used = outcome.result, self.engine.allocator.num_used_blocks
        if result is None:
            return pb.StepStreamResponse(step_id=outcome.step_id, step_error=outcome.refused, kv_blocks_used=used,
                                         timings=pb.StepTimings(total_ms=outcome.seconds * 1e3))
        if self.metrics is not None:
            self._observe(outcome.kind, result, outcome.seconds)
        return result.to_stream_pb(outcome.step_id, used, outcome.seconds * 1e3)

    async def FilterBatch(self, request, context):
        freed = await self.run_on_model_thread(context, self.engine.keep_only, list(request.keep_request_ids))
        return pb.FilterBatchResponse(freed_request_ids=freed, kv_blocks_used=self.engine.allocator.num_used_blocks)

    async def ClearCache(self, request, context):
        freed = await self.run_on_model_thread(context, self.engine.clear)
        return pb.ClearCacheResponse(freed_sequences=freed)

    async def Health(self, request, context):
        return pb.HealthResponse(ready=self.ready)
