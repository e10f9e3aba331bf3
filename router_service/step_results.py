"""The worker's answer to a step the batching loop sent, applied: the scheduler's update, the step's metrics, and
each output delivered to its request's client (a Delta on its queue, or the error that ends the request). While the
step in flight waits for late grammar masks, what those masks do not need waits for the next send
(delivery.split_for_late_masks)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Protocol

import grpc

from common.errors import InvalidRequestError
from common.pb import worker_pb2
from router_service import wire
from router_service.config import RouterConfig
from router_service.delivery import output_delta, split_for_late_masks
from router_service.errors import GenerationFailed, RouterError, Unavailable
from router_service.observability import BatchingLoopHooks
from router_service.request_state import Delta, RequestState
from router_service.scheduler import FinishReason, Scheduler
from router_service.step_pipeline import SentStep

log = logging.getLogger("colibri.router.batching_loop")


class _Loop(Protocol):
    """What applying an answer asks of the batching loop that sent the step."""

    config: RouterConfig
    hooks: BatchingLoopHooks
    scheduler: Scheduler | None
    is_worker_draining: bool

    def fail(self, seq_id: int, error: RouterError | InvalidRequestError) -> None: ...

    def finish(self, seq_id: int, reason: FinishReason) -> None: ...

    def worker_readiness_changed(self, ready: bool) -> None: ...


class StepResults:
    """Applies the answers to `loop`'s steps, oldest first; `requests`: the loop's requests by id, where each
    output goes."""

    def __init__(self, loop: _Loop, requests: Mapping[int, RequestState]):
        self._loop, self._requests = loop, requests
        self._last_result_at = 0.0
        # Outputs of the last answer delivered after the next send: (output, its grammar already advanced). While
        # late masks are due, only the grammars of their requests are on the path from an answer to that send.
        self._deferred: list[tuple[object, bool]] = []

    @property
    def _scheduler(self) -> Scheduler:
        """The loop's scheduler: a step was answered, so the worker's info came and made it."""
        assert self._loop.scheduler is not None, "no scheduler: the loop steps only once the worker's info came"
        return self._loop.scheduler

    def apply(self, sent: SentStep, response: worker_pb2.StepStreamResponse, late_masks_due: bool) -> None:
        """`response` to the oldest step in flight, `sent`; `late_masks_due`: the step now oldest in flight waits
        for masks computed from these tokens."""
        sent.span.end()
        if response.step_id != sent.step_id:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INTERNAL,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                f"step stream out of order: got step {response.step_id}, expected {sent.step_id}",
            )
        step = sent.step
        if step.is_empty:  # frees, evictions, registrations of blocks steps already sent write: nothing to deliver
            return self._scheduler.settle_empty(step, bool(response.step_error))
        if response.step_error:  # the worker refused the whole step: its requests fail, the rest go on
            log.error("worker refused step %d: %s", sent.step_id, response.step_error)
            self._scheduler.refused(step)
            for seq_id in step.num_scheduled_tokens:
                if seq_id in self._requests:
                    self._loop.fail(seq_id, GenerationFailed("the worker refused the step", reason="STEP_REFUSED"))
            return
        outputs = self._scheduler.update(step, wire.request_outputs(response))
        worker_ms = response.timings.total_ms
        # A pipelined step waits on the worker behind the one ahead of it: its round trip starts when both it
        # was sent and the previous result was back, so the transport metric stays transport, not queueing.
        now = time.monotonic()
        began, self._last_result_at = max(sent.started, self._last_result_at), now
        self._loop.hooks.on_step(
            step.kind,
            len(step.num_scheduled_tokens),
            step.num_tokens,
            now - began,
            worker_ms / 1000 if worker_ms > 0 else None,
            self._scheduler.num_running,
            self._scheduler.num_waiting,
            len(self._requests),
        )
        now, later, failed = split_for_late_masks(outputs, self._requests, late_masks_due)
        for seq_id, error in failed:
            self._loop.fail(seq_id, error)
        for out, grammar_advanced in now:
            self._deliver(out, grammar_advanced)
        self._deferred += later

    def deliver_deferred(self) -> None:
        """The outputs `apply` held back so the next message (with the late masks) left first, in order."""
        deferred, self._deferred = self._deferred, []
        for out, grammar_advanced in deferred:
            self._deliver(out, grammar_advanced)

    def _deliver(self, out, grammar_advanced: bool = False) -> None:
        state = self._requests.get(out.request_id)
        if state is None:
            return
        try:
            delta = output_delta(state, out, self._loop.hooks.on_token, grammar_advanced)
        except Exception:  # this request's text failed (the tokenizer library on ids it cannot decode): it alone
            log.exception("delivering a token failed", extra={"request_id": state.request_id})
            delta = GenerationFailed("internal router error")
        if not isinstance(delta, Delta):
            if isinstance(delta, Unavailable) and delta.reason == "DRAINING":
                delta.retry_after_s = self._loop.config.retry_after_s  # the worker's refusal knows no router setting
                if not self._loop.is_worker_draining:
                    self._loop.worker_readiness_changed(False)
            self._loop.fail(state.seq_id, delta)
            return
        state.queue.put_nowait(delta)
        if delta.finish_reason is not None:
            self._loop.finish(state.seq_id, delta.finish_reason)
