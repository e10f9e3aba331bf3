"""Prefix caching of prompt and generated blocks through the real services on loopback (in-process router and cpu
worker, tiny model), attacked with seeded random chat traffic: conversations whose next turn resends the previous
prompt and answer (so it starts on the blocks the answer's decodes filled), identical conversations racing for the
same prompt and generated blocks (under one salt or two), shared system prompts, streams cancelled after some tokens
or some milliseconds (waiting, mid-prefill, mid-decode), stop ids reached while later decodes are in flight,
penalties, logit biases, seeded sampling, scored prompts; under each seed's draw of pipeline depth 1..4, a worker
whose cpu decoder runs each step at once (as served) or takes part in overlapped steps as the cuda one does (decodes
fed the step ahead's argmax; "paced": each step busy a while after its launch, as on a device), the expert cache
(0..3 slots of 4 experts, each prefetch source and policy), block sizes 1..16, batch limits and a KV pool small
enough to evict. Every stream equals the offline fp32 engine's for its prompt and sampling (a cancelled one, their
start; log-probabilities too where asked), and so does each conversation sent again whole, with log-probabilities,
on what stayed cached; once the traffic stops the worker holds no sequence and no KV block, its cached blocks are the
router's, and a request needing the whole pool still runs. A case's id names its seed and configuration;
COLIBRI_STRESS_SEEDS=1,2,... runs other seeds."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time

import numpy as np
import pytest

from common.model_format import ModelDir
from common.pb import router_pb2 as rpb
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from tests.helpers import BackgroundWorker, LogRecords, cpu_engine, drained, running_router

pytestmark = pytest.mark.slow

SEEDS = [int(s) for s in os.environ.get("COLIBRI_STRESS_SEEDS", "").split(",") if s.strip()] or [
    48611,
    7302915,
    90417,
    5531,
    2760843,
    613099,
]


KINDS = ("logprobs", "penalised", "stop", "biased", "seeded", "scored")


def _case(seed: int) -> dict:
    """The services' configuration a seed draws."""
    rng = random.Random(seed)
    block = rng.choice([1, 2, 4, 4, 8, 16])
    slots = rng.choice([0, 1, 1, 2, 3])
    return dict(
        depth=rng.choice([1, 2, 3, 3, 4]),
        decoder=rng.choice(["at-once", "overlap", "paced", "paced"]),
        slots=slots,
        prefetch=rng.choice(["none", "lookahead", "plan", "plan,lookahead"]) if slots else "none",
        policy=rng.choice(["lru", "lfu"]),
        block=block,
        pool=rng.choice([96, 128, 160, 4096]) // block,  # blocks: a small pool evicts
        batch_tokens=rng.choice([5, 8, 16, 256]),
        batch_size=rng.choice([3, 6, 16]),
    )


def _case_id(seed: int) -> str:
    return f"seed{seed}-" + "-".join(f"{k}={v}" for k, v in _case(seed).items())


def _conversations(rng: random.Random, pool_tokens: int) -> list[tuple]:
    """(system prompt, turns [(user tokens, max_new_tokens, cancel, kind)], start delay, cache salt); cancel: None,
    after k tokens (int) or after s seconds (float, often mid-prefill). Some conversations repeat an earlier one,
    so their greedy answers race for the same blocks (under the same salt, or another that must not share)."""
    systems = [[rng.randrange(3, 259) for _ in range(rng.randrange(1, 24))] for _ in range(2)] + [[]]
    out: list[tuple] = []
    for _ in range(rng.randrange(4, 13)):
        if out and rng.random() < 0.25:
            twin = rng.choice(out)  # at once, or later: started on what the first cached
            out.append((*twin[:2], rng.choice([twin[2], rng.random() * 0.03]), rng.choice([twin[3], "other"])))
            continue
        system, turns, length = rng.choice(systems), [], 0
        for turn in range(rng.randrange(1, 5)):
            n = rng.randrange(1, 15)
            cancel = rng.choice([None] * 10 + [rng.randrange(1, n + 1)] + [rng.uniform(0.001, 0.012)] * 2)
            long = isinstance(cancel, float) or rng.random() < 0.2  # a prompt in chunks: a cancel lands mid-prefill
            user = [rng.randrange(3, 259) for _ in range(30 if long else rng.randrange(0 if turn else 1, 7))]
            length += len(user) + n
            if len(system) + length > min(pool_tokens, 120) - 16:
                break
            turns.append((user, n, cancel, rng.choice(["greedy"] * 6 + list(KINDS))))
        out.append((system, turns, rng.random() * 0.03, rng.choice(["", "", "tenant"])))
    return out


