"""Log-probabilities, penalties and generation_config.json defaults through the real services (router + CPU
worker), against transformers on the tiny model's own checkpoint: greedy tokens under repetition, presence and
frequency penalties, top-n and prompt log-probabilities (the prompt scored in chunks), unary and stream alike;
every new field validated by name with the router serving on; the model's defaults applied to unset fields."""

import asyncio
import json
import shutil

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import EOS_ID
from tests.helpers import running_router

pytestmark = pytest.mark.slow
PROMPT = [40, 41, 40, 77, 105, 40, 41, 9, 200, 77, 13]


@pytest.fixture(scope="module")
def hf(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model / "hf", dtype=torch.float32).eval()


def reference(hf, prompt, steps: int, repetition: float, presence: float, frequency: float):
    """transformers' logits, its repetition processor, OpenAI's presence/frequency over the output counts:
    (greedy tokens, raw log-softmax rows of the whole sequence)."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[:, -1].float()
        logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), logits)[0].double().numpy()
        tokens, counts = np.unique(np.array(ids[len(prompt) :], np.int64), return_counts=True)
        logits[tokens] -= counts * frequency + presence
        ids.append(int(np.argmax(logits)))
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    return ids[len(prompt) :], rows


def request(**parameters):
    return rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=PROMPT),
        parameters=rpb.SamplingParameters(
            **{"max_new_tokens": 8, "ignore_eos": True, "temperature": 0.0, **parameters}
        ),
    )


def test_penalties_and_logprobs_equal_transformers_unary_and_streamed(worker, tiny_model, hf):
    params = dict(
        repetition_penalty=1.4,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        logprobs=True,
        top_logprobs=5,
        prompt_logprobs=3,
    )

    async def body():
        # max_batch_size 4: the prompt is scored 4 tokens a step, its chunks stitched on the worker
        async with running_router(worker.address, model=str(tiny_model), max_batch_size=4) as (router, stub):
            unary = await stub.Generate(request(**params))
            stream = [m async for m in stub.GenerateStream(request(**params))]
            plain = await stub.Generate(request())
            return unary, stream, plain

    unary, stream, plain = asyncio.run(body())
    tokens, rows = reference(hf, PROMPT, 8, 1.4, 0.5, 0.7)
    assert list(unary.token_ids) == tokens and list(plain.token_ids) != tokens
    n = len(PROMPT)
    for i, (token, lp, top) in enumerate(zip(unary.token_ids, unary.logprobs, unary.top_logprobs)):
        assert lp == pytest.approx(rows[n - 1 + i, token], abs=2e-4)  # the raw distribution
        assert list(top.token_ids) == np.argsort(-rows[n - 1 + i], kind="stable")[:5].tolist()
        np.testing.assert_allclose(top.logprobs, np.sort(rows[n - 1 + i])[::-1][:5], atol=2e-4)
        assert len(top.texts) == 5
    prompt = unary.prompt_logprobs
    assert [p.token_id for p in prompt] == PROMPT and not prompt[0].HasField("logprob")
    for j in range(1, n):
        assert prompt[j].logprob == pytest.approx(rows[j - 1, PROMPT[j]], abs=2e-4)
        assert list(prompt[j].top_logprobs.token_ids) == np.argsort(-rows[j - 1], kind="stable")[:3].tolist()
    assert [t for m in stream for t in m.token_ids] == tokens
    assert [t for m in stream for t in m.top_logprobs] == list(unary.top_logprobs)
    assert list(stream[0].prompt_logprobs) == list(prompt) and not any(m.prompt_logprobs for m in stream[1:])


INVALID = [
    ("top_logprobs", 21, "must be in [0, 20]"),
    ("top_logprobs", 3, "needs logprobs = true"),
    ("prompt_logprobs", 21, "must be in [0, 20]"),
    ("repetition_penalty", 0.0, "finite number > 0"),
    ("repetition_penalty", float("inf"), "finite number > 0"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("presence_penalty", float("nan"), "[-2, 2]"),
    ("frequency_penalty", -2.01, "[-2, 2]"),
]


def test_each_new_field_is_validated_by_name_and_the_router_keeps_serving(worker):
    async def body():
        async with running_router(worker.address) as (router, stub):
            for field, value, message in INVALID:
                for call in (stub.Generate, stub.GenerateStream):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        reply = call(request(**{field: value}))
                        await reply if call is stub.Generate else [m async for m in reply]
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert e.value.details().startswith(f"parameters.{field}: ") and message in e.value.details()
                    assert "\n" not in e.value.details()
                assert (await stub.Generate(request(max_new_tokens=2))).generated_tokens == 2

    asyncio.run(body())


def router_model(tiny_model, tmp_path, generation_config: dict | None):
    out = tmp_path / f"router-model-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, out)
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config))
    return out


async def generate(stub, **parameters) -> list[int]:
    reply = await stub.Generate(
        rpb.GenerateRequest(
            token_ids=rpb.TokenIds(ids=PROMPT), parameters=rpb.SamplingParameters(max_new_tokens=10, **parameters)
        )
    )
    return list(reply.token_ids), reply.stop_reason


def test_generation_config_defaults_apply_to_unset_fields(worker, tiny_model, tmp_path):
    async def body():
        async with running_router(worker.address, model=str(router_model(tiny_model, tmp_path, None))) as (_, bare):
            tokens, _ = await generate(bare, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
            greedy, _ = await generate(bare, temperature=0.0, ignore_eos=True)
            explicit, _ = await generate(
                bare, seed=7, temperature=0.7, top_k=5, repetition_penalty=1.3, ignore_eos=True
            )
        stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
        config = {"eos_token_id": [EOS_ID, tokens[stop_at]], "temperature": 0.7, "top_k": 5, "repetition_penalty": 1.3}
        async with running_router(worker.address, model=str(router_model(tiny_model, tmp_path, config))) as (_, stub):
            info = await stub.ModelInfo(rpb.ModelInfoRequest())
            assert list(info.eos_token_ids) == [EOS_ID, tokens[stop_at]]
            assert dict(info.generation_config)["repetition_penalty"] == pytest.approx(1.3)
            assert await generate(stub, temperature=0.0) == (tokens[: stop_at + 1], rpb.STOP_REASON_EOS)
            assert (await generate(stub, temperature=0.0, ignore_eos=True))[0] == tokens  # the default penalty
            off, _ = await generate(stub, temperature=0.0, repetition_penalty=1.0, ignore_eos=True)
            assert off == greedy and off != tokens  # an explicit value wins
            assert (await generate(stub, seed=7, ignore_eos=True))[0] == explicit  # sampling defaults

    asyncio.run(body())
