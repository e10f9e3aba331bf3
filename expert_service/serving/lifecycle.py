"""The worker's model thread and its health, and the end of both (the engine's close, the parent's exit).

All model work runs on one daemon thread (`ModelThread`), in submission order, so the event loop answers
health, Info and new calls during long steps, and a wedged device call can never keep the process from
exiting. `WorkerHealth` publishes the standard grpc.health.v1 statuses from what it observes:

- `colibri.liveness`: the process is up and the model thread is not wedged (no job has run past the
  watchdog, and a heartbeat sent to the thread comes back within it). SERVING while the model loads.
- `""`, `colibri.readiness` and `colibri.worker.v1.WorkerService`: the model is verified and warmed up, the
  worker is not draining and it is live (`""` is what balancers check by default: "will serve a call now").

After a worker fault every service is NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

if TYPE_CHECKING:
    from expert_service.engine.engine import Engine

LIVENESS, READINESS = "colibri.liveness", "colibri.readiness"
WORKER_SERVICE = "colibri.worker.v1.WorkerService"
HEARTBEAT_S = 2.0
log = logging.getLogger("colibri.worker")
ENGINE_CLOSE_WAIT_S = 5.0  # an idle model thread ends at once; one stuck in a step is not waited for
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _CancelledStreamFilter(logging.Filter):
    """gRPC logs an ERROR when a result is written to a stream whose caller has just cancelled it (a race
    inside gRPC between the cancellation and the write). That is the caller's choice, not a fault: it is
    logged at DEBUG instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("ExecuteBatchError raised in core"):
            logging.getLogger("colibri.worker").debug("a result was not sent: the caller cancelled the call")
            return False
        return True


def quiet_cancelled_streams() -> None:
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, _CancelledStreamFilter) for f in grpc_log.filters):
        grpc_log.addFilter(_CancelledStreamFilter())


class ModelThread(concurrent.futures.Executor):
    """A single daemon worker thread; remembers since when the job it runs has been running."""

    def __init__(self, name: str = "colibri-model"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._running_since: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            future.set_exception(RuntimeError("the model thread is shut down"))
            return future
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            self._running_since = time.monotonic()
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # handed to whoever waits for the job
                future.set_exception(e)
            else:
                future.set_result(result)
            finally:
                self._running_since = None

    def has_waiting(self) -> bool:
        """Whether jobs are queued behind the one running (a long job may step aside for them)."""
        return not self._jobs.empty()

    def progress(self) -> None:
        """The running job finished a unit of work (a step): busy_for counts from now."""
        if self._running_since is not None:
            self._running_since = time.monotonic()

    def busy_for(self) -> float:
        """Seconds the current job has been running (0 when idle)."""
        since = self._running_since
        return 0.0 if since is None else time.monotonic() - since

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def join(self, timeout: float) -> bool:
        """Waits up to `timeout` s for the thread to end (after shutdown); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class WorkerHealth:
    """The health statuses of one worker process, shared by its RPC server and its health-only server."""

    def __init__(self, watchdog_s: float):
        self.servicer = health.HealthServicer()
        self.watchdog_s = watchdog_s
        self.model_thread: ModelThread | None = None
        self.ready = False  # model verified and warmed up
        self.draining = False
        self.failed = False  # a worker fault: the process is exiting
        self._beat_sent: float | None = None
        self._published: dict[str, int] = {}
        self._publish()

    def is_live(self) -> bool:
        if self.failed:
            return False
        thread = self.model_thread
        if thread is None:
            return True  # still loading the model
        late_beat = self._beat_sent is not None and time.monotonic() - self._beat_sent > self.watchdog_s
        return thread.is_alive() and thread.busy_for() <= self.watchdog_s and not late_beat

    def is_ready(self) -> bool:
        return self.ready and not self.draining and self.is_live()

    def _publish(self) -> None:
        live, ready = self.is_live(), self.is_ready()
        for service, up in ((LIVENESS, live), ("", ready), (READINESS, ready), (WORKER_SERVICE, ready)):
            status = _SERVING if up else _NOT_SERVING
            if self._published.get(service) != status:
                self._published[service] = status
                self.servicer.set(service, status)

    def update(self, **state) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self._publish()

    def _beat_done(self, _future) -> None:
        self._beat_sent = None

    async def watch(self, on_tick=None) -> None:
        """Every second: re-publish the statuses; every HEARTBEAT_S a no-op job goes through the model
        thread (a stuck thread then shows even when nothing else is queued). `on_tick()` runs each time."""
        last_beat = 0.0
        while True:
            now = time.monotonic()
            if self.model_thread is not None and self._beat_sent is None and now - last_beat >= HEARTBEAT_S:
                last_beat, self._beat_sent = now, now
                self.model_thread.submit(lambda: None).add_done_callback(self._beat_done)
            self._publish()
            if on_tick is not None:
                on_tick()
            await asyncio.sleep(1.0)


async def close_engine(engine: Engine | None, thread: ModelThread) -> None:
    """Gives back the engine's device memory, pinned ranges and copy threads once the model thread `thread` (the
    servicer's executor) has ended; a model thread still running (a step past the watchdog) keeps them until the
    process exits."""
    if engine is None:
        return
    if not await asyncio.get_running_loop().run_in_executor(None, thread.join, ENGINE_CLOSE_WAIT_S):
        log.warning("the model thread is still running; the engine is left to the process's exit")
        return
    try:
        engine.close()
    except Exception as e:  # stopping anyway: the process's exit releases what this could not
        log.warning("closing the engine failed: %s: %s", type(e).__name__, e)


async def watch_parent(pid: int, stop: asyncio.Event) -> None:
    """Exit with the process that started us (`colibri serve`), so no orphan keeps the GPU."""
    while not stop.is_set():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("parent process %d is gone; stopping", pid)
            stop.set()
            return
        await asyncio.sleep(1.0)
