"""A router whose routing table has NO_EXPERT entries (`router-gen --min-share`) sends plans in which some tokens
list fewer than k experts; a worker that predates InfoResponse.plans_with_gaps refuses every such step. The router
does not use that worker (one WARNING naming the worker, the table and the fix, then retries) and uses one that
reports the field; with a table without NO_EXPERT entries an older worker is used as before."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from common.pb import worker_pb2 as wpb
from common.routing_plan import NO_EXPERT
from common.routing_table import RoutingTable
from router_service import worker_connection
from router_service.config import RouterConfig
from router_service.routing import RoutingPlanner
from router_service.worker_client import WorkerClient
from router_service.worker_connection import WorkerConnector
from router_service.worker_info import plan_gaps_problem
from tests.grpc_teardown import stopped
from tests.helpers import grpc_poller_of_a_closed_loop
from tests.router_service.fake_worker import FakeWorker, start_fake_worker

L, V, E, K = 2, 1000, 8, 2  # FakeWorker's vocabulary; its config's 8 experts, 2 a token
TABLE = "/models/m/gated.bin"


def planner(gated: bool) -> RoutingPlanner:
    table = np.tile(np.arange(K, dtype=np.uint16), (L, V, 1))
    if gated:
        table[1, 7, 1:] = NO_EXPERT  # one token predicts one expert at one layer: the plan has a gap
    return RoutingPlanner(RoutingTable(table, E, [0, 1]), model_top_k=K)


def test_a_gated_table_needs_a_worker_that_takes_plans_with_gaps():
    config = RouterConfig(routing_table=TABLE)
    problem = plan_gaps_problem(config, wpb.InfoResponse(), planner(gated=True))
    assert problem is not None and "\n" not in problem
    assert f"routing_table {TABLE} has NO_EXPERT entries" in problem and "plans_with_gaps" in problem
    assert "upgrade the worker" in problem and "without --min-share" in problem
    assert plan_gaps_problem(config, wpb.InfoResponse(plans_with_gaps=True), planner(gated=True)) is None


def test_an_ungated_table_or_none_takes_any_worker():
    config = RouterConfig(routing_table=TABLE)
    for worker in (wpb.InfoResponse(), wpb.InfoResponse(plans_with_gaps=True)):
        assert plan_gaps_problem(config, worker, planner(gated=False)) is None
        assert plan_gaps_problem(RouterConfig(), worker, None) is None


class GapsWorker(FakeWorker):
    """A fake worker that reports InfoResponse.plans_with_gaps as `plans_with_gaps` (False: an older worker)."""

    def __init__(self, plans_with_gaps: bool, **kw):
        super().__init__(**kw)
        self.plans_with_gaps = plans_with_gaps

    async def Info(self, request, context):
        answer = await super().Info(request, context)
        answer.plans_with_gaps = self.plans_with_gaps
        return answer


def attempts(fake: GapsWorker, gated: bool, upgrade_after: int | None = None) -> list:
    """What WorkerConnector.attempt returns, attempt after attempt, until it accepts the worker or gives up after
    5; the worker reports plans_with_gaps from attempt `upgrade_after` on (an upgraded worker at the address)."""

    async def main():
        server, address = await start_fake_worker(fake)
        client = WorkerClient(address, control_timeout_s=2.0)
        config = RouterConfig(worker=address, worker_retry_s=0.01, routing_table=TABLE)
        connector = WorkerConnector(config, client, planner(gated))
        got: list = []
        try:
            while len(got) < 5 and (not got or got[-1] is None):
                fake.plans_with_gaps = fake.plans_with_gaps or len(got) == upgrade_after
                got.append(await asyncio.wait_for(connector.attempt(), 10))
        finally:
            await client.close()
            await stopped(server)
        return got

    return asyncio.run(main())


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == worker_connection.log.name and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("upgrade_after", [None, 3])
def test_an_older_worker_is_refused_with_a_gated_table_until_it_reports_the_field(caplog, upgrade_after):
    with caplog.at_level(logging.INFO, logger=worker_connection.log.name):
        got = attempts(GapsWorker(plans_with_gaps=False), gated=True, upgrade_after=upgrade_after)
    if upgrade_after is None:
        assert got == [None] * 5
    else:
        assert got[:upgrade_after] == [None] * upgrade_after and got[-1].plans_with_gaps
    (line,) = _warnings(caplog)  # once, while it retries
    assert line.startswith("the router cannot use the worker at 127.0.0.1:") and f"routing_table {TABLE}" in line
    assert "upgrade the worker" in line and "\n" not in line
    assert not any(r.exc_info and not grpc_poller_of_a_closed_loop(r) for r in caplog.records)


@pytest.mark.parametrize("gated, reports", [(True, True), (False, False), (False, True)])
def test_a_worker_that_can_take_the_tables_plans_is_used_at_once(caplog, gated, reports):
    with caplog.at_level(logging.INFO, logger=worker_connection.log.name):
        got = attempts(GapsWorker(plans_with_gaps=reports), gated=gated)
    assert len(got) == 1 and got[0] is not None
    assert _warnings(caplog) == []
