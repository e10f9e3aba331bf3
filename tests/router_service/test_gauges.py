"""The router's gauges tell the truth at every scrape: idle is 0, a lost worker empties the batch (the HPA
scales on colibri_queue_size)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.metrics import new_registry
from router_service.observability import router_metrics
from tests.router_service.fake_worker import FakeWorker, harness, ids_request, wait_for

GAUGES = ("colibri_queue_size", "colibri_num_requests_running", "colibri_num_requests_waiting")


def gauges(registry) -> tuple[float, ...]:
    return tuple(registry.get_sample_value(name, {"model_name": "m"}) for name in GAUGES)


def test_gauges_drop_to_zero_once_idle():
    async def main():
        registry = new_registry(process_metrics=False)
        hooks, _ = router_metrics("m", port=-1, registry=registry)
        async with harness(hooks=hooks) as (router, _, stub, _):
            assert gauges(registry) == (0, 0, 0)
            call = stub.GenerateStream(ids_request([1], max_new_tokens=50))
            await call.read()  # in flight: admitted and running
            assert gauges(registry) == (1, 1, 0)
            while await call.read() != grpc.aio.EOF:
                pass
            await wait_for(lambda: router.batching_loop.num_active == 0)
            assert gauges(registry) == (0, 0, 0)
            await stub.Generate(ids_request([1], max_new_tokens=3))
            assert gauges(registry) == (0, 0, 0)

    asyncio.run(main())


def test_gauges_drop_to_zero_while_the_worker_is_down():
    async def main():
        registry = new_registry(process_metrics=False)
        hooks, _ = router_metrics("m", port=-1, registry=registry)
        async with harness(FakeWorker(step_delay=0.01), hooks=hooks) as (router, fake, stub, _):
            calls = [stub.GenerateStream(ids_request([1], max_new_tokens=200)) for _ in range(3)]
            for call in calls:
                await call.read()
            assert gauges(registry)[:2] == (3, 3)
            fake.ready = False
            fake.fail_next = grpc.StatusCode.UNAVAILABLE  # the worker goes away mid-generation
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while await call.read() != grpc.aio.EOF:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not router.batching_loop.is_worker_ready
            assert gauges(registry) == (0, 0, 0)

    asyncio.run(main())
