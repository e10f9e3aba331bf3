"""A router whose table predicts more experts a token than a worker's prefetch reads from a plan (the cuda backend
stages the model's top-k a token: InfoResponse.plan_width) sends each token's first plan_width predictions, its
table's best ranks; before, the worker cut the flattened plan and dropped the last tokens' predictions unseen."""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
import pytest

from common.pb import router_pb2 as rpb
from common.pb import worker_pb2 as wpb
from common.pb import worker_pb2_grpc
from common.routing_plan import NO_EXPERT
from common.routing_table import RoutingTable
from router_service.routing import RoutingPlanner
from router_service.worker_info import planner_for
from tests.grpc_teardown import served
from tests.helpers import running_router
from tests.router_service.fake_worker import FakeWorker

L, V, E, K = 2, 1000, 8, 2  # FakeWorker's vocabulary; its config's 8 experts, 2 a token


def wide_planner(k: int = 4) -> RoutingPlanner:
    """Every token predicts k distinct experts a layer, best rank first (ranks differ from expert order)."""
    rng = np.random.default_rng(3)
    table = np.argsort(rng.random((L, V, E)), axis=2)[:, :, :k].astype(np.uint16)
    return RoutingPlanner(RoutingTable(table, E, [0, 1]), model_top_k=K)


def test_a_narrowed_planner_keeps_each_tokens_best_ranks():
    planner = wide_planner()
    narrow = planner.narrowed(2)
    assert narrow.table.top_k == 2 and narrow.model_top_k == K
    assert np.array_equal(narrow.table.table, planner.table.table[:, :, :2])
    tokens = np.array([5, 17, 999, 5])
    got = narrow.table.lookup(tokens)
    assert np.array_equal(got, planner.table.lookup(tokens)[:, :, :2])  # every token keeps two, none dropped
    for width in (0, 4, 5):
        assert planner.narrowed(width) is planner


def test_planner_for_follows_the_workers_plan_width():
    planner = wide_planner()
    assert planner_for(planner, wpb.InfoResponse()) is planner  # 0: reads every prediction (or predates the field)
    assert planner_for(planner, wpb.InfoResponse(plan_width=4)) is planner
    assert planner_for(planner, wpb.InfoResponse(plan_width=8)) is planner
    assert planner_for(planner, wpb.InfoResponse(plan_width=2)).table.top_k == 2
    assert planner_for(None, wpb.InfoResponse(plan_width=2)) is None


def test_a_gated_table_keeps_its_gaps_when_narrowed():
    planner = wide_planner()
    planner.table.table[1, 7, 1:] = NO_EXPERT
    narrow = planner.narrowed(2)
    assert list(narrow.table.lookup(np.array([7]))[1, 0]) == [planner.table.table[1, 7, 0], NO_EXPERT]
    assert not narrow.table.complete


class PlanWidthWorker(FakeWorker):
    """Reports plan_width and keeps every step's routing plan (per layer: the experts each token is listed under)."""

    def __init__(self, plan_width: int, **kw):
        super().__init__(**kw)
        self.plan_width = plan_width
        self.plans: list[tuple[int, list[int]]] = []  # (the step's tokens, its token_indices shape)

    async def Info(self, request, context):
        answer = await super().Info(request, context)
        answer.plan_width = self.plan_width
        return answer

    def answer(self, request):
        if request.HasField("routing_plan"):
            tokens = sum(len(c.token_ids) for c in request.chunks) + len(request.decode_request_ids) // 8
            self.plans.append((tokens, list(request.routing_plan.token_indices.shape)))
        return super().answer(request)


@pytest.fixture(scope="module")
def tiny_wide_table(tmp_path_factory):
    """A tiny mixtral (4 experts, top-2) and a table of 3 predictions a token for it."""
    from common.model_format import ModelDir
    from common.routing_table import model_digest, write_routing_table
    from expert_service.tools.tiny_model import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("plan_width") / "m", family="mixtral", seed=0)
    cfg = ModelDir.open(model).config
    ranks = np.argsort(np.random.default_rng(0).random((len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts)), axis=2)
    table = write_routing_table(
        model / "wide.bin", ranks[:, :, :3].astype(np.uint16), cfg.num_experts, model_digest(model)
    )
    return model, table, len(cfg.moe_layers)


@pytest.mark.parametrize("plan_width, sent", [(2, 2), (0, 3)])
def test_the_router_sends_as_many_predictions_a_token_as_the_worker_reads(tiny_wide_table, caplog, plan_width, sent):
    model, path, layers = tiny_wide_table
    worker = PlanWidthWorker(plan_width)

    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
        async with served(server) as port:
            async with running_router(f"127.0.0.1:{port}", model=str(model), routing_table=str(path)) as (_, stub):
                params = rpb.SamplingParameters(max_new_tokens=3, ignore_eos=True)
                await stub.Generate(rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=[5, 17, 42]), parameters=params))

    with caplog.at_level(logging.INFO, logger="colibri.router"):
        asyncio.run(main())
    assert worker.plans  # the prompt's step and the decodes: each token listed `sent` times a layer
    assert all(shape == [layers, tokens * sent] for tokens, shape in worker.plans), worker.plans
    narrowed = [r.getMessage() for r in caplog.records if "predictions a token" in r.getMessage()]
    assert len(narrowed) == (1 if plan_width else 0), narrowed
