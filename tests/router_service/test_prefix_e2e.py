"""Prefix caching through the real services on loopback (CPU worker, tiny model): random shared-prefix traffic
gives the same tokens with the cache on as with it off and as the offline engine, under eviction pressure (a
small KV pool), chunked prefill, pipelining, and concurrent requests racing for one prefix; with every expert
resident and with the expert cache running (2 slots per layer)."""

import asyncio
import random

import numpy as np
import pytest

from common.metrics import RouterMetrics, new_registry
from common.model_format import ModelDir
from common.pb import router_pb2 as rpb
from router_service.observability import ChainedHooks, MetricsHooks
from tests.helpers import BackgroundWorker, drained, running_router

pytestmark = pytest.mark.slow

BLOCK = 4
NUM_BLOCKS = 36  # 144 tokens: the traffic below needs evictions to keep going


@pytest.fixture(scope="module", params=[{}, {"expert_cache_slots": 2}], ids=["resident", "expert-cache"])
def small_pool_worker(request, tiny_model):
    w = BackgroundWorker(tiny_model, kv_block_size=BLOCK, kv_cache_tokens=BLOCK * NUM_BLOCKS, **request.param).start()
    yield w
    w.stop()


def _traffic(seed: int) -> list[tuple[list[int], int, dict]]:
    """Waves of requests: three system prompts of awkward lengths, random tails, some prompts repeated whole."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 250) for _ in range(n)] for n in (9, 16, 23)]
    out = []
    for _ in range(36):
        system = rng.choice(systems)
        tail = [rng.randrange(3, 250) for _ in range(rng.choice([0, 1, 3, 4, 6]))]
        extra: dict = {}
        roll = rng.random()
        if roll < 0.1:
            extra = {"repetition_penalty": 1.3}
        elif roll < 0.2:
            extra = {"temperature": 0.8, "seed": rng.randrange(1 << 30)}
        out.append((system + tail or [7], rng.randrange(2, 7), extra))
    return out


def _request(prompt, n, salt="", **extra):
    return rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=prompt),
        # logprobs: a tiny random model's greedy tokens hardly depend on context, its log-probabilities do
        parameters=rpb.SamplingParameters(max_new_tokens=n, ignore_eos=True, logprobs=True, **extra),
        cache_salt=salt,
    )


async def _run_traffic(stub, traffic, wave: int):
    results = []
    for start in range(0, len(traffic), wave):  # each wave at once: its requests race for the same prefixes
        batch = traffic[start : start + wave]
        answers = await asyncio.gather(*(stub.Generate(_request(p, n, **extra)) for p, n, extra in batch))
        results += [(list(a.token_ids), a.cached_prompt_tokens, list(a.logprobs)) for a in answers]
    return results


def test_shared_prefix_traffic_equals_uncached_and_offline(small_pool_worker, tiny_model):
    traffic = _traffic(seed=11)

    async def run(prefix_caching: bool):
        async with running_router(small_pool_worker.address, prefix_caching=prefix_caching, max_batch_tokens=8) as (
            router,
            stub,
        ):
            results = await _run_traffic(stub, traffic, wave=6)
            await drained(router, polls=300)
            assert router.batching_loop.scheduler.num_used_blocks == 0
            cache = router.batching_loop.scheduler.prefix_cache
            return results, cache

    cached, cache = asyncio.run(run(True))
    plain, no_cache = asyncio.run(run(False))
    assert no_cache is None
    assert [tokens for tokens, _, _ in cached] == [tokens for tokens, _, _ in plain]
    for (_, _, with_cache), (_, _, without) in zip(cached, plain):
        np.testing.assert_allclose(with_cache, without, rtol=1e-4, atol=1e-5)
    assert all(hits == 0 for _, hits, _ in plain)
    assert sum(hits for _, hits, _ in cached) > 0
    assert all(hits % BLOCK == 0 and hits < len(p) for (_, hits, _), (p, _, _) in zip(cached, traffic))
    assert cache.num_evicted > 0, "the pool was meant to be too small to keep every prefix"
    penalised = [hits for (_, hits, _), (_, _, extra) in zip(cached, traffic) if "repetition_penalty" in extra]
    assert any(penalised), "a penalised request started on cached blocks (the penalty counted their tokens)"
    assert cache.num_hit_tokens == sum(hits for _, hits, _ in cached)

    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    engine = build_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu"))
    for (prompt, n, extra), (tokens, _, _) in zip(traffic, cached):
        if not extra:
            assert tokens == engine.generate(prompt, n)[0]


def test_siblings_share_the_prompt_and_salts_isolate(small_pool_worker):
    prompt = list(range(20, 50))  # 30 tokens: 7 full blocks usable, the last token always computed

    async def body():
        async with running_router(small_pool_worker.address, max_batch_tokens=8) as (router, stub):
            registry = new_registry(process_metrics=False)
            metrics = MetricsHooks(RouterMetrics(registry, "tiny"))
            metrics.on_attached(router.batching_loop)
            router.batching_loop.hooks = ChainedHooks(router.batching_loop.hooks, metrics)
            same = await asyncio.gather(*(stub.Generate(_request(prompt, 3)) for _ in range(5)))
            hits = sorted(a.cached_prompt_tokens for a in same)
            # one computes the prompt; the others wait for its blocks and start on all seven
            assert hits == [0, 28, 28, 28, 28]
            assert len({tuple(a.token_ids) for a in same}) == 1
            for a in same:
                np.testing.assert_allclose(a.logprobs, same[0].logprobs, rtol=1e-4, atol=1e-5)
            salted = await stub.Generate(_request(prompt, 3, salt="tenant-b"))
            assert salted.cached_prompt_tokens == 0
            assert list(salted.token_ids) == list(same[0].token_ids)
            np.testing.assert_allclose(salted.logprobs, same[0].logprobs, rtol=1e-4, atol=1e-5)
            again = await stub.Generate(_request(prompt, 3, salt="tenant-b"))
            assert again.cached_prompt_tokens == 28
            logged = await stub.Generate(_request(prompt, 3, prompt_logprobs=1))
            assert logged.cached_prompt_tokens == 0 and len(logged.prompt_logprobs) == len(prompt)
            await drained(router, polls=300)

            def value(name):
                return registry.get_sample_value(name, {"model_name": "tiny"})

            # the prompt_logprobs request does not look the cache up; the seven others do
            assert value("colibri_prefix_cache_queries_total") == 7 * len(prompt)
            assert value("colibri_prefix_cache_hits_total") == 5 * 28
            # under two salts: the prompt's blocks, and the one its tail and the first two answer tokens fill
            # (greedy siblings answer alike: one cached), fed by the last decode
            assert value("colibri_prefix_cache_blocks") == 2 * (7 + 1)
            assert value("colibri_prefix_cache_evictions_total") == 0

    asyncio.run(body())


def test_a_next_turn_starts_on_the_previous_answer(small_pool_worker):
    """Chat turns resend the conversation: each turn's prompt is the previous one, its answer and a new user
    turn. The worker caches the full blocks the answer's decodes filled, so a turn starts on every full block of
    the previous prompt and answer (its last token is never fed), short of its own last token: 0, 16 and 28
    tokens for prompts of 10, 22 and 34 tokens with 9-token answers (8 and 20 if only prompts were cached); the
    tokens and log-probabilities equal those with caching off."""

    async def run(prefix_caching: bool):
        async with running_router(small_pool_worker.address, prefix_caching=prefix_caching, max_batch_tokens=8) as (
            router,
            stub,
        ):
            conversation, hits, answers = [30 + i for i in range(10)], [], []
            for turn in range(3):
                answer = await stub.Generate(_request(conversation, 9))
                answers.append((list(answer.token_ids), list(answer.logprobs)))
                hits.append(answer.cached_prompt_tokens)
                conversation = conversation + list(answer.token_ids) + [200 + turn, 210 + turn, 220 + turn]
            await drained(router, polls=300)
            return hits, answers

    cached_hits, cached = asyncio.run(run(True))
    plain_hits, plain = asyncio.run(run(False))
    assert cached_hits == [0, 16, 28] and plain_hits == [0, 0, 0]
    for (tokens, with_cache), (plain_tokens, without) in zip(cached, plain):
        assert tokens == plain_tokens
        np.testing.assert_allclose(with_cache, without, rtol=1e-4, atol=1e-5)


def test_a_restarted_worker_starts_with_an_empty_cache(tiny_model):
    from tests.helpers import free_port

    prompt, port = list(range(60, 90)), free_port()

    async def ready(router):
        for _ in range(500):
            if router.batching_loop.is_worker_ready:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the router did not reconnect")

    async def body():
        first = BackgroundWorker(tiny_model, port=port, kv_block_size=BLOCK).start()
        async with running_router(f"127.0.0.1:{port}") as (router, stub):
            cold = await stub.Generate(_request(prompt, 3))
            warm = await stub.Generate(_request(prompt, 3))
            assert (cold.cached_prompt_tokens, warm.cached_prompt_tokens) == (0, 28)
            await asyncio.to_thread(first.stop)
            for _ in range(500):  # the router notices the stream end (or its health poll fails)
                if not router.batching_loop.is_worker_ready:
                    break
                await asyncio.sleep(0.02)
            second = BackgroundWorker(tiny_model, port=port, kv_block_size=BLOCK).start()
            try:
                await ready(router)
                # the old index went with the old connection: nothing offered that the new worker lacks
                again = await stub.Generate(_request(prompt, 3))
                assert again.cached_prompt_tokens == 0 and list(again.token_ids) == list(cold.token_ids)
                np.testing.assert_allclose(again.logprobs, cold.logprobs, rtol=1e-4, atol=1e-5)
                assert (await stub.Generate(_request(prompt, 3))).cached_prompt_tokens == 28
            finally:
                await asyncio.to_thread(second.stop)

    asyncio.run(body())


def test_another_callers_clear_cache_leaves_a_live_routers_blocks(worker):
    """Another caller's ClearCache (an authenticated call: a second router connecting, an operator) while this
    router's stream is open but runs no sequence leaves the blocks that stream cached: its index still offers them,
    so the next request starts on them, equal to the cold run. The reset used to drop them, and the next request on
    them failed (UNKNOWN_PREFIX_BLOCK) for an action that was not its client's."""
    prompt = list(range(60, 90))

    async def body():
        async with running_router(worker.address) as (router, stub):
            cold = await stub.Generate(_request(prompt, 3))
            assert (await stub.Generate(_request(prompt, 3))).cached_prompt_tokens == 28
            await drained(router, worker.engine)  # the worker refuses the reset while our stream runs sequences
            cached_before = len(worker.engine.allocator.cached)
            assert cached_before > 0
            await router.worker.clear_cache()
            assert len(worker.engine.allocator.cached) == cached_before
            again = await stub.Generate(_request(prompt, 3))
            assert again.cached_prompt_tokens == 28 and list(again.token_ids) == list(cold.token_ids)
            np.testing.assert_allclose(again.logprobs, cold.logprobs, rtol=1e-4, atol=1e-5)
            await drained(router, worker.engine)

    asyncio.run(body())


