"""BatchingLoop pieces that need no worker: the prefix cache's counters as the metrics hooks receive them; and
its connection to a worker that answers but refuses it, which it names in the log."""

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.auth import TokenSet
from common.pb import worker_pb2_grpc
from expert_service.serving.main import worker_interceptors
from router_service.batching_loop import BatchingLoop
from router_service.config import RouterConfig
from router_service.main import start_router
from router_service.observability import BatchingLoopHooks
from router_service.prefix_cache import PrefixCache
from router_service.scheduler import Scheduler, SchedulerLimits
from tests.grpc_teardown import served
from tests.router_service.fake_worker import FakeWorker

LIMITS = SchedulerLimits(max_batch_size=4, max_batch_tokens=16, kv_block_size=4, num_kv_blocks=16)


class Reported(BatchingLoopHooks):
    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []

    def on_prefix_cache(self, query_tokens: int, hit_tokens: int, evicted_blocks: int) -> None:
        self.calls.append((query_tokens, hit_tokens, evicted_blocks))


def _counted(cache: PrefixCache, queries: int, hits: int, evictions: int) -> PrefixCache:
    cache.num_query_tokens, cache.num_hit_tokens, cache.num_evicted = queries, hits, evictions
    return cache


def test_a_new_index_reports_its_own_counts_even_at_a_freed_indexs_address():
    """A reconnect replaces the index; CPython hands a freed object's address to the next object of its size, so
    an index keyed by id() may meet the counts of the one it replaced and report negative increments (which a
    Prometheus counter refuses, raising in the step loop)."""
    hooks = Reported()
    loop = BatchingLoop(RouterConfig(), None, hooks=hooks)
    loop.scheduler = Scheduler(LIMITS, _counted(PrefixCache(4, b"m"), 40, 12, 3))
    loop._report_prefix_cache()
    assert hooks.calls == [(40, 12, 3)]
    loop.scheduler.clear()  # the worker was lost: a new index, the old one freed
    # the reconnect's index, made while the cleared scheduler still holds its own: CPython mostly gives it the freed
    # index's address (where an id()-keyed report went wrong), not always (another allocation may take it first);
    # the counts must be its own either way
    cache = PrefixCache(4, b"m")
    loop.scheduler = Scheduler(LIMITS, _counted(cache, 8, 4, 0))  # the reconnected worker's index
    loop._report_prefix_cache()
    assert hooks.calls == [(40, 12, 3), (8, 4, 0)]
    loop._report_prefix_cache()  # nothing new: nothing reported
    assert hooks.calls == [(40, 12, 3), (8, 4, 0)]


class WarmupFails(FakeWorker):
    async def Warmup(self, request, context):
        await context.abort(grpc.StatusCode.INTERNAL, "warm-up failed on purpose")


def _token_refused(server):
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(FakeWorker(), server)


def _not_a_worker(server):  # another gRPC server at the address (--worker pointing at the wrong port)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)


def _warmup_fails(server):
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WarmupFails(), server)


@pytest.mark.parametrize(
    "serve, reason",
    [
        (_token_refused, "UNAUTHENTICATED: missing or wrong worker token"),
        (_not_a_worker, "UNIMPLEMENTED"),
        (_warmup_fails, "INTERNAL: warm-up failed on purpose"),
    ],
)
def test_a_worker_that_refuses_the_router_is_named_once_in_the_log(tmp_path, caplog, serve, reason):
    """The router logged "waiting for the worker at ..." every retry, or nothing at all once Info had answered,
    never why: a wrong token looked like a worker still loading."""

    async def main():
        server = grpc.aio.server(interceptors=worker_interceptors(TokenSet(token="right")))
        serve(server)
        async with served(server) as port:
            (tmp_path / "token").write_text("wrong" if serve is _token_refused else "right")
            (tmp_path / "token").chmod(0o600)  # a secret's mode: only the refusal is warned of
            config = RouterConfig(
                host="127.0.0.1", port=0, metrics_port=0, worker_retry_s=0.05, worker_token_file=str(tmp_path / "token")
            )
            router = await start_router(config, f"127.0.0.1:{port}")
            try:
                await asyncio.sleep(1.0)  # many retries
                assert not router.batching_loop.is_worker_ready
            finally:
                await router.stop(0.1)

    with caplog.at_level(logging.INFO, logger="colibri.router"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "127.0.0.1:" in warnings[0] and reason in warnings[0], warnings[0]


class LutWorker(FakeWorker):
    async def Info(self, request, context):
        info = await super().Info(request, context)
        info.routing = "lut"
        return info


@pytest.fixture(scope="module")
def tiny_top2(tmp_path_factory):
    from expert_service.tools.tiny_model import make_tiny

    return make_tiny(tmp_path_factory.mktemp("lut_router") / "m", family="mixtral", seed=0)  # 4 experts, top-2


def _table(model_dir, top_k: int):
    import numpy as np

    from common.model_format import ModelDir
    from common.routing_table import model_digest, write_routing_table

    cfg = ModelDir.open(model_dir).config
    ids = np.argsort(np.random.default_rng(0).random((len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts)), axis=2)
    top = ids[:, :, :top_k].astype(np.uint16)
    return write_routing_table(model_dir / f"top{top_k}.bin", top, cfg.num_experts, model_digest(model_dir))


@pytest.mark.parametrize(
    "top_k, reason",
    [
        (None, "start the router with --routing-table"),  # no table: every step of a lut worker is refused
        (3, "routing_table: 3 experts a token"),  # a table wider than the model's top-2: refused the same way
        (2, None),
    ],
)
def test_a_lut_worker_is_not_served_without_a_table_that_routes_the_models_top_k(tiny_top2, caplog, top_k, reason):
    """A worker running --routing lut refuses every step without a plan of exactly the model's top-k experts a
    token; the router reported ready all the same and failed every request as an internal error."""

    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(LutWorker(), server)
        async with served(server) as port:
            table = {} if top_k is None else {"routing_table": str(_table(tiny_top2, top_k))}
            config = RouterConfig(
                host="127.0.0.1", port=0, metrics_port=0, worker_retry_s=0.05, model=str(tiny_top2), **table
            )
            router = await start_router(config, f"127.0.0.1:{port}")
            try:
                await asyncio.sleep(1.0)  # many retries
                return router.batching_loop.is_worker_ready
            finally:
                await router.stop(0.1)

    with caplog.at_level(logging.INFO, logger="colibri.router"):
        ready = asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if reason is None:
        assert ready and not warnings, warnings
        return
    assert not ready
    assert len(warnings) == 1, warnings
    assert "127.0.0.1:" in warnings[0] and reason in warnings[0] and "\n" not in warnings[0], warnings[0]
