"""A request span's status (docs/observability.md): ERROR only for a server-side fault (the RPC semconv's codes:
INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED, ...; HTTP 5xx), never for the client's mistake (INVALID_ARGUMENT, HTTP
400), a full router (RESOURCE_EXHAUSTED, 429) or a client that went away, on either front."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
from opentelemetry.trace import StatusCode

from tests.helpers import free_port
from tests.router_service.fake_worker import FakeWorker, harness, ids_request
from tests.router_service.test_queue_span import exporter  # noqa: F401 (the fixture)


def request_spans(exporter) -> list:  # noqa: F811
    return [s for s in exporter.get_finished_spans() if s.name.startswith("text_completion")]


def test_grpc_request_span_is_an_error_only_for_server_faults(exporter):  # noqa: F811
    async def main():
        async with harness(FakeWorker(step_delay=0.3), request_timeout_s=0.1) as (_, _, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([1], max_new_tokens=2, temperature=-1))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([1], max_new_tokens=50))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(main())
    invalid, deadline = request_spans(exporter)
    assert invalid.attributes["error.type"] == "VALIDATION"
    assert invalid.status.status_code == StatusCode.UNSET
    assert deadline.status.status_code == StatusCode.ERROR
    assert deadline.status.description == "DEADLINE_EXCEEDED"


def test_http_request_span_is_an_error_only_for_server_faults(exporter):  # noqa: F811
    async def main():
        port = free_port()
        overrides = dict(http_port=port, request_timeout_s=0.1)
        async with harness(FakeWorker(step_delay=0.3), **overrides) as _, aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with session.post(url, json={"prompt": [1], "max_tokens": 2, "temperature": -1}) as response:
                assert response.status == 400
            async with session.post(url, json={"prompt": [1], "max_tokens": 50}) as response:
                assert response.status == 504

    asyncio.run(main())
    invalid, deadline = request_spans(exporter)
    assert invalid.status.status_code == StatusCode.UNSET
    assert deadline.status.status_code == StatusCode.ERROR