def test_http_usage_reports_cached_tokens_and_salts_isolate_on_both_endpoints(worker, tiny_model, tmp_path):
    """On the OpenAI front, completions and chat alike: a salt's first request finds nothing cached (another
    salt's blocks are not offered), its repeats find the whole blocks before the last token, streamed usage equals
    the unary one, n > 1 reports per prompt; with caching off nothing is cached and the greedy text is the same."""
    import json

    import aiohttp

    from tests.router_service.test_openai_http import http_router, post

    message = [{"role": "user", "content": "a system prompt the tenants share " * 2}]
    endpoints = [("/v1/completions", {"prompt": list(range(30, 62))}), ("/v1/chat/completions", {"messages": message})]

    async def usage(session, url, payload, stream):
        if not stream:
            status, _, answer = await post(session, url, payload)
            assert status == 200, answer
            return answer["usage"], [c.get("text", c.get("message", {}).get("content")) for c in answer["choices"]]
        options = {"stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url, json=payload | options) as r:
            chunks = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        assert r.status == 200 and chunks[-1]["choices"] == [], chunks[-1]
        return chunks[-1]["usage"], None

    def cached(u):
        return u["prompt_tokens_details"]["cached_tokens"]

    async def run(prefix_caching):
        texts = []
        async with http_router(worker, tiny_model, tmp_path, prefix_caching=prefix_caching) as (_, _, _, base):
            async with aiohttp.ClientSession() as session:
                for path, prompt in endpoints:
                    url, got = base + path, []
                    # unsalted first: the salted requests after it must not find its blocks
                    for salt, n, stream in [
                        (None, 1, False),
                        ("a", 1, False),
                        ("a", 1, True),
                        ("b", 2, True),
                        ("b", 1, False),
                    ]:
                        payload = prompt | {"max_tokens": 3, "temperature": 0, "cache_salt": salt, "n": n}
                        u, text = await usage(session, url, payload, stream)
                        got.append((cached(u), u["prompt_tokens"]))
                        texts += text or []
                    whole = got[0][1] - 1 - (got[0][1] - 1) % BLOCK  # full blocks short of the last token
                    if prefix_caching:
                        assert [c for c, _ in got] == [0, 0, whole, 0, whole], (path, got)
                    else:
                        assert [c for c, _ in got] == [0] * 5, (path, got)
        return texts

    assert asyncio.run(run(True)) == asyncio.run(run(False))
