"""The router's batching loop: one asyncio task (schedule -> worker step -> update) and the requests it serves.

`_step` keeps up to `pipeline_depth` scheduled steps on the worker's step stream (step_pipeline.py) and applies the
oldest answer (step_results.py); everything else feeds it. Requests enter through `submit` (admission: draining,
worker readiness, bounded concurrency), receive `Delta`s on their own asyncio queue, and leave via a finish reason,
an error, or `cancel` (which frees their KV blocks at once and wakes the loop, so the next step carries the worker's
free). When the worker fails, every request in flight ends (INTERNAL for the batch the worker failed, UNAVAILABLE
otherwise) and the loop reconnects: Info, Health, ClearCache.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from common.errors import InvalidRequestError
from router_service import wire
from router_service.config import RouterConfig
from router_service.constraints import ConstraintCompiler, GrammarMatcher, may_mask_late
from router_service.errors import DeadlineExceeded, GenerationFailed, Overloaded, RouterError, Unavailable, log_text
from router_service.generation_defaults import GenerationDefaults
from router_service.grammar_compiles import compile_matcher
from router_service.observability import BatchingLoopHooks
from router_service.request_state import (
    RequestHandle,
    RequestState,
    deadline_error,
    in_request_span,
    new_request_id,
)
from router_service.scheduler import FinishReason, ScheduledRequest, ScheduledStep, Scheduler
from router_service.step_pipeline import StepPipeline
from router_service.step_results import StepResults
from router_service.tokenizer import StopSequenceMatcher, Tokenizer
from router_service.validation import ModelLimits, ValidatedRequest
from router_service.worker_client import WorkerClient
from router_service.worker_connection import ReadinessWatch, WorkerConnector
from router_service.worker_info import (
    kept_compiler,
    model_limits,
    planner_for,
    prefix_index,
    scheduler_limits,
    sends_prefix_tokens,
    step_size,
)

log = logging.getLogger("colibri.router.batching_loop")
IDLE_POLL_S = 1.0  # while idle: expire queue deadlines and check the worker's health this often


class BatchingLoop:
    def __init__(
        self,
        config: RouterConfig,
        worker: WorkerClient,
        tokenizer: Tokenizer | None = None,
        hooks: BatchingLoopHooks | None = None,
        planner=None,
    ):
        self.config, self.worker, self.tokenizer = config, worker, tokenizer
        self.planner = planner  # RoutingPlanner when a static routing table is configured
        self.generation_defaults = GenerationDefaults.from_model_dir(config.model)
        if self.generation_defaults != GenerationDefaults():
            log.info("generation_config.json: requests inherit %s", self.generation_defaults.describe())
        self.hooks = hooks or BatchingLoopHooks()
        self.info = None  # the worker's InfoResponse once connected
        self._connector = WorkerConnector(config, worker, planner)
        self.limits: ModelLimits | None = None
        self.scheduler: Scheduler | None = None
        self.is_worker_ready = False
        self.is_worker_draining = False  # connected, but the worker takes no new request (it said not ready)
        self._readiness = ReadinessWatch(worker, IDLE_POLL_S)
        self.is_draining = False
        self._requests: dict[int, RequestState] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._pipeline = StepPipeline(self._requests, planner)  # the steps on the worker's step stream
        self._results = StepResults(self, self._requests)  # their answers, applied
        # The static table looks up each step's input tokens, which a pipeline has not seen yet.
        self._depth = 1 if planner is not None else config.pipeline_depth
        self._num_constrained = 0  # requests with a grammar: while any runs, at most two steps are in flight
        self._constraints: ConstraintCompiler | None = None  # built on the first constrained request

    # ---- lifecycle ----
    async def start(self) -> None:
        self.hooks.on_attached(self)
        self._task = asyncio.create_task(self._run(), name="colibri-batching-loop")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for seq_id in list(self._requests):
            self.fail(seq_id, Unavailable("the router is shutting down", retry_after_s=self.config.retry_after_s))
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._close_stream()

    def start_draining(self) -> None:
        self.is_draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    @property
    def num_active(self) -> int:
        return len(self._requests)

    @property
    def _ready_scheduler(self) -> Scheduler:
        """The scheduler: steps run only once _configure made it (it stays for the next connection)."""
        assert self.scheduler is not None, "no scheduler: the loop steps only once the worker's info came"
        return self.scheduler

    # ---- requests ----
    def submit(
        self, req: ValidatedRequest, deadline: float | None = None, span_context=None, matcher=None, chat: bool = False
    ) -> RequestHandle:
        """`matcher`: req.constraint's, compiled by the caller off the event loop (`compile_constraint`); else
        compiled here. `chat`: a request without an id gets a chat's (request_state.new_request_id)."""
        retry_s = self.config.retry_after_s
        if self.is_draining:
            raise Unavailable("the router is shutting down; retry on another replica", "DRAINING", retry_s)
        if not self.is_worker_ready or self.scheduler is None or self.limits is None:
            raise Unavailable("the worker is not ready; retry shortly", "WORKER_UNAVAILABLE", retry_s)
        if self.is_worker_draining:
            raise Unavailable("the worker is shutting down; retry shortly", "DRAINING", retry_s)
        if len(self._requests) >= self.config.max_concurrent_requests:
            raise Overloaded.at_capacity(self.config.max_concurrent_requests, self.config.retry_after_s)
        if not self.scheduler.fits(len(req.prompt_ids) + req.max_new_tokens):  # validated for a worker since gone
            raise InvalidRequestError(
                "parameters.max_new_tokens",
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) must be <= KV "
                f"capacity ({self.limits.kv_capacity_tokens})",
            )
        now = time.monotonic()
        deadline = min(deadline or float("inf"), now + self.config.request_timeout_s)
        seq_id = next(self._ids)
        state = RequestState(
            seq_id,
            req.request_id or new_request_id(chat),
            req,
            deadline,
            span_context=span_context,
            arrived_at=now,
        )
        if self.tokenizer is not None:
            state.detokenizer = self.tokenizer.detokenizer(req.prompt_ids)
            state.stops = StopSequenceMatcher(req.stop_sequences)
        if req.constraint is not None:
            state.matcher = matcher or self._constraint_compiler().matcher(req.constraint, req.ignore_eos)
        eos = frozenset() if req.ignore_eos else frozenset(self.limits.eos_token_ids)
        sampling = wire.sampling_params(req, self.limits.eos_token_ids)
        scheduled = ScheduledRequest(
            seq_id,
            list(req.prompt_ids),
            req.max_new_tokens,
            eos,
            frozenset(req.stop_token_ids),
            sampling=sampling,
            sampling_bytes=sampling.ByteSize(),
            queue_deadline=min(deadline, now + self.config.queue_timeout_s),
            scores_prompt=req.prompt_logprobs is not None,
            penalized=req.penalized,
            sends_prefix_tokens=sends_prefix_tokens(req, self.info),
            constrained=state.matcher is not None,
            late_masks=state.matcher is not None and self._depth >= 2 and may_mask_late(req),
            cache_salt=req.cache_salt,
            prompt_bytes=req.prompt_bytes,
        )
        if (too_large := self.scheduler.step_size.problem(scheduled)) is not None:  # no step could carry it
            raise InvalidRequestError(*too_large)
        self.scheduler.add(scheduled)
        self._requests[seq_id] = state
        self._num_constrained += state.matcher is not None
        self._pipeline.arrived(now)
        self.hooks.on_admitted(state)
        self._idle.clear()
        self._wake.set()
        return RequestHandle(self, state)

    async def compile_constraint(self, req: ValidatedRequest) -> GrammarMatcher | None:
        """req's grammar matcher, compiled on a thread (a new grammar's lexer may take a fraction of a second) while
        its caller waits."""
        if req.constraint is None:
            return None
        return await compile_matcher(self._constraint_compiler(), req.constraint, req.ignore_eos)

    def _constraint_compiler(self) -> ConstraintCompiler:
        if self.tokenizer is None or self.info is None or self.limits is None:
            raise InvalidRequestError("parameters.constraint", "constrained decoding needs the model's tokenizer")
        if self._constraints is None:
            self._constraints = ConstraintCompiler(
                self.tokenizer.to_json(), self.info.vocab_size, self.limits.eos_token_ids
            )
        return self._constraints

    def cancel(self, seq_id: int) -> None:
        self._end(seq_id, None, "cancelled", FinishReason.CANCELLED)

    def fail(self, seq_id: int, error: RouterError | InvalidRequestError) -> None:
        outcome = error.code.name.lower() if isinstance(error, RouterError) else "invalid_argument"
        self._end(seq_id, error, outcome, FinishReason.ERROR)

    def finish(self, seq_id: int, reason: FinishReason) -> None:
        """Ends a request whose last Delta is on its queue."""
        self._end(seq_id, None, "ok", reason)

    def _end(
        self, seq_id: int, error: RouterError | InvalidRequestError | None, outcome: str, reason: FinishReason
    ) -> None:
        state = self._requests.pop(seq_id, None)
        if state is None:
            return
        self._num_constrained -= state.matcher is not None
        if self.scheduler is not None:
            self.scheduler.finish(seq_id, reason)  # blocks back now; the next step frees it on the worker
        state.is_done = True
        if error is not None:
            state.queue.put_nowait(error)
        now = time.monotonic()
        # One line per request, with ids, sizes and timings only: prompts and outputs are never logged. It is
        # in the request span's trace (trace_id, span_id), though the loop, outside any request's task, may end it.
        with in_request_span(state):
            log.info(
                "request %s",
                outcome,
                extra={
                    "request_id": state.request_id,
                    "outcome": outcome,
                    "finish_reason": reason.name.lower(),
                    "prompt_tokens": len(state.req.prompt_ids),
                    "generated_tokens": state.num_generated,
                    "duration_s": round(now - state.arrived_at, 6),
                    "queue_s": round((state.scheduled_at or now) - state.arrived_at, 6),
                    **({"error": log_text(error)} if error is not None else {}),
                },
            )
        self.hooks.on_request_done(state, outcome, now)
        if not self._requests:
            self._idle.set()
        self._wake.set()

    # ---- the loop ----
    async def _run(self) -> None:
        while not self._stopping:
            try:
                if not self.is_worker_ready:
                    await self._connect()
                else:
                    await self._step()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                self._on_worker_failure(e, ())
            except Exception:  # a bug: fail what is in flight, keep serving
                log.exception("batching loop error")
                self._fail_all(lambda _: GenerationFailed("internal router error"))
                await asyncio.sleep(self.config.worker_retry_s)

    @property
    def _pipeline_limit(self) -> int:
        """Steps kept on the worker: `pipeline_depth`, but at most two while a constrained request runs. Its grammar
        mask for step t needs the token of step t-1 and rides the message of step t+1, which at three in flight
        would leave before that token is back (the worker would wait for the mask with every other row)."""
        return min(self._depth, 2) if self._num_constrained else self._depth

    async def _step(self) -> None:
        """Keep up to `pipeline_depth` steps on the worker, then apply the oldest result; while the pipeline
        has room, a new arrival (or a cancel) wakes the loop to schedule it instead of waiting."""
        self._wake.clear()
        if self._requests and (ready := self._readiness.answer()) is not None and ready == self.is_worker_draining:
            self.worker_readiness_changed(ready)  # asked while requests run (idle, _idle_wait asks)
        # The stream ended with nothing in flight (its end woke us): reconnect now, not on the next request's step.
        if not self._pipeline and (lost := await self._pipeline.stream.end_error()) is not None:
            raise lost
        try:
            await self._fill_pipeline()
        finally:
            self._results.deliver_deferred()
        if not self._pipeline:
            await self._idle_wait()
            return
        receiving = self._pipeline.receiving()
        waiting: set[asyncio.Future] = {receiving}
        if len(self._pipeline) < self._pipeline_limit:
            waiting.add(asyncio.ensure_future(self._wake.wait()))
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for future in waiting - {receiving}:
            future.cancel()
        if not receiving.done():
            return
        try:
            sent, response = self._pipeline.answer()
        except grpc.aio.AioRpcError as e:  # the steps in flight are the batch the worker failed
            self._on_worker_failure(e, self._pipeline.in_flight_ids())
            return
        self._results.apply(sent, response, late_masks_due=bool(self._pipeline.late_ids))

    async def _fill_pipeline(self) -> None:
        while len(self._pipeline) < self._pipeline_limit:
            if self._pipeline:
                if not self._pipeline.late_ids:  # a step waiting for late masks would stall until this send
                    self._results.deliver_deferred()  # no masks due: what was held for them goes before the wait
                    await self._pipeline.await_arrivals()
                # The worker failed the stream meanwhile: apply that first. A send on the ended stream would report
                # a lost worker (UNAVAILABLE to all) instead of the failed step's error to its requests.
                if self._pipeline.has_failed():
                    return
            now = time.monotonic()
            scheduler = self._ready_scheduler
            # the late masks the step sent last waits for ride this message: its budget holds them first
            step = scheduler.schedule(now, len(self._pipeline.late_ids) * scheduler.step_size.mask_bytes)
            for seq_id in step.expired_ids:
                # its queue deadline is the earliest of queue_timeout_s, request_timeout_s and the client's: name it
                state = self._requests.get(seq_id)
                if state is not None and state.deadline <= now:
                    self.fail(seq_id, deadline_error(state, self.config.request_timeout_s))
                    continue
                queue = f"waited in the queue longer than queue_timeout_s={self.config.queue_timeout_s:g}"
                self.fail(seq_id, DeadlineExceeded(queue, reason="QUEUE_TIMEOUT"))
            self._report_prefix_cache()
            late = self._pipeline.late_masks()
            if step.is_empty and not (step.free_ids or step.evict_block_ids or step.sequence_blocks or late):
                return
            await self._send(step, late)
            if step.is_empty:  # frees only: nothing else could be scheduled
                return

    async def _send(self, step: ScheduledStep, late_masks: dict[int, bytes] | None = None) -> None:
        started = time.monotonic()
        states = [s for s in map(self._requests.get, step.num_scheduled_tokens) if s is not None]
        for state in states:
            if state.scheduled_at is None:
                state.scheduled_at = started
                scheduled = self._ready_scheduler.requests.get(state.seq_id)
                state.num_cached_tokens = scheduled.num_cached_tokens if scheduled is not None else 0
                self.hooks.on_scheduled(state, started)
        await self._pipeline.send(step, states, late_masks, self._constraints is not None, started)

    async def _idle_wait(self) -> None:
        if not self._requests:
            self._readiness.close()  # an answer from while requests ran is stale by the next request
        try:
            await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
        except TimeoutError:
            if self._requests:
                return
            if not await self.worker.health(timeout=IDLE_POLL_S):
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "worker reports not ready"
                ) from None
            if self.is_worker_draining:
                self.worker_readiness_changed(True)

    def _close_stream(self) -> None:
        self._readiness.close()
        self._pipeline.close()

    def _fail_all(self, error_for) -> None:
        for seq_id in list(self._requests):
            self.fail(seq_id, error_for(seq_id))

    def _on_worker_failure(self, e: grpc.aio.AioRpcError, batch) -> None:
        expected = self.is_worker_draining and e.code() == grpc.StatusCode.UNAVAILABLE  # its stream's end
        log.log(logging.INFO if expected else logging.ERROR, "worker call failed: %s %s", e.code().name, e.details())
        batch_error = (
            GenerationFailed(f"the worker failed the step: {e.details()}")
            if e.code() == grpc.StatusCode.INTERNAL
            else None
        )
        other = Unavailable(
            f"lost the worker ({e.code().name}); retry shortly", "WORKER_UNAVAILABLE", self.config.retry_after_s
        )
        self._fail_all(lambda seq_id: batch_error if batch_error and seq_id in batch else other)
        if self.scheduler is not None:
            self.scheduler.clear()
        self._close_stream()
        self.is_worker_ready = self.is_worker_draining = False
        self.hooks.on_worker_state(False)

    def worker_readiness_changed(self, ready: bool) -> None:
        """The worker's readiness changed while its stream runs. Draining (its SIGTERM) or wedged, it takes no new
        sequence: readiness turns NOT_SERVING and new requests are refused at once, while those in flight step on
        until the stream ends (or the worker is ready again)."""
        self.is_worker_draining = not ready
        if not ready:  # a probe asked before the worker drained would answer "ready" and undo this
            self._readiness.close()
        if ready:
            log.info("the worker at %s is ready again", self.worker.address)
        else:
            log.warning(
                "the worker at %s is not ready (draining?): new requests are refused, %d in flight go on",
                self.worker.address,
                len(self._requests),
            )
        self.hooks.on_worker_state(ready)

    async def _connect(self) -> None:
        """Waits for a ready worker, then (re)configures limits and scheduler from its Info."""
        info = await self._connector.attempt()
        if info is None:
            return
        self._configure(info)
        stream = self.worker.open_step_stream()
        stream.on_end(self._wake.set)
        self._pipeline.open(stream, info.vocab_size)
        self.is_worker_ready = True
        log.info(
            "worker ready: %s %s, %d KV blocks of %d tokens",
            info.family,
            info.backend,
            info.num_kv_blocks,
            info.kv_block_size,
        )
        self.hooks.on_worker_state(True)

    def _configure(self, info) -> None:
        self.info = info
        planner = planner_for(self.planner, info)  # each token's predictions as many as the worker reads
        self._pipeline.planner = planner
        self.scheduler = Scheduler(
            scheduler_limits(self.config, info),
            prefix_index(self.config, info),
            step_size(self.config, info, planner),
        )
        self.limits = model_limits(info, self.generation_defaults, self.tokenizer is not None)
        self._constraints = kept_compiler(self._constraints, self.limits)  # built again if its vocabulary changed

    def _report_prefix_cache(self) -> None:
        cache = self._ready_scheduler.prefix_cache
        if cache is None:
            return
        counts = cache.unreported_counts()
        if any(counts):
            self.hooks.on_prefix_cache(*counts)

    @property
    def prefix_caching(self) -> bool:
        return self.scheduler is not None and self.scheduler.prefix_cache is not None
