"""Async client of colibri.worker.v1.WorkerService: the control calls and the step stream (`router_service.wire`
builds its messages).

No automatic retries: steps are stateful and not idempotent (a retried Prefill would run a chunk twice), so
a failed call fails the batch and the batching loop decides what to do. Every call has a deadline, and the
W3C trace context of the current span travels in the metadata (no-op unless an OpenTelemetry SDK is set up),
with `authorization: Bearer TOKEN` when the worker requires a token (router_service/security.py reads it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from common.pb import worker_pb2, worker_pb2_grpc
from common.tracing import inject_metadata

# gRPC's own status for a call that broke under a write or a read (the worker ended the stream while the router was
# sending a step): no answer of the worker's, so not the failed step its INTERNAL means.
BROKEN_CALL = "Internal error from Core"


class WorkerClient:
    """One channel to the worker; every method takes an optional timeout (seconds)."""

    def __init__(
        self,
        address: str,
        *,
        max_message_bytes: int = 256 << 20,
        step_timeout_s: float = 330.0,
        control_timeout_s: float = 10.0,
        token: Callable[[], str] | str = "",
    ):
        self.address = address
        self._token = token if callable(token) else (lambda: token)
        self.step_timeout_s = step_timeout_s
        self.control_timeout_s = control_timeout_s
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Notice a dead worker on an idle channel within seconds, not minutes.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # grpc.http2.max_pings_without_data stays at its default (2): an idle router still sends the worker a
            # health RPC every second (batching_loop.IDLE_POLL_S), which re-arms the pings and tells a vanished
            # worker within seconds. At 0, pings between those RPCs would count as abuse against the worker's
            # policy (no keepalive_permit_without_calls) and bring GOAWAY too_many_pings and a reconnect.
            ("grpc.enable_retries", 0),
        ]
        self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    def _metadata(self) -> list[tuple[str, str]]:
        token = self._token()
        return inject_metadata() + ([("authorization", f"Bearer {token}")] if token else [])

    async def _call(self, method, request, timeout: float | None):
        return await method(request, timeout=timeout, metadata=self._metadata())

    async def info(self, timeout: float | None = None) -> worker_pb2.InfoResponse:
        return await self._call(self._stub.Info, worker_pb2.InfoRequest(), timeout or self.control_timeout_s)

    async def health(self, timeout: float | None = None) -> bool:
        response = await self._call(self._stub.Health, worker_pb2.HealthRequest(), timeout or self.control_timeout_s)
        return response.ready

    async def warmup(self, max_batch_tokens: int, timeout: float | None = None) -> float:
        response = await self._call(
            self._stub.Warmup,
            worker_pb2.WarmupRequest(max_batch_tokens=max_batch_tokens),
            timeout or self.step_timeout_s * 5,
        )
        return response.warmup_ms

    async def clear_cache(self, timeout: float | None = None) -> int:
        response = await self._call(
            self._stub.ClearCache, worker_pb2.ClearCacheRequest(), timeout or self.control_timeout_s
        )
        return response.freed_sequences

    def open_step_stream(self) -> StepStream:
        """A new step stream (the serving path); the worker frees its sequences when it ends."""
        return StepStream(self._stub.StepStream(metadata=self._metadata()), self.step_timeout_s)


class StepStream:
    """The router's end of one step stream: `send` steps ahead, `receive` results in order."""

    def __init__(self, call, step_timeout_s: float):
        self._call, self.step_timeout_s = call, step_timeout_s

    def on_end(self, callback: Callable[[], None]) -> None:
        """Calls `callback()` once the stream has ended, whoever ended it: with no step in flight, nothing else
        would tell the router that its worker died."""
        self._call.add_done_callback(lambda _: callback())

    async def end_error(self) -> grpc.aio.AioRpcError | None:
        """None while the stream is open; once it has ended, the lost worker."""
        return await self._lost_worker() if self._call.done() else None

    async def send(self, request: worker_pb2.StepStreamRequest) -> None:
        """Sends a step; a stream the worker has already ended is a lost worker, with the call's status."""
        try:
            await self._call.write(request)
        except asyncio.InvalidStateError:  # grpc's answer to a write after the call finished, whatever its status
            raise await self._lost_worker() from None
        except grpc.aio.AioRpcError as e:
            raise _lost(e.code(), e.details()) from None

    async def _lost_worker(self) -> grpc.aio.AioRpcError:
        """The ended call's status as the error of a lost worker (an OK end too: steps were still to come)."""
        code, details = await self._call.code(), await self._call.details()
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the step stream"
        return _lost(code, details)

    async def receive(self) -> worker_pb2.StepStreamResponse:
        """The next result; a worker that ends the stream or misses the step deadline is a lost worker."""
        try:
            response = await asyncio.wait_for(self._call.read(), self.step_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _lost(e.code(), e.details()) from None
        except TimeoutError:
            self.close()
            raise _rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no step result within worker_step_timeout_s={self.step_timeout_s:g}",
            ) from None
        if response is grpc.aio.EOF:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker ended the step stream")
        return response

    def close(self) -> None:
        self._call.cancel()


def _lost(code: grpc.StatusCode, details: str | None) -> grpc.aio.AioRpcError:
    """The stream's error as the router acts on it: gRPC's broken call is a lost worker (UNAVAILABLE)."""
    if code == grpc.StatusCode.INTERNAL and details == BROKEN_CALL:
        code, details = grpc.StatusCode.UNAVAILABLE, "the step stream broke (the worker ended it during a write)"
    return _rpc_error(code, details or "")


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
