"""The steps the batching loop keeps on its worker's step stream: each sent with its CLIENT span, routing plan and
grammar masks, answered in the order sent. While a step runs, the next one waits for a burst of arrivals to pause
(`await_arrivals`), longer behind a long prefill (router_service/worker_backlog.py). What to schedule, and what an
answer means for its requests, is the loop's (batching_loop.py, step_results.py)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace

from common.pb import worker_pb2
from common.tracing import (
    COLIBRI_BATCH_SIZE,
    COLIBRI_BATCH_TOKENS,
    COLIBRI_STEP_KIND,
    get_tracer,
    inject_metadata,
    links_from_contexts,
)
from router_service import wire
from router_service.constraints import late_mask_ids, masks_of, step_masks
from router_service.request_state import RequestState
from router_service.scheduler import ScheduledStep
from router_service.worker_backlog import WorkerBacklog
from router_service.worker_client import StepStream

# A burst of arrivals (clients sharing a system prompt) joins one pipelined step: while a step runs on the worker,
# the next is scheduled once submits pause this long, or this long after the burst began (see await_arrivals).
ARRIVAL_QUIET_S = 0.001
ARRIVAL_WINDOW_S = 0.005


@dataclass(frozen=True)
class SentStep:
    """A step sent on the step stream whose result has not come back."""

    step: ScheduledStep
    step_id: int
    started: float
    span: trace.Span
    late_ids: tuple[int, ...] = ()  # constrained decodes whose masks go with the next message


class StepPipeline:
    """The steps in flight on the step stream, oldest first (`len`: how many). `requests`: the batching loop's
    requests by id, read for their grammar masks; `planner`: the RoutingPlanner whose plan each step carries, when
    a static routing table is configured."""

    def __init__(self, requests: Mapping[int, RequestState], planner=None):
        self._requests, self.planner = requests, planner
        self._stream: StepStream | None = None
        self._vocab_size = 0
        self._in_flight: collections.deque[SentStep] = collections.deque()
        self._receiving: asyncio.Future[worker_pb2.StepStreamResponse] | None = None
        self._step_ids = itertools.count(1)
        self._backlog = WorkerBacklog()
        self._last_arrival_at = self._burst_started_at = 0.0

    def open(self, stream: StepStream, vocab_size: int) -> None:
        """Steps go on `stream` from now on, to a worker whose vocabulary (a grammar mask's length) has
        `vocab_size` tokens."""
        self._stream, self._vocab_size = stream, vocab_size
        self._backlog = WorkerBacklog()  # another worker (or the same one restarted) has its own pace

    @property
    def stream(self) -> StepStream:
        """The step stream: open while the worker is ready (the loop's connect opens it, a worker failure closes
        it)."""
        assert self._stream is not None, "no step stream: the loop steps only while the worker is ready"
        return self._stream

    def close(self) -> None:
        for sent in self._in_flight:
            sent.span.end()
        self._in_flight.clear()
        if self._receiving is not None:
            self._receiving.cancel()
            self._receiving = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __len__(self) -> int:
        return len(self._in_flight)

    def in_flight_ids(self) -> set[int]:
        """The requests the steps in flight carry: the batch a worker that fails the stream failed."""
        return {seq_id for sent in self._in_flight for seq_id in sent.step.num_scheduled_tokens}

    def arrived(self, now: float) -> None:
        """A request was submitted at `now`: after a pause of ARRIVAL_QUIET_S it begins a burst."""
        if now - self._last_arrival_at > ARRIVAL_QUIET_S:
            self._burst_started_at = now
        self._last_arrival_at = now

    async def await_arrivals(self) -> None:
        """While a step runs on the worker and requests are arriving, wait for the burst to pause (at most
        ARRIVAL_WINDOW_S after it began, and never past the running step's answer) before scheduling the next
        step. Requests arriving after a step is scheduled wait for the one after it: without this, 16 clients
        arriving within a few milliseconds split over two steps, and with a shared prefix the late ones start a
        step later. The worker is busy meanwhile, so the wait costs no device time unless that step is shorter.
        Behind a long prefill (a 2,048-token prompt runs for 15 ms on an H200) the wait stretches to what that
        work leaves, with a longer quiet period (router_service/worker_backlog.py)."""
        receiving = self.receiving()
        prompts = ((sent.started, sent.step.num_prompt_tokens) for sent in self._in_flight)
        window_end, quiet_s = self._backlog.arrival_wait(
            prompts, self._burst_started_at + ARRIVAL_WINDOW_S, ARRIVAL_QUIET_S
        )
        while not receiving.done():
            now = time.monotonic()
            quiet_at = self._last_arrival_at + quiet_s
            if now >= quiet_at or now >= window_end:
                return
            await asyncio.wait({receiving}, timeout=min(quiet_at, window_end) - now)

    @property
    def late_ids(self) -> tuple[int, ...]:
        """The constrained decodes of the step sent last whose masks go with the next message (none: ())."""
        return self._in_flight[-1].late_ids if self._in_flight else ()

    def late_masks(self) -> dict[int, bytes] | None:
        """The masks the step sent last still waits for (None: none), now that the tokens before them are back:
        they go with the next message, whatever it carries. A request gone since (a late stop, a cancel) is freed
        by that message and needs none."""
        if not self.late_ids:
            return None
        return masks_of(self.late_ids, self._requests, self._vocab_size) or None

    async def send(
        self,
        step: ScheduledStep,
        members: list[RequestState],
        late_masks: dict[int, bytes] | None,
        constrained: bool,
        started: float,
    ) -> None:
        """Sends `step` (`members`: the requests it carries; `constrained`: a grammar may be among them) with the
        `late_masks` the step before waits for; `started`: when the loop began sending it."""
        # One CLIENT span per step, linked to its members' request spans; its context travels in the step,
        # so the worker's step span is its child.
        span = get_tracer().start_span(
            step.kind,
            kind=trace.SpanKind.CLIENT,
            links=links_from_contexts(s.span_context for s in members),
            attributes={
                COLIBRI_STEP_KIND: step.kind,
                COLIBRI_BATCH_SIZE: len(step.num_scheduled_tokens),
                COLIBRI_BATCH_TOKENS: step.num_tokens,
            },
        )
        routing_plan = self.planner.routing_plan(step) if self.planner is not None and not step.is_empty else None
        late_ids = late_mask_ids(step, self._requests) if constrained else ()
        masks = step_masks(step, self._requests, self._vocab_size, late_ids)
        request = wire.step_request(step, next(self._step_ids), routing_plan, masks, late_masks)
        request.trace_context.update(inject_metadata(trace.set_span_in_context(span)))
        self._in_flight.append(SentStep(step, request.step_id, started, span, late_ids))
        await self.stream.send(request)

    def receiving(self) -> asyncio.Future[worker_pb2.StepStreamResponse]:
        """The oldest step's answer, on its way (received from the stream once asked for)."""
        if self._receiving is None:
            self._receiving = asyncio.ensure_future(self.stream.receive())
        return self._receiving

    def has_failed(self) -> bool:
        """Whether the stream failed while steps were in flight: its error waits to be applied."""
        receiving = self._receiving
        return receiving is not None and receiving.done() and (receiving.cancelled() or bool(receiving.exception()))

    def answer(self) -> tuple[SentStep, worker_pb2.StepStreamResponse]:
        """Once `receiving()` is done: the oldest step and the worker's StepStreamResponse to it. Raises the
        stream's failure (a lost worker), the steps in flight still in place."""
        receiving, self._receiving = self._receiving, None
        assert receiving is not None, "no answer: receiving() was not asked for"
        response = receiving.result()
        sent = self._in_flight.popleft()
        # a refused step ran no prompt work: it teaches no pace (its quick answer would plant a near-zero one)
        prompt_tokens = 0 if response.step_error else sent.step.num_prompt_tokens
        worker_s = response.timings.total_ms / 1e3
        self._backlog.answered(sent.started, prompt_tokens, time.monotonic(), worker_s)
        return sent, response
