"""The expert worker's gRPC service: a thin pb <-> engine adapter that trusts no field.

All model work runs on one dedicated thread (lifecycle.ModelThread), so health checks and Info answer during
long steps. Every request is checked before it reaches the engine: bytes that are not the method's message,
and any field out of range, are INVALID_ARGUMENT for that call alone (RESOURCE_EXHAUSTED when the KV cache
is full); on the step stream a bad step is refused in its own result and the stream goes on. Anything else
raised by the model is a worker fault: the failing call gets INTERNAL, health turns NOT_SERVING and the
process exits non-zero so Kubernetes (or `colibri serve`) restarts it. A watchdog treats a step that runs
past ``step_timeout_s`` the same way. While the worker drains, new streams and new sequences are refused
(UNAVAILABLE, or DRAINING for a sequence on a stream) and the sequences it holds keep stepping; streams still
open when the drain ends are ended UNAVAILABLE by the worker itself (`end_streams`), before its server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import grpc
import numpy as np
from google.protobuf.message import Message

from common.config import WORKER_MAX_MESSAGE_BYTES
from common.errors import CapacityError, ColibriError, InvalidRequestError
from common.model_identity import ModelDigests
from common.pb import worker_pb2 as pb
from common.tracing import COLIBRI_STEP_KIND, extract_context, get_tracer
from expert_service.engine.config import RoutingMode
from expert_service.engine.engine import Engine, PrefillInput, StepResult
from expert_service.engine.sampling import SamplingParams
from expert_service.experts.routing_plan import warmup_routing_plan
from expert_service.serving import wire
from expert_service.serving.lifecycle import WORKER_SERVICE, ModelThread, WorkerHealth
from expert_service.serving.step_stream import (
    MAX_FREE_IDS,
    MAX_STEPS_AHEAD,
    UNARY,
    StepAnswer,
    StepLimits,
    StepPump,
    StreamSession,
)

log = logging.getLogger("colibri.worker")
SERVICE_NAME = WORKER_SERVICE
_END = object()  # put on an open stream's queue by end_streams
# method: (request, response, streaming)
METHODS: dict[str, tuple[type[Message], type[Message], bool]] = {
    "Info": (pb.InfoRequest, pb.InfoResponse, False),
    "Warmup": (pb.WarmupRequest, pb.WarmupResponse, False),
    "Prefill": (pb.PrefillRequest, pb.PrefillResponse, False),
    "Decode": (pb.DecodeRequest, pb.DecodeResponse, False),
    "FilterBatch": (pb.FilterBatchRequest, pb.FilterBatchResponse, False),
    "ClearCache": (pb.ClearCacheRequest, pb.ClearCacheResponse, False),
    "Health": (pb.HealthRequest, pb.HealthResponse, False),
    "StepStream": (pb.StepStreamRequest, pb.StepStreamResponse, True),
}


def add_to_server(servicer: WorkerServicer, server: grpc.aio.Server) -> None:
    """Registers the service. The server's MalformedRequestGuard (common/grpc_guard.py) makes its deserializers
    never raise: bytes that are not the method's message are INVALID_ARGUMENT, and end a step stream."""
    handlers = {}
    for name, (request, response, streaming) in METHODS.items():
        make = grpc.stream_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(
            getattr(servicer, name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class WorkerServicer:
    def __init__(
        self,
        health: WorkerHealth,
        on_fatal: Callable[[BaseException], None],
        step_timeout_s: float = 300.0,
        metrics=None,
        tracer_provider=None,
        max_message_bytes: int = WORKER_MAX_MESSAGE_BYTES,
    ):
        self.engine: Engine | None = None  # set by attach() once the model is loaded
        self.model_name = ""
        self.digests = ModelDigests()
        self.health = health
        self.on_fatal = on_fatal
        self.step_timeout_s = step_timeout_s
        self.max_message_bytes = max_message_bytes  # the server's receive limit, which Info tells the router
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        self.executor = ModelThread()
        health.model_thread = self.executor
        self.sequence_owners: dict[int, int] = {}  # sequence id -> the session that started it
        self.open_streams = 0
        self._stream_ends: set[Callable[[], None]] = set()  # each open stream's end (`end_streams`)
        # sessions whose routers still offer the blocks they cached: ClearCache leaves those (added on the loop,
        # discarded once the session's close has run on the model thread)
        self.live_sessions: set[int] = set()
        self.limits: StepLimits | None = None
        self._unary: StreamSession | None = None

    def attach(self, engine: Engine, model_name: str, digests: ModelDigests = ModelDigests()) -> None:
        self.engine, self.model_name, self.limits = engine, model_name, StepLimits.of(engine)
        self.digests = digests
        self._unary = StreamSession(engine, self.sequence_owners, self.is_draining, UNARY)

    # What attach() sets: every RPC past _require (which refuses them until the model is loaded) and every
    # call on the model thread come after it.
    @property
    def attached_engine(self) -> Engine:
        assert self.engine is not None, "no engine attached yet"
        return self.engine

    @property
    def _step_limits(self) -> StepLimits:
        assert self.limits is not None, "no engine attached yet"
        return self.limits

    @property
    def _unary_session(self) -> StreamSession:
        assert self._unary is not None, "no engine attached yet"
        return self._unary

    @property
    def ready(self) -> bool:
        return self.health.is_ready()

    def is_draining(self) -> bool:
        return self.health.draining

    def mark_ready(self) -> None:
        self.health.update(ready=True)
        self.update_gauges()

    def holds_sequences(self) -> bool:
        return bool(self.engine is not None and self.engine.sequences)

    def memory_plan(self) -> list[tuple[str, int]]:
        return self.attached_engine.decoder.memory_plan()

    def update_gauges(self) -> None:
        if self.metrics is not None and self.engine is not None:
            allocator = self.engine.allocator
            self.metrics.set_kv_usage(allocator.num_used_blocks, allocator.num_blocks)

    async def _require(self, context, new_work: bool = False) -> None:
        if self.health.failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is stopping after a fault")
        if self.engine is None or not self.health.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is not ready (loading the model)")
        if new_work and self.health.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is draining: new work is refused")

    async def run_on_model_thread(self, context: grpc.aio.ServicerContext, fn, *args):
        """Runs `fn` on the model thread; maps errors to status codes, treats the unexpected as fatal."""
        future = asyncio.wrap_future(self.executor.submit(fn, *args))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.step_timeout_s)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except CapacityError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ColibriError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except TimeoutError:
            self._fatal(TimeoutError(f"watchdog: a model call ran past {self.step_timeout_s:.0f} s"))
            await context.abort(grpc.StatusCode.INTERNAL, "worker step timed out; the worker is restarting")
        except Exception as e:  # a worker fault (bug, CUDA error, OOM): fail fast
            self._fatal(e)
            await context.abort(grpc.StatusCode.INTERNAL, f"worker fault: {type(e).__name__}: {e}")

    def _fatal(self, error: BaseException) -> None:
        if self.health.failed:  # one fault reaches here from every call that waited on it: logged once
            return
        log.error("worker fault, exiting", exc_info=error)
        self.health.update(failed=True)
        self.on_fatal(error)

    async def Info(self, request, context):
        await self._require(context)
        e, mc = self.engine, self.engine.model_config
        return pb.InfoResponse(
            family=mc.family,
            dtype=e.model.dtype,
            hf_config_json=json.dumps(e.model.hf_config),
            vocab_size=mc.vocab_size,
            max_position_embeddings=mc.max_position_embeddings,
            eos_token_ids=list(mc.eos_token_ids),
            kv_block_size=e.config.kv_block_size,
            num_kv_blocks=e.allocator.num_blocks,
            max_batch_tokens=e.config.max_batch_tokens,
            max_batch_size=e.config.max_batch_size,
            backend=e.backend,
            routing=e.config.routing,
            memory_plan=[pb.MemoryItem(name=n, bytes=b) for n, b in self.memory_plan()],
            model_name=self.model_name,
            expert_slots=wire.slot_plan(e.slot_plan, e.config.expert_cache_policy, e.config.prefetch_sources),
            expert_dtypes=list(e.model.expert_formats),
            head_dtype=e.model.head_format.dtype if e.model.head_format else e.model.dtype,
            attention_dtype=e.model.attention_format.dtype if e.model.attention_format else e.model.dtype,
            prefix_caching=True,
            caches_generated_blocks=True,
            prefix_tokens_for_repetition_only=True,
            model_digest=self.digests.manifest,
            tokenizer_digest=self.digests.tokenizer,
            max_message_bytes=self.max_message_bytes,
            step_timeout_s=self.step_timeout_s,
            # a prediction ignores a row's padding; under lut the plan is the routing: k experts every token
            plans_with_gaps=e.config.routing is not RoutingMode.LUT,
            plan_width=e.decoder.router_plan_width,
        )

    def warmup(self, num_tokens: int) -> float:
        """The start-up warm-up, before any sequence: the backend's own (compiling, capturing graphs) then a
        throw-away step."""
        started = time.perf_counter()
        self.attached_engine.warmup()
        self.throwaway_step(num_tokens)
        return (time.perf_counter() - started) * 1e3

    def throwaway_step(self, num_tokens: int) -> float:
        """One throw-away prefill of `num_tokens` tokens (bounded by the KV pool), then free it. The Warmup RPC's
        whole work: the backend's warm-up reuses state live sequences own (the cuda penalty kernels' warm-up zeroes
        penalty slot 0), so it runs at start-up alone."""
        started = time.perf_counter()
        cfg, mc = self.attached_engine.config, self.attached_engine.model_config
        n = max(
            1,
            min(
                num_tokens,
                cfg.max_batch_tokens,
                mc.max_position_embeddings,
                self.attached_engine.allocator.num_free_blocks * cfg.kv_block_size,
            ),
        )
        ids = np.random.default_rng(0).integers(0, mc.vocab_size, size=n)
        routing_plan = (
            warmup_routing_plan(mc.moe_layers, mc.num_experts, mc.num_experts_per_tok, n)
            if self.attached_engine.config.routing == "lut"
            else None
        )
        try:
            self.attached_engine.step([PrefillInput(-1, ids, SamplingParams(), True)], routing_plan=routing_plan)
        finally:
            self.attached_engine.release([-1])
        return (time.perf_counter() - started) * 1e3

    async def Warmup(self, request, context):
        await self._require(context, new_work=True)
        ms = await self.run_on_model_thread(context, self.throwaway_step, request.max_batch_tokens or 16)
        return pb.WarmupResponse(warmup_ms=ms)

    async def _unary_step(
        self, context, request, message: type[pb.PrefillResponse | pb.DecodeResponse]
    ) -> pb.PrefillResponse | pb.DecodeResponse:
        await self._require(context)
        started = time.perf_counter()
        try:
            step = wire.unary_step_request(request, self._step_limits)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.is_draining() and any(c.request_id not in self.attached_engine.sequences for c in step.chunks):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is draining: new sequences are refused")
        outcome = await self.run_on_model_thread(context, self._unary_session.run, step)
        if outcome.result is None:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if outcome.capacity else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, outcome.refused)
        response = wire.unary_response(
            outcome.result,
            message,
            self.attached_engine.allocator.num_used_blocks,
            (time.perf_counter() - started) * 1e3,
        )
        self._observe(outcome.kind, outcome.result, response.timings.total_ms / 1e3)
        return response

    async def Prefill(self, request, context):
        return await self._unary_step(context, request, pb.PrefillResponse)

    async def Decode(self, request, context):
        return await self._unary_step(context, request, pb.DecodeResponse)

    def _observe(self, kind: str, result: StepResult, seconds: float) -> None:
        m, e = self.metrics, self.attached_engine
        if m is None:
            return
        if kind in ("prefill", "decode"):
            m.worker_step_duration.labels(kind=kind).observe(seconds)
        if result.routing_plan_recall is not None:
            m.observe_recall(result.routing_plan_recall)
        self.update_gauges()
        stats = result.expert_cache
        if stats is not None:
            m.observe_expert_cache(
                stats.hits,
                stats.misses,
                stats.bytes_copied,
                stats.stall_seconds,
                stats.prefetches_issued,
                stats.prefetches_used,
            )
        else:  # all experts resident: every use is a hit that costs nothing
            m.observe_expert_cache(sum(len(np.unique(ids)) for ids in result.trace.expert_ids.values()), 0, 0, 0.0)
        if result.trace.expert_ids:
            num_experts = e.model_config.num_experts
            m.set_load_imbalance(
                [
                    np.bincount(ids.reshape(-1), minlength=num_experts).tolist()
                    for ids in result.trace.expert_ids.values()
                ]
            )

    async def StepStream(self, request_iterator, context):
        """Steps queue on the model thread as they arrive; results go back in order as they complete."""
        await self._require(context, new_work=True)
        session = StreamSession(self.attached_engine, self.sequence_owners, self.is_draining)
        self.live_sessions.add(session.id)
        loop = asyncio.get_running_loop()  # a fault on the model thread reaches the fatal path on the loop
        pump = StepPump(session, self.executor, on_fault=lambda e: loop.call_soon_threadsafe(self._fatal, e))
        queued: asyncio.Queue = asyncio.Queue()
        unanswered = asyncio.Semaphore(MAX_STEPS_AHEAD)
        tracer = get_tracer(self.tracer_provider)
        ended = False

        def end() -> None:
            nonlocal ended
            ended = True
            queued.put_nowait(_END)

        async def receive():
            try:
                async for request in request_iterator:
                    if ended:  # a step behind the end would run at shutdown with nobody to read its answer
                        self._forward_late_masks(pump, request)
                        break
                    span = tracer.start_span("step", context=extract_context(request.trace_context.items()))
                    queued.put_nowait((span, self._submit(pump, request)))
                    await unanswered.acquire()  # reads no further (gRPC flow control holds the client)
            except Exception as e:  # the call went away under us (cancelled, reset): the loop below ends
                log.debug("step stream closed while reading: %s", type(e).__name__)
            finally:
                queued.put_nowait(None)

        self.open_streams += 1
        self._stream_ends.add(end)
        receiver, closing = asyncio.create_task(receive()), None
        try:
            while (item := await queued.get()) is not None:
                if item is _END:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
                span, work = item
                outcome = await self._await_step(work, context)
                span.update_name(f"worker {outcome.kind}")
                span.set_attribute(COLIBRI_STEP_KIND, outcome.kind)
                span.end()
                yield self._stream_response(outcome)
                unanswered.release()
            closing = pump.close()  # the end reaches the caller once the stream's sequences are freed
            with contextlib.suppress(Exception):  # a fault fails it too, and has taken the fatal path already
                await asyncio.shield(asyncio.wrap_future(closing))
        finally:
            receiver.cancel()
            self.open_streams -= 1
            self._stream_ends.discard(end)
            # After every step it queued; the gauge shows the blocks the stream held coming back.
            closed = closing or pump.close()
            closed.add_done_callback(lambda _: self.live_sessions.discard(session.id))
            closed.add_done_callback(lambda _: self.update_gauges())

    def end_streams(self) -> None:
        """Ends every open step stream UNAVAILABLE once the steps queued ahead are answered: a server stopped with
        streams open cancels them from gRPC's core, which the router may read as INTERNAL (a failed step). Steps
        that arrive after are not run: the stream's end frees its sequences and cached blocks without them."""
        for end in list(self._stream_ends):
            end()

    def _forward_late_masks(self, pump: StepPump, request: pb.StepStreamRequest) -> None:
        """Of the first message behind a stream's end, only what the last step ahead of the end waits for: its late
        masks (with the frees that excuse a late stop from needing one). Without them that step would hold its
        answer until LATE_MASKS_TIMEOUT_S, past the server's stop grace. The message runs no step of its own."""
        if request.late_mask_request_ids or request.late_token_masks:
            masks_only = pb.StepStreamRequest(
                step_id=request.step_id,
                free_request_ids=request.free_request_ids,
                late_mask_request_ids=request.late_mask_request_ids,
                late_token_masks=request.late_token_masks,
            )
            self._submit(pump, masks_only)

    def _submit(self, pump: StepPump, request: pb.StepStreamRequest):
        """The step queued on the model thread; a malformed request is refused there too, in order (a step
        waiting for late masks the request carried learns that they will not come), after its frees and
        evictions run."""
        try:
            step = wire.step_request(request, self._step_limits)
        except ColibriError as e:  # malformed: refuse this step alone
            step = wire.refused_step_request(request, self._step_limits, str(e))
        except Exception as e:  # a check missed something: still this step's problem alone
            log.warning("malformed step refused: %s: %s", type(e).__name__, str(e)[:200])
            step = wire.refused_step_request(request, self._step_limits, f"step: malformed ({type(e).__name__})")
        future = asyncio.wrap_future(pump.submit(step))
        # a fault fails every queued step at once; those behind the one awaited are never awaited
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return future

    async def _await_step(self, future, context) -> StepAnswer:
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.step_timeout_s)
        except TimeoutError:
            self._fatal(TimeoutError(f"watchdog: a step ran past {self.step_timeout_s:.0f} s"))
            await context.abort(grpc.StatusCode.INTERNAL, "worker step timed out; the worker is restarting")
        except Exception as e:  # a worker fault (bug, CUDA error, OOM): fail fast
            self._fatal(e)
            await context.abort(grpc.StatusCode.INTERNAL, "worker fault; the worker is restarting")
        raise AssertionError("unreachable: context.abort raises grpc's AbortError")

    def _stream_response(self, outcome: StepAnswer) -> pb.StepStreamResponse:
        result, used = outcome.result, self.attached_engine.allocator.num_used_blocks
        if result is None:
            self.update_gauges()  # a frees-only step
            return wire.refused_response(outcome.step_id, outcome.refused, used, outcome.seconds * 1e3)
        self._observe(outcome.kind, result, outcome.seconds)
        return wire.stream_response(result, outcome.step_id, used, outcome.seconds * 1e3)

    def _keep_only(self, keep_ids) -> list[int]:
        """Frees the unary calls' sequences not kept (a live stream's sequences are its own to free)."""
        keep = set(keep_ids)
        owners = self.sequence_owners
        gone = [r for r in list(self.attached_engine.sequences) if r not in keep and owners.get(r, UNARY) == UNARY]
        for r in gone:
            owners.pop(r, None)
        return self.attached_engine.release(gone)

    def _clear(self) -> int:
        """The worker's reset: frees the unary calls' sequences and drops the cached prefix blocks no open step
        stream owns (a live stream's router still offers its blocks: dropping them would fail its next requests on
        them; a stream's blocks go when it ends). Refused while a step stream holds sequences: freeing them would
        fail (or, with their ids taken again, corrupt) steps that stream already sent; a stream frees its own, and
        all of them when it ends."""
        running = [owner for owner in self.sequence_owners.values() if owner != UNARY]
        if running:
            streams = len(set(running))
            raise ColibriError(
                f"ClearCache: {len(running)} sequences of {streams} open step stream{'s' * (streams > 1)} are "
                "running; nothing was cleared (a stream's sequences are freed by its frees or when it ends)"
            )
        self.sequence_owners.clear()
        return self.attached_engine.clear(keep_owners=frozenset(self.live_sessions))

    async def FilterBatch(self, request, context):
        await self._require(context)
        if len(request.keep_request_ids) > MAX_FREE_IDS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"keep_request_ids: {len(request.keep_request_ids)} ids, at most {MAX_FREE_IDS}",
            )
        freed = await self.run_on_model_thread(context, self._keep_only, list(request.keep_request_ids))
        self.update_gauges()
        return pb.FilterBatchResponse(
            freed_request_ids=freed, kv_blocks_used=self.attached_engine.allocator.num_used_blocks
        )

    async def ClearCache(self, request, context):
        await self._require(context)
        freed = await self.run_on_model_thread(context, self._clear)
        self.update_gauges()
        return pb.ClearCacheResponse(freed_sequences=freed)

    async def Health(self, request, context):
        return pb.HealthResponse(ready=self.ready)
