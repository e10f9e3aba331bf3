"""The router's reflection lists and describes exactly what its public port serves: GenerationService, health and
reflection; not the worker's service, whose stubs the router imports to call the worker."""

from __future__ import annotations

import asyncio

from tests.helpers import running_router
from tests.reflection_client import reflected

OWN = {"colibri.router.v1.GenerationService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


def test_reflection_lists_and_describes_only_the_router_services():
    async def body():
        # No worker behind it: reflection answers before one connects.
        async with running_router("127.0.0.1:1", wait_ready=False) as (router, _):
            symbols = ("colibri.router.v1.GenerationService", "colibri.worker.v1.WorkerService")
            return await asyncio.to_thread(reflected, f"127.0.0.1:{router.port}", symbols)

    listed, described = asyncio.run(body())
    assert listed == OWN
    assert described == {"colibri.router.v1.GenerationService": True, "colibri.worker.v1.WorkerService": False}
