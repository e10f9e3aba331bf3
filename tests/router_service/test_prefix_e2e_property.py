"""Prefix caching through the real services, attacked with fresh random traffic: prompts at and around block
boundaries, one-token prompts, repeated prompts and their extensions, penalties of every kind, stops, min_tokens,
seeded sampling, top and prompt logprobs, racing waves under eviction pressure, and cancels mid-prefill. Every
completed answer is the same with the cache on as with it off, and nothing is left held afterwards."""

import asyncio
import random

import grpc
import numpy as np
import pytest

from common.pb import router_pb2 as rpb
from tests.helpers import BackgroundWorker, drained, running_router

pytestmark = pytest.mark.slow

BLOCK = 4
NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def pressed_worker(tiny_model):
    w = BackgroundWorker(tiny_model, kv_block_size=BLOCK, kv_cache_tokens=BLOCK * NUM_BLOCKS, max_batch_size=8).start()
    yield w
    w.stop()


def _sampling(rng: random.Random) -> dict:
    roll = rng.random()
    extra: dict = {"logprobs": True, "ignore_eos": True}
    if roll < 0.15:
        extra["repetition_penalty"] = rng.choice([1.2, 1.6])
    elif roll < 0.25:
        extra.update(presence_penalty=0.7, frequency_penalty=0.4)
    elif roll < 0.35:
        extra.update(temperature=0.9, seed=rng.randrange(1 << 30), top_k=20)
    elif roll < 0.45:
        extra["prompt_logprobs"] = rng.choice([0, 2])
    elif roll < 0.55:
        extra["top_logprobs"] = 3
    elif roll < 0.6:
        extra.update(stop_token_ids=[rng.randrange(3, 250) for _ in range(20)], min_new_tokens=1)
    return extra


def _traffic(seed: int, count: int) -> list[tuple[list[int], int, dict]]:
    """Prompts built from a few shared bases cut at k * BLOCK - 1, k * BLOCK and k * BLOCK + 1, extended,
    repeated whole, or a single token."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 250) for _ in range(n)] for n in (13, 24, 33)]
    out = []
    for _ in range(count):
        base = rng.choice(bases)
        if rng.random() < 0.08:
            prompt = [rng.randrange(3, 250)]
        else:
            k = rng.randrange(1, len(base) // BLOCK + 1)
            cut = max(1, min(len(base), k * BLOCK + rng.choice([-1, 0, 1])))
            prompt = base[:cut] + [rng.randrange(3, 250) for _ in range(rng.choice([0, 0, 1, 5]))]
        out.append((prompt, rng.randrange(1, 7), _sampling(rng)))
    return out


def _request(prompt, n, salt="", **extra):
    return rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=prompt),
        parameters=rpb.SamplingParameters(max_new_tokens=n, **extra),
        cache_salt=salt,
    )


def _summary(answer) -> tuple:
    top = [(list(t.token_ids), list(t.logprobs)) for t in answer.top_logprobs]
    prompt = [(p.token_id, p.logprob if p.HasField("logprob") else None) for p in answer.prompt_logprobs]
    return list(answer.token_ids), answer.stop_reason, list(answer.logprobs), top, prompt


async def _waves(stub, traffic, rng: random.Random, cancel_rate: float):
    """Runs the traffic in racing waves; a few requests get a deadline so short they end mid-prefill."""
    results: list = []
    start = 0
    while start < len(traffic):
        wave = traffic[start : start + rng.randrange(1, 9)]
        start += len(wave)
        calls = []
        for prompt, n, extra in wave:
            timeout = 0.002 if rng.random() < cancel_rate else None
            calls.append(stub.Generate(_request(prompt, n, **extra), timeout=timeout))
        for answer in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(answer, grpc.aio.AioRpcError):
                assert answer.code() == grpc.StatusCode.DEADLINE_EXCEEDED, answer.details()
                results.append(None)
            else:
                assert not isinstance(answer, BaseException), answer
                results.append(answer)
    return results


def _compare(traffic, cached, plain) -> int:
    compared = 0
    for (prompt, _, extra), with_cache, without in zip(traffic, cached, plain):
        if with_cache is None or without is None:
            continue
        compared += 1
        a, b = _summary(with_cache), _summary(without)
        assert a[0] == b[0] and a[1] == b[1], (prompt, extra, a[:2], b[:2])
        np.testing.assert_allclose(a[2], b[2], rtol=1e-4, atol=1e-5)
        assert [ids for ids, _ in a[3]] == [ids for ids, _ in b[3]] and len(a[4]) == len(b[4])
        for (_, la), (_, lb) in zip(a[3], b[3]):
            np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-5)
        for (ta, la), (tb, lb) in zip(a[4], b[4]):
            assert ta == tb and (la is None) == (lb is None)
            if la is not None:
                np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-5)
        hits = with_cache.cached_prompt_tokens
        assert hits % BLOCK == 0 and hits < len(prompt) and without.cached_prompt_tokens == 0
        if "prompt_logprobs" in extra:
            assert hits == 0 and len(with_cache.prompt_logprobs) == len(prompt)
    return compared


@pytest.mark.parametrize("seed", [5, 29])
def test_random_traffic_with_every_feature_equals_uncached(pressed_worker, seed):
    traffic = _traffic(seed, 48)

    async def run(prefix_caching: bool, cancel_rate: float):
        async with running_router(pressed_worker.address, prefix_caching=prefix_caching, max_batch_tokens=8) as (
            router,
            stub,
        ):
            results = await _waves(stub, traffic, random.Random(seed + 1), cancel_rate)
            await drained(router, polls=400)
            # the pool is usable whole afterwards: a request needing every block still runs
            last = await stub.Generate(_request([7] * (BLOCK * NUM_BLOCKS - 8), 8))
            assert len(last.token_ids) == 8
            await drained(router, polls=400)
            return results, router.batching_loop.scheduler.prefix_cache

    cached, cache = asyncio.run(run(True, 0.1))
    plain, _ = asyncio.run(run(False, 0.0))
    assert _compare(traffic, cached, plain) >= 30
    assert cache.num_hit_tokens > 0 and cache.num_evicted > 0
