"""The router against the real CPU worker on the tiny model: greedy output equals the offline engine."""

import asyncio

import pytest

from common.model_format import ModelDir
from common.pb import router_pb2 as rpb
from tests.helpers import running_router, worker_kv_blocks_used

pytestmark = pytest.mark.slow


def offline_greedy(tiny_model, prompt, n):
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    tokens, _, _ = build_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu")).generate(prompt, n)
    return tokens


async def with_router(worker, body, **overrides):
    async with running_router(worker.address, **overrides) as (router, stub):
        return await body(router, stub)


def request(ids, n, **kw):
    return rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=ids), parameters=rpb.SamplingParameters(max_new_tokens=n, ignore_eos=True, **kw)
    )


def test_greedy_and_concurrent_streams_equal_offline(worker, tiny_model):
    prompts = [[5, 17, 42, 99, 3, 250, 7], [1, 2], list(range(10, 40)), [200, 201, 202, 9]]
    lengths = [8, 5, 12, 3]
    expected = [offline_greedy(tiny_model, p, n) for p, n in zip(prompts, lengths)]

    async def body(router, stub):
        solo = await stub.Generate(request(prompts[0], lengths[0]))
        assert list(solo.token_ids) == expected[0]

        async def stream(p, n):
            return [t async for m in stub.GenerateStream(request(p, n)) for t in m.token_ids]

        together = await asyncio.gather(*(stream(p, n) for p, n in zip(prompts, lengths)))
        assert together == expected
        # Everything finished: the router holds no block at once; the worker frees the last sequences when the
        # next step (frees only, sent right after) reaches it.
        for _ in range(100):
            if router.batching_loop.num_active == 0:
                break
            await asyncio.sleep(0.01)
        assert router.batching_loop.scheduler.num_used_blocks == 0
        for _ in range(200):
            if (await worker_kv_blocks_used(router.worker)) == 0:
                break
            await asyncio.sleep(0.01)
        assert (await worker_kv_blocks_used(router.worker)) == 0

    # A small token budget forces chunked prefill and decodes riding along with prefill chunks.
    asyncio.run(with_router(worker, body, max_batch_tokens=8))


def test_cancel_mid_stream_returns_worker_kv(worker):
    async def body(router, stub):
        call = stub.GenerateStream(request([1, 2, 3], 200))
        await call.read()
        call.cancel()
        for _ in range(200):
            if router.batching_loop.num_active == 0:
                break
            await asyncio.sleep(0.01)
        for _ in range(200):  # freed by the step that carries the cancel
            if (used := await worker_kv_blocks_used(router.worker)) == 0:
                break
            await asyncio.sleep(0.01)
        assert used == 0

    asyncio.run(with_router(worker, body))


def test_every_request_is_logged_with_its_id_and_never_its_prompt(worker, caplog):
    import logging

    async def body(router, stub):
        await stub.Generate(request([77, 78, 79], 3), metadata=())
        return await stub.Generate(
            rpb.GenerateRequest(
                token_ids=rpb.TokenIds(ids=[5, 6]),
                request_id="req-42",
                parameters=rpb.SamplingParameters(max_new_tokens=2),
            )
        )

    with caplog.at_level(logging.INFO, logger="colibri.router.batching_loop"):
        reply = asyncio.run(with_router(worker, body))
    assert reply.request_id == "req-42"
    records = [r for r in caplog.records if getattr(r, "request_id", None) == "req-42"]
    assert len(records) == 1 and records[0].outcome == "ok" and records[0].generated_tokens == 2
    assert all("77" not in r.getMessage() and "[5, 6]" not in str(r.__dict__) for r in caplog.records)
