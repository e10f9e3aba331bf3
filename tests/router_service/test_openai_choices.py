"""n, best_of and prompt lists on the OpenAI front (through the openai package and raw SSE), against the CPU
worker: choices indexed prompt-major, each equal to the single-choice answer, seeds derived per sample, usage
counting each prompt once, and siblings sharing the prompt's KV blocks through the prefix cache."""

import asyncio
import json

import aiohttp
import pytest

from tests.router_service.test_openai_http import http_router, post

pytestmark = pytest.mark.slow

PROMPT = list(range(30, 62))  # 32 tokens: 7 full blocks of 4 usable (the last token is always computed)


def test_n_and_prompt_lists_equal_single_answers_and_share_the_prompt(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            solo = await client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0)
            other = [5, 6, 7, 8, 9, 10]
            many = await client.completions.create(
                model=None, prompt=[PROMPT, other], n=3, max_tokens=4, temperature=0, logprobs=0
            )
            assert [c.index for c in many.choices] == list(range(6))
            assert {c.text for c in many.choices[:3]} == {solo.choices[0].text}  # greedy: all three equal
            alone = await client.completions.create(model=None, prompt=other, max_tokens=4, temperature=0)
            assert {c.text for c in many.choices[3:]} == {alone.choices[0].text}
            u = many.usage
            assert u.prompt_tokens == len(PROMPT) + len(other)  # each prompt counted once
            assert u.completion_tokens == sum(len(c.logprobs.tokens) for c in many.choices) == 24
            # the solo request left PROMPT's blocks cached: every sample of it started on them
            assert u.prompt_tokens_details.cached_tokens == 28
            # seeded sampling: siblings differ from each other, and the request repeats itself
            seeded = dict(model=None, prompt=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=7)
            a = await client.completions.create(**seeded)
            b = await client.completions.create(**seeded)
            assert [c.text for c in a.choices] == [c.text for c in b.choices]
            assert len({c.text for c in a.choices}) > 1
            one = await client.completions.create(**{**seeded, "n": 1})
            assert one.choices[0].text == a.choices[0].text  # sample 0 keeps the seed

            chat = await client.chat.completions.create(
                model=None, messages=[{"role": "user", "content": "hello there"}], n=2, max_tokens=3, temperature=0
            )
            assert [c.index for c in chat.choices] == [0, 1]
            assert chat.choices[0].message.content == chat.choices[1].message.content

    asyncio.run(body())


