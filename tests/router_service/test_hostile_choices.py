"""Hostile use of several choices on the OpenAI front, against a CPU worker with a small KV pool (256 tokens): n
and best_of whose outputs could never be resident together are refused up front (they would hold the queue's head
for as long as their samples take one by one), and a streaming client that leaves mid-way through n choices gets
every sample cancelled and every KV block back."""

import asyncio
import time

import aiohttp
import pytest

from tests.helpers import BackgroundWorker, drained, free_port, running_router

pytestmark = pytest.mark.slow

BLOCK, NUM_BLOCKS = 4, 64


@pytest.fixture(scope="module")
def small_worker(tiny_model):
    w = BackgroundWorker(tiny_model, kv_block_size=BLOCK, kv_cache_tokens=BLOCK * NUM_BLOCKS).start()
    yield w
    w.stop()


async def _post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hello", "n": 128, "max_tokens": 200}, "n"),
        ({"prompt": "hello", "n": 1, "best_of": 4, "max_tokens": 100}, "best_of"),
        ({"prompt": ["a", [5, 6], "b"], "max_tokens": 100}, "prompt"),  # one sample each: the list is the cause
    ],
    ids=["n", "best_of", "prompt-list"],
)
def test_choices_that_could_never_run_together_are_refused_up_front(small_worker, tiny_model, body, param):
    async def run():
        async with running_router(small_worker.address, model=str(tiny_model), http_port=free_port()) as (router, _):
            url = f"http://127.0.0.1:{router.http_port}/v1/completions"
            async with aiohttp.ClientSession() as s:
                t0 = time.perf_counter()
                status, answer = await _post(s, url, {**body, "ignore_eos": True})
                assert status == 400 and answer["error"]["param"] == param, answer
                assert "KV capacity (256 tokens)" in answer["error"]["message"]
                assert time.perf_counter() - t0 < 5
                # what fits still runs: 4 x 50 + 1 prompt token
                status, answer = await _post(s, url, {**body, "n": 4, "best_of": 4, "max_tokens": 50, "prompt": "h"})
                assert status == 200 and len(answer["choices"]) == 4, answer
            await drained(router, polls=600)

    asyncio.run(run())


def test_a_client_leaving_mid_stream_frees_every_choice(small_worker, tiny_model):
    async def run():
        async with running_router(small_worker.address, model=str(tiny_model), http_port=free_port()) as (router, _):
            url = f"http://127.0.0.1:{router.http_port}/v1/completions"
            bodies = [
                {"prompt": "hello", "n": 8, "max_tokens": 30, "ignore_eos": True},
                {"prompt": ["a", [7, 8, 9]], "n": 4, "max_tokens": 30, "guided_regex": "[a-z]{30}"},
            ]
            async with aiohttp.ClientSession() as s:
                for body in bodies:
                    async with s.post(url, json={**body, "stream": True}) as r:
                        assert r.status == 200
                        lines = 0
                        async for _ in r.content:
                            lines += 1
                            if lines > 6:
                                break
                    # leaving the block drops the connection with choices still generating
                    await drained(router, polls=600)

    asyncio.run(run())


def test_best_of_with_n_1_samples_best_of_times(small_worker, tiny_model):
    """n = 1 with best_of > 1 is still best_of: every sample counts, and the one returned scores highest."""

    async def run():
        async with running_router(small_worker.address, model=str(tiny_model), http_port=free_port()) as (router, _):
            url = f"http://127.0.0.1:{router.http_port}/v1/completions"
            request = {"prompt": "hi", "max_tokens": 5, "temperature": 1.0, "seed": 5, "ignore_eos": True}
            async with aiohttp.ClientSession() as s:
                status, pool = await _post(s, url, {**request, "n": 3, "logprobs": 0})
                assert status == 200
                best = max(pool["choices"], key=lambda c: sum(c["logprobs"]["token_logprobs"]))
                status, answer = await _post(s, url, {**request, "n": 1, "best_of": 3})
                assert status == 200, answer
                assert [c["text"] for c in answer["choices"]] == [best["text"]]
                assert answer["usage"]["completion_tokens"] == 15
            await drained(router, polls=600)

    asyncio.run(run())
