"""Prefix caching across a worker crash: a real `colibri worker` process behind an in-process router, SIGKILLed
while shared-prefix traffic under several salts runs, then restarted on the same port. Before, during and after:
answers equal a fresh router + worker with caching off (tokens, and log-probabilities, which a wrong KV block would
move); the requests in flight at the kill end with UNAVAILABLE or INTERNAL and a one-line reason, none hangs; the
router's index starts empty on the new worker, so cached_prompt_tokens is exactly what the traffic since the restart
cached; the prefix-cache gauge drops to zero while the worker is gone and the counters never go back."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import numpy as np
import pytest

from common.metrics import RouterMetrics, new_registry
from common.pb import router_pb2 as rpb
from router_service.observability import ChainedHooks, MetricsHooks
from tests.expert_service.serving.worker_process import free_port, start_worker, wait_for
from tests.helpers import running_router

pytestmark = pytest.mark.slow

BLOCK = 4  # start_worker's --kv-block-size
SALTS = ("", "tenant-a", "tenant-b")
LONG_NEW_TOKENS = 1500  # the streams in flight at the kill: far from done when it comes
COUNTERS = ("colibri_prefix_cache_queries_total", "colibri_prefix_cache_hits_total")


def _traffic(rng: random.Random, systems: list[list[int]], tails=(0, 0, 2, 5)) -> list[tuple[list[int], int, str]]:
    """(prompt, max_new_tokens, salt): every system prompt under every salt, with short tails (0: a repeat)."""
    out = [
        (system + [rng.randrange(3, 250) for _ in range(rng.choice(tails))], rng.randrange(2, 6), salt)
        for salt in SALTS
        for system in systems
        for _ in range(3)
    ]
    rng.shuffle(out)
    return out


def _request(prompt, n, salt, stream=False):
    kind = rpb.GenerateStreamRequest if stream else rpb.GenerateRequest
    return kind(
        token_ids=rpb.TokenIds(ids=prompt),
        # logprobs: a tiny random model's greedy tokens hardly depend on context, its log-probabilities do
        parameters=rpb.SamplingParameters(max_new_tokens=n, ignore_eos=True, logprobs=True),
        cache_salt=salt,
    )


class _CacheModel:
    """The blocks a sequence of completed requests leaves cached (no evictions: the pool holds them all): every
    full block of the tokens each fed the worker (its prompt, and its answer but the last token, never fed), and
    what the next request should therefore start on: its leading full blocks cached under its salt, short of
    its last token."""

    def __init__(self):
        self.blocks: set[tuple[str, tuple[int, ...]]] = set()

    def expected_hit(self, prompt: list[int], salt: str) -> int:
        k = 0
        while k < (len(prompt) - 1) // BLOCK and (salt, tuple(prompt[: (k + 1) * BLOCK])) in self.blocks:
            k += 1
        return k * BLOCK

    def add(self, prompt: list[int], salt: str, answer: list[int]) -> None:
        fed = prompt + answer[:-1]
        self.blocks |= {(salt, tuple(fed[: (i + 1) * BLOCK])) for i in range(len(fed) // BLOCK)}


def _is_clean_failure(error: grpc.aio.AioRpcError) -> bool:
    details = error.details() or ""
    return (
        error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
        and bool(details)
        and "\n" not in details
        and "Traceback" not in details
    )


class _WorkerOnPort:
    """`colibri worker` processes, one at a time, on one loopback port: start, SIGKILL, start again."""

    def __init__(self, model, log_path):
        self.model, self.port = model, free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 (every process appends to it; closed by `stop`)
        self.process = None

    def start(self) -> None:
        args = ("--port", str(self.port), "--kv-cache-tokens", "8192")
        self.process = start_worker(self.model, *args, stderr=self.log)
        wait_for(self.address, process=self.process)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()
        self.log.close()


async def _until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_a_worker_killed_mid_traffic_leaves_no_stale_prefix_blocks(tiny_model, tmp_path):
    rng = random.Random(5)
    systems = [[rng.randrange(3, 250) for _ in range(n)] for n in (17, 24)]
    before, after = _traffic(rng, systems), _traffic(rng, systems)
    wave = _traffic(rng, systems, tails=(0, 1, 3))  # concurrent, after the restart
    at_kill = [(s + [rng.randrange(3, 250)], 40, salt) for s in systems for salt in SALTS]  # racing the kill
    streams = [(systems[i % 2] + [9, i], LONG_NEW_TOKENS, salt) for i, salt in enumerate(SALTS)]
    # The long streams' first tokens: a greedy output's first 8 are those of a run asked for 8.
    references = {(tuple(p), n) for p, n, _ in before + after + wave + at_kill} | {(tuple(p), 8) for p, _, _ in streams}

    worker = _WorkerOnPort(tiny_model, tmp_path / "worker.log")
    registry = new_registry(process_metrics=False)
    seen: dict[str, list[float]] = {name: [] for name in COUNTERS}  # the counters at each phase's end

    def sample():
        for name in COUNTERS:
            seen[name].append(value(name))

    def value(name: str) -> float:
        sample = registry.get_sample_value(name, {"model_name": "tiny"})
        assert sample is not None, f"no {name} series"
        return sample

    async def reference():
        async with running_router(worker.address, prefix_caching=False, max_batch_tokens=8) as (_, stub):
            keys = sorted(references)
            answers = await asyncio.gather(*(stub.Generate(_request(list(p), n, "")) for p, n in keys))
        return {key: (list(a.token_ids), list(a.logprobs)) for key, a in zip(keys, answers)}

    def check(answer, prompt, n, want_hit=None):
        tokens, logprobs = expected[(tuple(prompt), n)]
        assert list(answer.token_ids) == tokens
        np.testing.assert_allclose(answer.logprobs, logprobs, rtol=1e-4, atol=1e-5)
        hit = answer.cached_prompt_tokens
        assert hit % BLOCK == 0 and hit < len(prompt)
        if want_hit is not None:
            assert hit == want_hit, (prompt, want_hit, hit)

    async def sequential(stub, traffic, model: _CacheModel) -> list[int]:
        hits = []
        for prompt, n, salt in traffic:
            answer = await stub.Generate(_request(prompt, n, salt))
            check(answer, prompt, n, model.expected_hit(prompt, salt))
            model.add(prompt, salt, list(answer.token_ids))
            hits.append(answer.cached_prompt_tokens)
        return hits

    async def body(router, stub):
        loop = router.batching_loop
        metrics = MetricsHooks(RouterMetrics(registry, "tiny"))
        metrics.on_attached(loop)
        loop.hooks = ChainedHooks(loop.hooks, metrics)
        # Before: each salt's first request on a system prompt computes it, the later ones start on it.
        model = _CacheModel()
        await sequential(stub, before, model)
        assert value("colibri_prefix_cache_blocks") == len(model.blocks)
        assert value("colibri_prefix_cache_hits_total") > 0
        sample()

        # During: long streams on the cached prompts, and requests racing for a new block of each, then SIGKILL.
        calls = [stub.GenerateStream(_request(p, n, salt, stream=True)) for p, n, salt in streams]
        received = [list((await call.read()).token_ids) for call in calls]
        racing = [asyncio.ensure_future(stub.Generate(_request(p, n, salt))) for p, n, salt in at_kill]
        await asyncio.sleep(0.02)
        worker.process.send_signal(signal.SIGKILL)
        late = [asyncio.ensure_future(stub.Generate(_request(p, n, salt))) for p, n, salt in at_kill[:2]]

        async def drain(call, tokens):
            while (message := await call.read()) is not grpc.aio.EOF:
                tokens += message.token_ids
            raise AssertionError(f"a stream of {LONG_NEW_TOKENS} tokens finished across the kill")

        outcomes = await asyncio.wait_for(
            asyncio.gather(*(drain(c, t) for c, t in zip(calls, received)), *racing, *late, return_exceptions=True),
            30,
        )
        for (prompt, _, _), tokens, outcome in zip(streams, received, outcomes):
            assert isinstance(outcome, grpc.aio.AioRpcError) and _is_clean_failure(outcome), outcome
            assert tokens[:8] == expected[(tuple(prompt), 8)][0][: len(tokens)]
        for (prompt, n, _), outcome in zip(at_kill + at_kill[:2], outcomes[len(streams) :]):
            if isinstance(outcome, grpc.aio.AioRpcError):
                assert _is_clean_failure(outcome), outcome
            else:  # done before the kill
                check(outcome, prompt, n)
        worker.process.wait(10)

        # While it is down: nothing cached, nothing running, new requests refused at once.
        await _until(lambda: not loop.is_worker_ready, "the router did not notice the killed worker")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(_request(before[0][0], 2, ""), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert value("colibri_prefix_cache_blocks") == 0
        assert value("colibri_num_requests_running") == value("colibri_num_requests_waiting") == 0
        sample()

    async def after_restart(router, stub):
        loop = router.batching_loop
        await _until(lambda: loop.is_worker_ready, "the router did not reconnect to the restarted worker")
        queries, hits = (value(name) for name in COUNTERS)
        model = _CacheModel()
        sequential_hits = await sequential(stub, after, model)
        answers = await asyncio.gather(*(stub.Generate(_request(p, n, salt)) for p, n, salt in wave))
        for (prompt, n, _), answer in zip(wave, answers):
            check(answer, prompt, n)
        for (prompt, _, salt), answer in zip(wave, answers):
            model.add(prompt, salt, list(answer.token_ids))
        await _until(lambda: loop.num_active == 0, "requests still active after the traffic")
        assert value("colibri_prefix_cache_blocks") == len(model.blocks)
        assert value("colibri_prefix_cache_evictions_total") == 0
        wave_hits = [a.cached_prompt_tokens for a in answers]
        assert any(wave_hits), "the concurrent wave found nothing cached"
        sample()
        # The counters went on from where they were: exactly the traffic since the restart was added.
        assert value("colibri_prefix_cache_queries_total") - queries == sum(len(p) for p, _, _ in after + wave)
        assert value("colibri_prefix_cache_hits_total") - hits == sum(sequential_hits) + sum(wave_hits)

    async def main():
        async with running_router(worker.address, max_batch_tokens=8) as (router, stub):
            await body(router, stub)
            await asyncio.to_thread(worker.start)
            await after_restart(router, stub)
        for name, values in seen.items():
            assert values == sorted(values) and values[0] > 0, (name, values)

    worker.start()
    try:
        expected = asyncio.run(reference())
        asyncio.run(main())
    finally:
        worker.stop()


def test_a_worker_restarted_while_the_router_idles_serves_the_next_request(tiny_model, tmp_path, monkeypatch):
    """The worker dies with no step in flight and is back before the router's idle health poll (made long here,
    so the restart surely fits between two polls): the step stream's end alone tells the router, which
    reconnects, so the first request after the restart is served, on an empty index, not failed on a dead
    stream."""
    from router_service import batching_loop

    monkeypatch.setattr(batching_loop, "IDLE_POLL_S", 60.0)
    prompt = list(range(60, 90))
    worker = _WorkerOnPort(tiny_model, tmp_path / "worker.log")

    async def main():
        async with running_router(worker.address) as (router, stub):
            cold = await stub.Generate(_request(prompt, 3, "tenant-a"))
            warm = await stub.Generate(_request(prompt, 3, "tenant-a"))
            assert (cold.cached_prompt_tokens, warm.cached_prompt_tokens) == (0, 28)
            await _until(lambda: router.batching_loop.num_active == 0, "requests still active")
            await asyncio.sleep(0.2)  # the frees of those requests are answered: nothing is in flight
            await asyncio.to_thread(worker.kill)
            await asyncio.to_thread(worker.start)
            await _until(lambda: router.batching_loop.is_worker_ready, "the router did not reconnect")
            again = await stub.Generate(_request(prompt, 3, "tenant-a"), timeout=10)
            assert again.cached_prompt_tokens == 0 and list(again.token_ids) == list(cold.token_ids)
            np.testing.assert_allclose(again.logprobs, cold.logprobs, rtol=1e-4, atol=1e-5)
            assert (await stub.Generate(_request(prompt, 3, "tenant-a"))).cached_prompt_tokens == 28

    worker.start()
    try:
        asyncio.run(main())
    finally:
        worker.stop()