def test_best_of_ranks_by_cumulative_logprob(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            request = dict(model=None, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3)
            pool = await client.completions.create(**request, n=4, logprobs=0)
            scores = sorted((sum(c.logprobs.token_logprobs), c.text) for c in pool.choices)
            best = await client.completions.create(**request, n=2, best_of=4)
            assert [c.text for c in best.choices] == [text for _, text in scores[::-1][:2]]
            assert best.choices[0].logprobs is None  # ranked with logprobs, returned without
            assert best.usage.completion_tokens == 20  # every sample's tokens count
            async with aiohttp.ClientSession() as s:
                url = base + "/v1/completions"
                got, _, answer = await post(s, url, {"prompt": "x", "n": 3, "best_of": 2})
                assert got == 400 and answer["error"]["param"] == "best_of"
                got, _, answer = await post(s, url, {"prompt": "x", "best_of": 2, "stream": True})
                assert got == 400 and answer["error"]["param"] == "best_of"

    asyncio.run(body())


def test_streamed_choices_carry_their_index(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            payload = {
                "prompt": [PROMPT, [4, 5, 6]],
                "n": 2,
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            texts: dict[int, str] = {}
            finished, usage = set(), None
            async with aiohttp.ClientSession() as s:
                async with s.post(base + "/v1/completions", json=payload) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        for c in chunk["choices"]:
                            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                            if c["finish_reason"] is not None:
                                finished.add(c["index"])
                        usage = chunk.get("usage") or usage
            assert finished == {0, 1, 2, 3}
            unary = await client.completions.create(
                model=None, prompt=[PROMPT, [4, 5, 6]], n=2, max_tokens=4, temperature=0
            )
            assert [texts[i] for i in range(4)] == [c.text for c in unary.choices]
            assert usage["prompt_tokens"] == len(PROMPT) + 3 and usage["completion_tokens"] == 16

    asyncio.run(body())


def test_n_choices_of_a_forced_tool_call_each_carry_the_call(worker, tiny_model, tmp_path):
    """tool_choice "required" with n > 1: every sample gets the call's grammar (the samples' parameters are not
    one shared message that the first constraint would already occupy), and every choice, whole or streamed, is
    read through the tool-call parser as the single choice is."""
    tools = [{"type": "function", "function": {"name": "now"}}]
    request = dict(
        messages=[{"role": "user", "content": "time?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            single = (await client.chat.completions.create(model=None, **request)).choices[0]
            assert single.finish_reason == "tool_calls" and single.message.tool_calls[0].function.name == "now"
            want = [(c.function.name, c.function.arguments) for c in single.message.tool_calls]
            for seed in ({}, {"seed": 5}):
                answer = await client.chat.completions.create(model=None, n=2, **request, **seed)
                for c in answer.choices:
                    assert (c.finish_reason, c.message.content) == ("tool_calls", None), c
                    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == want
            calls: dict[int, list] = {0: [], 1: []}
            reasons: dict[int, list] = {0: [], 1: []}
            async with aiohttp.ClientSession() as s:
                payload = {**request, "n": 2, "stream": True}
                async with s.post(base + "/v1/chat/completions", json=payload) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if not line.startswith(b"data: {"):
                            continue
                        for c in json.loads(line[6:])["choices"]:
                            assert not c["delta"].get("content"), c  # the call is never content
                            calls[c["index"]] += c["delta"].get("tool_calls", [])
                            reasons[c["index"]] += [c["finish_reason"]] if c["finish_reason"] else []
            for index in (0, 1):
                assert reasons[index] == ["tool_calls"]
                assert [c["function"]["name"] for c in calls[index] if "id" in c] == ["now"]
                assert "".join(c["function"]["arguments"] for c in calls[index]) == want[0][1]

    asyncio.run(body())


def test_a_chat_stream_of_n_choices_opens_each_in_order(worker, tiny_model, tmp_path):
    """The OpenAI SDK's stream helper places a choice where its first chunk arrives, whatever its index: each
    choice's role chunk goes out first, in index order, so no choice's tokens can land in another's place."""

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            request = dict(model=None, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, seed=5)
            payload = {**request, "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
            del payload["model"]
            chunks = []
            async with aiohttp.ClientSession() as s:
                async with s.post(base + "/v1/chat/completions", json=payload) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            chunks.append(json.loads(line[6:]))
            opening = [(c["choices"], c["usage"]) for c in chunks[:3]]
            assert opening == [
                (
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    None,
                )
                for i in range(3)
            ]
            assert all("role" not in c["delta"] for chunk in chunks[3:] for c in chunk["choices"])
            async with client.chat.completions.stream(**request, temperature=1.0) as stream:
                async for _ in stream:
                    pass
                final = stream.current_completion_snapshot  # get_final_completion refuses a reply cut by max_tokens
            unary = await client.chat.completions.create(**request, temperature=1.0)
            assert [c.message.content for c in final.choices] == [c.message.content for c in unary.choices]
            assert [c.index for c in final.choices] == [0, 1, 2]

    asyncio.run(body())


def test_a_chat_stream_of_n_choices_sends_the_prompt_logprobs_once(worker, tiny_model, tmp_path):
    """A chat's prompt_logprobs belong to the request (top level, as in its unary answer), not to each choice."""

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            payload = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2, "prompt_logprobs": 1}
            async with aiohttp.ClientSession() as s:
                status, _, unary = await post(s, base + "/v1/chat/completions", payload)
                assert status == 200, unary
                chunks = []
                async with s.post(base + "/v1/chat/completions", json={**payload, "stream": True}) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            chunks.append(json.loads(line[6:]))
            scored = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
            # the two prompts may be scored in different chunks and batches (the scheduler's choice): their
            # scores agree to float32 rounding, not bit for bit
            assert len(scored) == 1 and len(unary["prompt_logprobs"]) > 1
            assert _without_logprobs(scored[0]) == _without_logprobs(unary["prompt_logprobs"])
            assert _logprobs(scored[0]) == pytest.approx(_logprobs(unary["prompt_logprobs"]), abs=1e-5)

    asyncio.run(body())


def _without_logprobs(prompt_logprobs: list) -> list:
    return [
        None if row is None else {k: {f: v for f, v in entry.items() if f != "logprob"} for k, entry in row.items()}
        for row in prompt_logprobs
    ]


def _logprobs(prompt_logprobs: list) -> list[float]:
    return [entry["logprob"] for row in prompt_logprobs if row is not None for entry in row.values()]
