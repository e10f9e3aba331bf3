"""An in-process router against a given worker, for end-to-end tests: started, ready, with a channel."""
from __future__ import annotations

import asyncio
import contextlib

import grpc

from common.pb import router_pb2_grpc
from router_service.config import RouterConfig
from router_service.main import start_router


@contextlib.asynccontextmanager
async def running_router(worker_address: str, wait_ready: bool = True, **overrides):
    """Yields (router, GenerationService stub); the router binds a free loopback port and is stopped after."""
    config = RouterConfig(**{"host": "127.0.0.1", "port": 0, "metrics_port": 0, "worker_retry_s": 0.05, **overrides})
    router = await start_router(config, worker_address)
    try:
        for _ in range(500 if wait_ready else 0):
            if router.batching_loop.is_worker_ready:
                break
            await asyncio.sleep(0.02)
        assert router.batching_loop.is_worker_ready or not wait_ready, "the router never connected to the worker"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            yield router, router_pb2_grpc.GenerationServiceStub(channel)
    finally:
        await router.stop(grace=0.1)
