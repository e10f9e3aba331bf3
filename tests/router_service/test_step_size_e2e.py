"""Steps kept under the worker's receive limit, through the real services on loopback (CPU worker, tiny model): a
burst of requests whose first steps together pass a small worker --max-message-bytes (long prompts, and repetition
penalties whose cached prefix's tokens travel with their first chunk) all complete, token for token as against a
worker with the default limit, and every step message the router sends stays under the small one."""

import asyncio
import random

import numpy as np
import pytest

from common.pb import router_pb2 as rpb
from router_service.worker_client import StepStream
from tests.helpers import BackgroundWorker, drained, running_router

pytestmark = pytest.mark.slow

LIMIT = 8 * 1024  # the small worker's --max-message-bytes
BLOCK = 4


@pytest.fixture(scope="module")
def workers(tiny_model):
    """(a worker with the LIMIT, one with the default 64 MiB)."""
    engine = {"kv_block_size": BLOCK, "kv_cache_tokens": 16384}
    small = BackgroundWorker(tiny_model, worker_overrides={"max_message_bytes": LIMIT}, **engine).start()
    large = BackgroundWorker(tiny_model, **engine).start()
    yield small, large
    small.stop()
    large.stop()


def _traffic(seed: int):
    """A shared system prompt warmed into the cache, then one burst: penalised requests on it (each sends the
    prefix's tokens) and long unrelated prompts."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(rng.randrange(1100, 1300))]
    burst = []
    for _ in range(24):
        tail = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 12))]
        burst.append((system + tail, {"repetition_penalty": rng.choice([1.2, 1.5])}))
    for _ in range(6):
        burst.append(([rng.randrange(3, 250) for _ in range(rng.randrange(600, 760))], {}))
    rng.shuffle(burst)
    return (system + [7], {"repetition_penalty": 1.2}), burst


def _request(prompt, extra):
    return rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=prompt),
        parameters=rpb.SamplingParameters(max_new_tokens=6, ignore_eos=True, logprobs=True, **extra),
    )


async def _serve(worker, warm, burst):
    async with running_router(worker.address) as (router, stub):
        await stub.Generate(_request(*warm))  # the system prompt's blocks are cached from here on
        answers = await asyncio.gather(*(stub.Generate(_request(p, extra)) for p, extra in burst))
        await drained(router, polls=500)
        return [(list(a.token_ids), list(a.logprobs), a.cached_prompt_tokens) for a in answers]


@pytest.mark.parametrize("seed", [3, 8])
def test_a_burst_past_the_workers_message_limit_completes_as_under_a_large_one(workers, monkeypatch, seed):
    small, large = workers
    warm, burst = _traffic(seed)
    sizes: list[int] = []
    send = StepStream.send

    async def recording_send(self, request):
        sizes.append(request.ByteSize())
        await send(self, request)

    monkeypatch.setattr(StepStream, "send", recording_send)
    limited = asyncio.run(_serve(small, warm, burst))
    limited_sizes, sizes[:] = list(sizes), []
    expected = asyncio.run(_serve(large, warm, burst))

    assert max(sizes) > LIMIT, "the burst was meant to pass the small limit in one step"
    assert max(limited_sizes) <= LIMIT
    assert [tokens for tokens, _, _ in limited] == [tokens for tokens, _, _ in expected]
    for (_, got, _), (_, want, _) in zip(limited, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    penalised = [cached for (_, _, cached), (_, extra) in zip(limited, burst) if extra]
    assert all(penalised), "every penalised request started on the cached system prompt"
