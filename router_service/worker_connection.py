"""Connecting the batching loop to its worker: wait for a ready worker that will take this router's steps, say why
it is not there yet at most every WAITING_LOG_S, and say once why one refuses it."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from router_service.config import RouterConfig
from router_service.routing import lut_plan_problem
from router_service.worker_client import WorkerClient
from router_service.worker_identity import ModelCheck
from router_service.worker_info import plan_gaps_problem, scheduler_limits, step_timeout_problem

log = logging.getLogger("colibri.router.batching_loop")
# A worker loading a large model keeps the router waiting for minutes: one line when the wait starts, then one
# this often, each with the latest reason (a line every worker_retry_s flooded the log).
WAITING_LOG_S = 30.0
# A worker refusing the reset this long is held by a stream that is not ours (ours ends within seconds of the
# router dropping it, a half-open one at the worker's keepalive, endpoints.SERVER_OPTIONS): worth a WARNING.
BUSY_WARNING_S = 120.0


class _NotReady(Exception):
    pass


class _Busy(Exception):
    """The worker refused ClearCache: another step stream (a stream of ours it has not seen end yet, or another
    caller's) still runs sequences there. It is waited for, as a loading worker is: the reset comes once they end."""


class _Unusable(Exception):
    """The worker answers, but every step this router sends would be refused, it serves another model than this
    router's, or its watchdog is not shorter than the router's step deadline (the reason is the message)."""


class WorkerConnector:
    """One attempt at a time (`attempt`): Info, the routing table's check, Health, ClearCache (we may have restarted
    while it held sequences; refused while a step stream still runs sequences there) and, when configured, a warm-up.
    A worker absent, starting, loading, draining, hung or running another stream's sequences answers UNAVAILABLE,
    not ready, not in time or FAILED_PRECONDITION to ClearCache: the wait is logged at INFO with the reason
    (connection refused, not HTTP/2, ...), when it starts and then every WAITING_LOG_S. One that refuses us (a wrong
    token, another service at the address, a failed warm-up, steps it would refuse: lut_plan_problem,
    worker_info.plan_gaps_problem) or that serves another model than this router's (worker_identity.py) or whose
    step watchdog would outlast the router's step deadline (worker_info.step_timeout_problem) is logged once as a
    WARNING and retried (an upgraded or restarted worker at the address is used), as is a reset refused for
    BUSY_WARNING_S."""

    def __init__(self, config: RouterConfig, worker: WorkerClient, planner=None):
        self.config, self.worker, self.planner = config, worker, planner
        self._refused: str | None = None  # why the worker last refused an attempt (logged once)
        self._waiting_since: float | None = None  # since when attempts have found no worker (None: not waiting)
        self._next_waiting_log = 0.0
        self._busy_since: float | None = None  # since when the worker has refused the reset (None: it has not)
        self.model = ModelCheck(config.model)

    async def attempt(self):
        """The worker's InfoResponse once it is ready for steps, or None after waiting `worker_retry_s`."""
        try:
            info = await self.worker.info()
            if (unusable := lut_plan_problem(info.routing, self.planner)) is not None:
                raise _Unusable(unusable)
            if (gaps := plan_gaps_problem(self.config, info, self.planner)) is not None:
                raise _Unusable(gaps)
            if (other_model := self.model.problem(info)) is not None:
                raise _Unusable(other_model)
            if (timeouts := step_timeout_problem(self.config, info)) is not None:
                raise _Unusable(timeouts)
            if not await self.worker.health():
                raise _NotReady()
            await self._clear_cache()
            if self.config.warmup:
                await self._warmup(scheduler_limits(self.config, info).max_batch_tokens)
        except (grpc.aio.AioRpcError, _NotReady, _Busy, _Unusable) as e:
            self._report(e)
            await asyncio.sleep(self.config.worker_retry_s)
            return None
        self._refused, self._waiting_since, self._busy_since = None, None, None
        self.model.accept(info)
        return info

    async def _clear_cache(self) -> None:
        try:
            await self.worker.clear_cache()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            raise _Busy(e.details() or "the worker runs another stream's sequences") from None

    async def _warmup(self, max_batch_tokens: int) -> None:
        try:
            await self.worker.warmup(max_batch_tokens)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise

    def _report(self, e: Exception) -> None:
        self._report_busy(e)
        refused = str(e) if isinstance(e, _Unusable) else None
        waiting = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # absent, loading, hung
        if isinstance(e, grpc.aio.AioRpcError) and e.code() not in waiting:
            refused = f"{e.code().name}: {e.details()}"
        if refused is not None:
            if refused != self._refused:
                log.warning(
                    "the router cannot use the worker at %s (%s); retrying every %g s",
                    self.worker.address,
                    refused,
                    self.config.worker_retry_s,
                )
            self._waiting_since = None
        else:
            self._waiting(self._why_waiting(e))
        self._refused = refused

    def _report_busy(self, e: Exception) -> None:
        """One WARNING once the worker has refused the reset for BUSY_WARNING_S: an INFO line every WAITING_LOG_S
        is easily missed while the router serves nothing for as long as that stream lives."""
        if not isinstance(e, _Busy):
            self._busy_since = None
            return
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
        elif now - self._busy_since >= BUSY_WARNING_S:
            log.warning(
                "the worker at %s has refused the router's reset for %.0f s (%s): another client's step stream, "
                "a second router using this worker?, holds them; the router connects once that stream ends",
                self.worker.address,
                now - self._busy_since,
                e,
            )
            self._busy_since = float("inf")  # once per wait

    def _why_waiting(self, e: Exception) -> str:
        if isinstance(e, _NotReady):
            return "not ready yet"
        if not isinstance(e, grpc.aio.AioRpcError):
            return str(e)
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "no answer in time"
        return e.details() or e.code().name  # gRPC's: connection refused, not HTTP/2, the worker's loading, ...

    def _waiting(self, why: str) -> None:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
            log.info(
                "waiting for the worker at %s (%s); retrying every %g s",
                self.worker.address,
                why,
                self.config.worker_retry_s,
            )
        elif now >= self._next_waiting_log:
            log.info(
                "still waiting for the worker at %s after %.0f s (%s)",
                self.worker.address,
                now - self._waiting_since,
                why,
            )
        else:
            return
        self._next_waiting_log = now + WAITING_LOG_S


class ReadinessWatch:
    """Asks the worker's Health every `interval` while requests run (the idle loop asks on its own). A worker that
    starts draining (its SIGTERM) or whose model thread is wedged answers not ready long before its step stream
    ends: the router stops admitting requests then, not once those in flight are done."""

    def __init__(self, worker: WorkerClient, interval: float):
        self.worker, self.interval = worker, interval
        self._probe: asyncio.Future | None = None
        self._next = 0.0

    def answer(self) -> bool | None:
        """The worker's readiness if a probe answered since the last call, else None; starts the next probe when
        one is due. Never waits. A probe that fails is no answer: a lost worker is told by its stream's end."""
        probe, answer = self._probe, None
        if probe is not None and probe.done():
            self._probe = None
            if not probe.cancelled() and probe.exception() is None:
                answer = probe.result()
        now = time.monotonic()
        if self._probe is None and now >= self._next:
            self._next = now + self.interval
            self._probe = asyncio.ensure_future(self.worker.health(timeout=self.interval))
        return answer

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        self._next = 0.0