def _params(kind: str, rng: random.Random, answer: list[int]) -> dict:
    """A request's sampling parameters: greedy; with log-probabilities (its steps are not overlapped); penalised;
    stop ids (one its greedy answer reaches: the stream ends while decodes past it are in flight), suppressed for
    the first tokens; a logit bias; seeded sampling; prompt log-probabilities."""
    stop = [answer[rng.randrange(len(answer))], rng.randrange(3, 259)]
    return {
        "greedy": {},
        "logprobs": {"logprobs": True},
        "penalised": {"repetition_penalty": 1.3, "presence_penalty": 0.5},
        "stop": {"stop_token_ids": stop, "min_new_tokens": min(rng.choice([0, 0, 1, 3]), len(answer))},
        "biased": {"logit_bias": {answer[-1]: 2.0, rng.randrange(3, 259): -1.5}},
        "seeded": {"temperature": 0.8, "top_k": 20, "seed": rng.randrange(1, 1 << 30)},
        "scored": {"prompt_logprobs": 1},  # neither hits nor caches its prompt
    }[kind]


def _sampling(params: dict) -> SamplingParams:
    """The offline engine's sampling for the same request."""
    penalties = PenaltyParams(params.get("repetition_penalty", 1.0), params.get("presence_penalty", 0.0))
    known = ("temperature", "top_k", "seed", "min_new_tokens", "logprobs")
    return SamplingParams(
        stop_token_ids=tuple(params.get("stop_token_ids", ())),
        logit_bias=tuple(params.get("logit_bias", {}).items()),
        penalties=penalties,
        **{k: v for k, v in params.items() if k in known},
    )


def _request(prompt: list[int], n: int, salt: str = "", **params) -> rpb.GenerateRequest:
    return rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=prompt),
        cache_salt=salt,
        parameters=rpb.SamplingParameters(max_new_tokens=n, ignore_eos=True, **params),
    )


async def _read(call, cancel, got: list[int], logprobs: list[float]) -> None:
    async for message in call:
        got.extend(message.token_ids)
        logprobs.extend(message.logprobs)
        if isinstance(cancel, int) and len(got) >= cancel:
            return


async def _talk(stub, conversation, rng: random.Random, offline, log: list) -> None:
    system, turns, delay, salt = conversation
    await asyncio.sleep(delay)
    history = list(system)
    for user, n, cancel, kind in turns:
        prompt = history + user or [7]
        params = _params(kind, rng, offline(prompt, n, {})[0])
        call = stub.GenerateStream(_request(prompt, n, salt, **params))
        got: list[int] = []
        logprobs: list[float] = []
        try:
            await asyncio.wait_for(_read(call, cancel, got, logprobs), cancel if isinstance(cancel, float) else None)
        except TimeoutError:
            pass
        if cancel is not None:
            call.cancel()
        log.append((prompt, n, params, got, logprobs, cancel is not None, salt))
        history = prompt + got
        await asyncio.sleep(rng.random() * 0.005)


def _overlapped(model, config, paced: random.Random | None):
    """A cpu engine whose steps launch behind the one in flight, their decodes fed its argmax, as the cuda
    backend's do. paced: like a device, each step is busy a random 0-4 ms after its launch (the worker looks for
    the router's next step meanwhile), and launching a step of over 64 tokens waits for the one in flight."""
    engine = cpu_engine(model, config, True)
    if paced is None:
        return engine
    decoder, busy_until = engine.decoder, {}
    launch, finish = decoder.launch, decoder.finish

    def paced_launch(batch, traced=False):
        launched = launch(batch, traced)
        busy_until[id(launched[0])] = time.monotonic() + paced.random() * 0.004
        return launched

    def paced_finish(launched, trace=None):
        time.sleep(max(busy_until.pop(id(launched[0]), 0.0) - time.monotonic(), 0.0))
        return finish(launched, trace)

    decoder.launch, decoder.finish = paced_launch, paced_finish
    decoder.ready = lambda launched: time.monotonic() >= busy_until.get(id(launched[0]), 0.0)
    decoder.blocks_host = lambda num_tokens: num_tokens > 64
    return engine


