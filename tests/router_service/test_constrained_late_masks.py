"""Late masks end to end (the router's batching loop and the cpu worker over gRPC, the default model): greedy
constrained requests give the same tokens at pipeline depth 1, at depth 2, where their masks ride the message
after their step, and at depth 3, which keeps at most two steps in flight while a constrained request runs, among
unconstrained and sampled constrained neighbours and streams cancelled mid-way; every output is in its
constraint's language, and both sides hold nothing after."""

import asyncio
import json
import random
import re

import jsonschema
import llguidance
import pytest

from common.pb import router_pb2 as rpb
from router_service import wire
from tests.helpers import BackgroundWorker, running_router
from tests.router_service.test_constrained_property import matches_prefix, random_regex, random_schema

pytestmark = pytest.mark.slow
NUM_REQUESTS, MAX_NEW_TOKENS = 56, 20
STEP_REQUEST = wire.step_request


@pytest.fixture(scope="module")
def default_worker(default_model):
    w = BackgroundWorker(default_model, max_batch_size=64).start()
    yield w
    w.stop()


def traffic(seed: int) -> list[dict]:
    """Random requests: greedy constrained (schemas and regexes), plain greedy, sampled constrained, and greedy
    constrained streams cancelled after a few tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(NUM_REQUESTS):
        kind = rng.choice(["greedy", "greedy", "greedy", "plain", "sampled", "cancelled"])
        schema = random_schema(rng) if rng.random() < 0.6 else None
        regex = None if schema is not None else random_regex(rng)
        constraint = rpb.Constraint(json_schema=json.dumps(schema)) if schema else rpb.Constraint(regex=regex)
        params = rpb.SamplingParameters(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0 if kind == "sampled" else 0)
        params.seed = i
        if kind != "plain":
            params.constraint.CopyFrom(constraint)
        text = rng.choice(["The", "And God said,", "In the beginning", "{"])
        out.append(dict(kind=kind, schema=schema, regex=regex, params=params, text=text, cancel=rng.randint(1, 4)))
    return out


async def run(stub, req: dict):
    """(token ids, stop reason or None when cancelled, text) of one request."""
    if req["kind"] != "cancelled":
        out = await stub.Generate(rpb.GenerateRequest(text=req["text"], parameters=req["params"]))
        return list(out.token_ids), out.stop_reason, out.text
    call = stub.GenerateStream(rpb.GenerateStreamRequest(text=req["text"], parameters=req["params"]))
    tokens: list[int] = []
    async for message in call:
        tokens += message.token_ids
        if message.stop_reason or len(tokens) >= req["cancel"]:
            break
    call.cancel()
    return tokens, None, ""


def serve(worker, model, requests, depth: int, monkeypatch) -> tuple[list, int, object]:
    """Every request at once through a router of this pipeline depth: outputs, messages carrying late masks.
    Checks at every send that no more than two steps are in flight while a constrained request runs."""
    sent_late, loops = [], []

    def counting(*args, **kwargs):
        request = STEP_REQUEST(*args, **kwargs)
        sent_late.append(bool(request.late_token_masks))
        loop = loops[0]
        if any(state.matcher is not None for state in loop._requests.values()):
            assert len(loop._pipeline) < 2, "a third step in flight while a constrained request runs"
        return request

    monkeypatch.setattr(wire, "step_request", counting)

    async def body():
        async with running_router(worker.address, model=str(model), pipeline_depth=depth) as (router, stub):
            loops.append(router.batching_loop)
            outs = await asyncio.gather(*(run(stub, r) for r in requests))
            for _ in range(200):  # the cancels' frees go out with the next step
                if not router.batching_loop.scheduler.requests:
                    break
                await asyncio.sleep(0.01)
            assert not router.batching_loop.scheduler.requests
            after = await stub.Generate(rpb.GenerateRequest(text="The", parameters=requests[0]["params"]))
            return outs, router.batching_loop._constraints.tokenizer, after

    outs, tokenizer, after = asyncio.run(body())
    return outs, sum(sent_late), (tokenizer, list(after.token_ids))


def check_language(req: dict, tokens: list[int], reason, tokenizer, text: str) -> None:
    if req["kind"] == "plain":
        return
    if req["schema"] is not None:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(req["schema"], defaults={"whitespace_flexible": False})
    else:
        grammar = llguidance.LLMatcher.grammar_from_regex(req["regex"])
    assert matches_prefix(grammar, tokenizer, tokens), (req, text)
    if reason == rpb.STOP_REASON_EOS and req["schema"] is not None:
        jsonschema.validate(json.loads(text), req["schema"])
    elif reason == rpb.STOP_REASON_EOS:
        assert re.fullmatch(req["regex"], text), (req["regex"], text)


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_constrained_tokens_are_the_same_at_depth_1_2_and_3(default_worker, default_model, monkeypatch, seed):
    requests = traffic(seed)
    one, late_one, (tokenizer, after_one) = serve(default_worker, default_model, requests, 1, monkeypatch)
    two, late_two, (_, after_two) = serve(default_worker, default_model, requests, 2, monkeypatch)
    three, late_three, (_, after_three) = serve(default_worker, default_model, requests, 3, monkeypatch)
    assert late_one == 0 and late_two > 0 and late_three > 0  # depths 2 and 3 took the late path
    assert after_one == after_two == after_three
    for req, (tokens_1, reason_1, _), (tokens_2, reason_2, text), (tokens_3, reason_3, _) in zip(
        requests, one, two, three
    ):
        assert tokens_1 == tokens_2 == tokens_3 and reason_1 == reason_2 == reason_3, req
        check_language(req, tokens_2, reason_2, tokenizer, text)
