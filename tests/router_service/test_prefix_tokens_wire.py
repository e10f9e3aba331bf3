"""What the router sends of a penalised request's cached prefix, through the real services on loopback (CPU worker,
tiny model), every step message recorded: a repetition penalty's request carries its cached prefix's tokens once,
on its first chunk, and none of its later chunks (chunked prefill) or decodes (two steps in flight) carries them
again; a presence- or frequency-only request, whose penalties count output tokens only, carries none. Greedy
answers and log-probabilities equal those of a router with prefix caching off."""

import asyncio
import random

import numpy as np
import pytest

from common.pb import router_pb2 as rpb
from router_service import wire
from tests.helpers import BackgroundWorker, drained, running_router

pytestmark = pytest.mark.slow

BLOCK = 4
PENALTIES = {
    "repetition": {"repetition_penalty": 1.6},
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.2},
    "all": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5},
}


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = BackgroundWorker(tiny_model, kv_block_size=BLOCK, kv_cache_tokens=BLOCK * 96).start()
    yield w
    w.stop()


def _kind(sampling) -> str:
    """Which of PENALTIES a first chunk's sampling settings are."""
    on = (sampling.HasField("repetition_penalty"), sampling.presence_penalty != 0, sampling.frequency_penalty != 0)
    return {
        (True, False, False): "repetition",
        (False, True, False): "presence",
        (False, False, True): "frequency",
    }.get(on, "all" if all(on) else "none")


class Recorder:
    """Every step message the router builds: per worker sequence, its kind, its first chunk's start, and the
    number of prefix tokens it carried in each message it took part in (chunks, then decodes: 0)."""

    def __init__(self):
        self.kinds: dict[int, str] = {}
        self.starts: dict[int, int] = {}
        self.prefix_tokens: dict[int, list[int]] = {}
        self.chunks: dict[int, int] = {}

    def __call__(self, *args, **kwargs):
        request = BUILD(*args, **kwargs)
        for chunk in request.chunks:
            rid = chunk.request_id
            if chunk.HasField("sampling"):
                self.kinds[rid], self.starts[rid] = _kind(chunk.sampling), chunk.start_position
            self.prefix_tokens.setdefault(rid, []).append(len(chunk.prefix_token_ids))
            self.chunks[rid] = self.chunks.get(rid, 0) + 1
        for rid in np.frombuffer(request.decode_request_ids, "<u8").tolist():
            self.prefix_tokens.setdefault(rid, []).append(0)
        return request


BUILD = wire.step_request


def _request(prompt, **penalties):
    parameters = rpb.SamplingParameters(max_new_tokens=8, ignore_eos=True, logprobs=True, **penalties)
    return rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=prompt), parameters=parameters)


def test_a_cached_prefix_travels_once_and_only_for_a_repetition_penalty(worker, monkeypatch):
    rng = random.Random()
    system = [rng.randrange(3, 250) for _ in range(rng.randrange(5, 9) * BLOCK + rng.randrange(BLOCK))]
    # tails longer than max_batch_tokens: each prompt's rest is split into chunks
    prompts = {kind: system + [rng.randrange(3, 250) for _ in range(rng.randrange(9, 20))] for kind in PENALTIES}

    async def run(prefix_caching: bool, recorder: Recorder | None):
        async with running_router(
            worker.address, prefix_caching=prefix_caching, max_batch_tokens=8, pipeline_depth=2
        ) as (router, stub):
            await stub.Generate(_request(system))  # caches the system prompt's full blocks
            if recorder is not None:
                monkeypatch.setattr(wire, "step_request", recorder)
            answers = await asyncio.gather(
                *(stub.Generate(_request(prompts[kind], **extra)) for kind, extra in PENALTIES.items())
            )
            monkeypatch.setattr(wire, "step_request", BUILD)
            await drained(router, polls=300)
        return {kind: answer for kind, answer in zip(PENALTIES, answers)}

    recorder = Recorder()
    cached = asyncio.run(run(True, recorder))
    plain = asyncio.run(run(False, None))
    for kind in PENALTIES:
        assert list(cached[kind].token_ids) == list(plain[kind].token_ids), kind
        np.testing.assert_allclose(cached[kind].logprobs, plain[kind].logprobs, rtol=1e-4, atol=1e-5)
        assert cached[kind].cached_prompt_tokens > 0 and plain[kind].cached_prompt_tokens == 0
    by_kind = {kind: rid for rid, kind in recorder.kinds.items()}
    assert set(by_kind) == set(PENALTIES)
    for kind, rid in by_kind.items():
        sent, hits = recorder.prefix_tokens[rid], cached[kind].cached_prompt_tokens
        assert recorder.starts[rid] == hits and recorder.chunks[rid] >= 2 and len(sent) >= recorder.chunks[rid] + 7
        if kind in ("repetition", "all"):  # once, with the first chunk
            assert sent[0] == hits and sum(sent[1:]) == 0, (kind, sent)
        else:
            assert sum(sent) == 0, (kind, sent)