@pytest.fixture(scope="module")
def offline(tiny_model):
    engine = build_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu"))
    memo: dict = {}

    def greedy(prompt: list[int], n: int, params: dict) -> tuple[list[int], list[float]]:
        key = (tuple(prompt), n, repr(params))
        if key not in memo:
            sampling = _sampling(params)
            memo[key] = engine.generate(prompt, n, sampling, sampling.stop_token_ids)[:2]
        return memo[key]

    return greedy


@pytest.fixture
def records():
    handler = LogRecords(logging.WARNING)
    logger = logging.getLogger("colibri")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.mark.parametrize("seed", SEEDS, ids=_case_id)
def test_random_chat_traffic_equals_offline(tiny_model, offline, records, monkeypatch, seed):
    case = _case(seed)
    if case["decoder"] != "at-once":
        import expert_service.serving.main as worker_main

        paced = random.Random(seed + 1) if case["decoder"] == "paced" else None
        monkeypatch.setattr(
            worker_main, "build_engine", lambda model, config, slot_plan=None: _overlapped(model, config, paced)
        )
    worker = BackgroundWorker(
        tiny_model,
        kv_block_size=case["block"],
        kv_cache_tokens=case["block"] * case["pool"],
        max_batch_size=16,
        expert_cache_slots=case["slots"],
        prefetch=case["prefetch"],
        expert_cache_policy=case["policy"],
        prefetch_large_steps=True,  # each source beside batched and chunked steps too (by default they copy misses)
    ).start()
    assert worker.engine.decoder.supports_overlap == (case["decoder"] != "at-once")
    rng = random.Random(seed)
    conversations = _conversations(rng, case["block"] * case["pool"])
    log: list = []

    async def body():
        async with running_router(
            worker.address,
            pipeline_depth=case["depth"],
            max_batch_tokens=case["batch_tokens"],
            max_batch_size=case["batch_size"],
        ) as (router, stub):
            cache = router.batching_loop.scheduler.prefix_cache
            assert cache is not None and cache.caches_generated
            for _ in range(2):  # a second round starts on what the first left cached
                await asyncio.gather(
                    *(_talk(stub, c, random.Random(rng.random()), offline, log) for c in conversations)
                )
            await drained(router, worker.engine)
            cache = router.batching_loop.scheduler.prefix_cache
            counted = set(cache._by_id) - set(cache.pending_evictions)
            assert {block_id for _, block_id in worker.engine.allocator.cached} == counted
            # every conversation so far, at once with log-probabilities: on whatever prompt and answer blocks stayed
            histories = list(dict.fromkeys((tuple(p + g), salt) for p, _, _, g, _, _, salt in log))
            audits = await asyncio.gather(*(stub.Generate(_request([*h], 2, s, logprobs=True)) for h, s in histories))
            for (h, s), a in zip(histories, audits):
                log.append(([*h], 2, {"logprobs": True}, list(a.token_ids), list(a.logprobs), False, s))
            await drained(router, worker.engine)
            big = [3 + (i * 37) % 250 for i in range(min(case["block"] * case["pool"], 200) - 8)]
            last = await stub.Generate(_request(big, 8))
            await drained(router, worker.engine)
            return list(last.token_ids), big, cache.num_hit_tokens, cache.num_evicted

    try:
        last, big, hits, evicted = asyncio.run(body())
    finally:
        worker.stop()
    wrong = []
    for prompt, n, params, got, logprobs, cancelled, _ in log:
        want, want_logprobs = offline(prompt, n, params)
        if got != (want[: len(got)] if cancelled else want):
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            wrong.append(f"{len(prompt)}-token prompt {prompt}, n={n} {params} cancelled={cancelled}: differs at {at}")
            wrong.append(f"    got     {got}\n    offline {want}")
        elif logprobs and not np.allclose(logprobs, want_logprobs[: len(logprobs)], rtol=1e-4, atol=1e-5):
            wrong.append(f"{len(prompt)}-token prompt {prompt}, n={n} {params}: log-probabilities differ")
            wrong.append(f"    got     {logprobs}\n    offline {want_logprobs}")
    assert not wrong, f"seed {seed} {case}: {len(wrong) // 2} of {len(log)} streams differ\n" + "\n".join(wrong)
    assert last == offline(big, 8, {})[0], f"seed {seed} {case}: the pool-sized request differs"
    assert not records.errors(), f"seed {seed} {case}: {records.errors()}"
    print(f"seed {seed} {case}: {len(log)} streams, {hits} hit tokens, {evicted} evicted blocks")
