"""A router and a worker started apart: a worker whose step watchdog is not shorter than the router's step deadline
is refused with one WARNING naming both settings while the router retries, and used once it is; a worker that does
not report its watchdog is used as before."""

import asyncio
import logging
import random

import grpc
import pytest

from tests.router_service.fake_worker import FakeWorker, harness, ids_request, wait_for


class WatchdogWorker(FakeWorker):
    """A fake worker reporting a step watchdog of `step_timeout_s` seconds (0: not reported, an older worker)."""

    def __init__(self, step_timeout_s: float, **kw):
        super().__init__(**kw)
        self.step_timeout_s = step_timeout_s

    async def Info(self, request, context):
        info = await super().Info(request, context)
        info.step_timeout_s = self.step_timeout_s
        return info


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("colibri")]


@pytest.mark.parametrize("seed", range(3))
def test_a_worker_whose_watchdog_outlasts_the_routers_deadline_is_refused_until_it_does_not(caplog, seed):
    rng = random.Random(seed)
    deadline = rng.uniform(30, 600)
    watchdog = deadline + rng.choice([0.0, rng.uniform(1, 100)])

    async def main():
        fake = WatchdogWorker(watchdog)
        async with harness(fake, wait_ready=False, worker_step_timeout_s=deadline) as (router, _, stub, _):
            await wait_for(lambda: fake.calls.count("Info") >= 3)  # refused, and retried
            assert not router.batching_loop.is_worker_ready
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(ids_request([5], max_new_tokens=2))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            fake.step_timeout_s = deadline * 0.9  # the worker restarted with a shorter watchdog
            await wait_for(lambda: router.batching_loop.is_worker_ready)
            assert (await stub.Generate(ids_request([5], max_new_tokens=2))).generated_tokens == 2

    with caplog.at_level(logging.INFO, logger="colibri.router"):
        asyncio.run(main())
    (line,) = _warnings(caplog)
    assert "cannot use the worker at 127.0.0.1:" in line, line
    assert f"step_timeout_s={watchdog:g} s" in line and f"worker_step_timeout_s={deadline:g} s" in line, line
    assert "\n" not in line and "Traceback" not in line


def test_a_worker_that_does_not_report_its_watchdog_is_used():
    async def main():
        async with harness(WatchdogWorker(0.0), worker_step_timeout_s=1.0) as (router, _, stub, _):
            return (await stub.Generate(ids_request([5], max_new_tokens=2))).generated_tokens

    assert asyncio.run(main()) == 2
