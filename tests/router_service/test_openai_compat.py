"""What real OpenAI clients send and expect, beyond the field table (test_openai_strict.py): the official `openai`
package's own objects sent back in a conversation, and values OpenAI's API accepts that mean something specific."""

import asyncio
import json

import aiohttp
import httpx
import pydantic
import pytest

from common.pb import router_pb2 as rpb
from router_service.chat import message_dicts
from router_service.logprobs import TokenTexts
from router_service.openai_errors import ApiError
from router_service.openai_request import parse_request
from router_service.openai_response import logprobs_field
from router_service.tokenizer import Tokenizer
from tests.helpers import byte_ids
from tests.router_service.test_http_errors import AUTH, http_harness
from tests.router_service.test_openai_http import http_router

openai = pytest.importorskip("openai", reason="the compatibility tests use the test extra's openai client")

CALL = {"id": "call_1", "type": "function", "function": {"name": "flag", "arguments": '{"ok": true}'}}
REPLY = {"role": "assistant", "content": None, "tool_calls": [CALL]}


class Flag(pydantic.BaseModel):
    ok: bool


def completion(message: dict, finish: str = "tool_calls") -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
    }


def stream_body(message: dict) -> bytes:
    """`message` as a stream: the role, then each call as OpenAI streams it (header, then the arguments)."""
    chunks = [{"role": "assistant", "content": ""}]
    for i, call in enumerate(message.get("tool_calls", [])):
        head = {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
        head["function"]["arguments"] = ""
        arguments = {"arguments": call["function"]["arguments"]}
        chunks += [{"tool_calls": [head]}, {"tool_calls": [{"index": i, "function": arguments}]}]
    events = []
    for n, delta in enumerate(chunks):
        finish = "tool_calls" if n == len(chunks) - 1 else None
        chunk = completion(message) | {"object": "chat.completion.chunk"}
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        events.append(f"data: {json.dumps(chunk)}\n\n")
    return ("".join(events) + "data: [DONE]\n\n").encode()


class Server:
    """A stand-in for the router that answers with `message` and keeps the bodies the client sent."""

    def __init__(self, message: dict):
        self.message, self.bodies = message, []
        transport = httpx.MockTransport(self.answer)
        self.client = openai.OpenAI(
            base_url="http://router/v1", api_key="x", max_retries=0, http_client=httpx.Client(transport=transport)
        )

    def answer(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if body.get("stream"):
            return httpx.Response(200, content=stream_body(self.message), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=completion(self.message))

    def sent_back(self, message) -> dict:
        """The body the client sends for a conversation that holds its own earlier reply `message`."""
        self.client.chat.completions.create(
            model="m",
            messages=[
                {"role": "user", "content": "x"},
                message,
                {"role": "tool", "tool_call_id": "call_1", "content": "1"},
            ],
        )
        return self.bodies[-1]


def accepted(body: dict) -> list[dict]:
    """What the router makes of a chat body: parsed, then its messages as the template gets them."""
    return message_dicts(parse_request(body, "chat", "m").messages)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the client's own serializer, on its `parsed` field
def test_the_openai_clients_parsed_replies_can_be_sent_back():
    """`chat.completions.parse` and the stream helper return messages that carry the client's own parse (`parsed`,
    a call's `parsed_arguments`) and, streamed, each call's `index`; the client sends them back as they are when a
    conversation appends the message. They repeat what the message holds, so the template gets the same turn."""
    server = Server(REPLY)
    tools = [openai.pydantic_function_tool(Flag, name="flag")]
    messages = [{"role": "user", "content": "x"}]
    parsed = server.client.chat.completions.parse(model="m", messages=messages, tools=tools).choices[0].message
    assert parsed.tool_calls[0].function.parsed_arguments == Flag(ok=True)
    with server.client.chat.completions.stream(model="m", messages=messages, tools=tools) as stream:
        streamed = stream.get_final_completion().choices[0].message
    plain = server.client.chat.completions.create(model="m", messages=messages).choices[0].message
    want = accepted(server.sent_back(plain))
    assert want[1]["tool_calls"][0]["function"] == {"name": "flag", "arguments": {"ok": True}}
    for message in (parsed, streamed, streamed.model_dump(exclude_none=True)):
        assert accepted(server.sent_back(message)) == want

    server.message = {"role": "assistant", "content": '{"ok": true}'}
    reply = server.client.chat.completions.parse(model="m", messages=messages, response_format=Flag).choices[0].message
    assert reply.parsed == Flag(ok=True)
    assert accepted(server.sent_back(reply))[1] == {"role": "assistant", "content": '{"ok": true}'}


@pytest.mark.parametrize("kind, base", [("completion", {"prompt": "x"}), ("chat", {"messages": [{"role": "user"}]})])
def test_top_p_0_keeps_the_most_likely_token_alone(kind, base):
    """OpenAI takes top_p in [0, 1]: 0 is a nucleus of the most likely token, never the router's "unset" (which would
    sample the whole vocabulary); null or left out is still unset (the model's default, else off)."""
    for zero in (0, 0.0, -0.0):
        top_p = parse_request(base | {"top_p": zero}, kind, "m").parameters.top_p
        assert 0 < top_p < 1e-30, zero
    assert parse_request(base | {"top_p": None}, kind, "m").parameters.top_p == 0
    assert parse_request(base, kind, "m").parameters.top_p == 0


@pytest.mark.parametrize("temperature", [1e-6, 0.001, 0.0099])
def test_a_temperature_below_the_routers_least_is_raised_to_it_as_vllm_does(temperature):
    """OpenAI and vLLM accept any temperature > 0 (vLLM raises one below 0.01 to 0.01, where a float32 softmax
    still holds); the router refuses those on gRPC, so the HTTP front raises them as vLLM does rather than 400."""
    p = parse_request({"prompt": "x", "temperature": temperature}, "completion", "m").parameters
    assert p.temperature == pytest.approx(0.01)
    assert parse_request({"prompt": "x", "temperature": 0}, "completion", "m").parameters.temperature == 0


@pytest.mark.slow
def test_ids_have_openai_prefixes(worker, tiny_model, tmp_path):
    """A chat completion's id is `chatcmpl-...`, a completion's `cmpl-...` (OpenAI's and vLLM's prefixes), streamed or
    not; the X-Request-Id header, when sent, is the id instead."""

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            chat = dict(model="model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert (await client.chat.completions.create(**chat)).id.startswith("chatcmpl-")
            assert (await client.chat.completions.create(**chat, n=2)).id.startswith("chatcmpl-")
            chunks = [c async for c in await client.chat.completions.create(**chat, n=2, stream=True)]
            assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
            completion = await client.completions.create(model="model", prompt="Hi", max_tokens=2)
            assert completion.id.startswith("cmpl-")
            mine = await client.chat.completions.create(**chat, extra_headers={"X-Request-Id": "mine-1"})
            assert mine.id == "mine-1"

    asyncio.run(body())


@pytest.mark.slow
def test_streams_of_several_choices_send_no_empty_chunks(worker, tiny_model, tmp_path):
    """A token that adds no text yet (the first bytes of a character) makes no chunk of its own with n > 1, as with
    one choice: each chunk carries text, the chat's role, a finish reason or log-probabilities; the text adds up."""

    def empty(chunk, kind: str) -> bool:
        c = chunk.choices[0]
        if kind == "completion":
            return not c.text and c.finish_reason is None and c.logprobs is None
        return not (c.delta.content or c.delta.role or c.delta.tool_calls) and c.finish_reason is None

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            common = dict(model="model", max_tokens=24, n=4, seed=7, temperature=1.5, stream=True)
            messages = [{"role": "user", "content": "Hi"}]
            for kind, stream in [
                ("chat", await client.chat.completions.create(messages=messages, **common)),
                ("completion", await client.completions.create(prompt="Hi", **common)),
            ]:
                chunks = [c async for c in stream]
                assert not [c for c in chunks if empty(c, kind)], kind
                assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2, 3]

    asyncio.run(body())


def test_chat_logprobs_bytes_are_each_tokens_own_bytes(tiny_model):
    """OpenAI's `bytes` are a token's UTF-8 bytes, which add up to the text where a character spans tokens; a
    byte-level token that is part of a character has no text of its own (U+FFFD), but its bytes are its own."""
    tokenizer = Tokenizer.from_model_dir(tiny_model)
    ids = tokenizer.encode("é世😀 ok", add_special_tokens=False)
    assert len(ids) > 5  # the characters span tokens
    texts = TokenTexts(tokenizer)
    top = [[(i, -1.0)] for i in ids]
    content = logprobs_field("chat", texts, ids, [-1.0] * len(ids), top)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == "é世😀 ok"
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]
    assert content[0]["token"] == "\ufffd"  # the token's own text, as before (vLLM's too)


def test_token_bytes_of_a_sentencepiece_byte_fallback_tokenizer():
    """Mixtral's kind of tokenizer: `<0xNN>` tokens are one byte each, `▁` is a space (kept at a token's start,
    where decoding one token alone strips it), special tokens are their text."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁": 4, "▁ok": 5, "o": 6, "k": 7}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens([AddedToken("<s>", special=True)])
    tokenizer = Tokenizer(hf)
    ids = tokenizer.encode("é ok", add_special_tokens=False)
    assert [tokenizer.token_bytes(i) for i in ids] == [b" ", b"\xc3", b"\xa9", b" ", b"o", b"k"]
    assert tokenizer.token_bytes(5) == b" ok" and tokenizer.token_bytes(1) == b"<s>"


@pytest.mark.slow
def test_chat_logprobs_bytes_add_up_to_the_content(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            reply = await client.chat.completions.create(
                model="model",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=32,
                temperature=1.5,
                seed=3,
                logprobs=True,
                logit_bias={str(i): -100 for i in range(3)},  # no special tokens, which the content leaves out
                extra_body={"ignore_eos": True},
            )
            choice = reply.choices[0]
            joined = b"".join(bytes(c.bytes) for c in choice.logprobs.content)
            assert any(byte > 127 for byte in joined)  # characters of several bytes, or bytes of none
            assert joined.decode(errors="replace") == choice.message.content

    asyncio.run(body())


@pytest.mark.slow
def test_echo_returns_the_prompt_and_its_scores_as_lm_eval_reads_them(worker, tiny_model, tmp_path):
    """lm-evaluation-harness scores a continuation with echo, logprobs 1 and max_tokens 1 on token-id prompts, and
    reads token_logprobs[ctxlen:-1]: the prompt's tokens come first, scored as the gRPC front scores them."""

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            prompts = [[72, 105, 33, 40], [70, 80, 90]]
            scoring = dict(model="model", prompt=prompts, max_tokens=1, logprobs=1, temperature=0, echo=True)
            got = await client.completions.create(**scoring)
            for prompt, c in zip(prompts, got.choices):
                want = await stub.Generate(
                    rpb.GenerateRequest(
                        token_ids=rpb.TokenIds(ids=prompt),
                        parameters=rpb.SamplingParameters(
                            max_new_tokens=1, temperature=0, logprobs=True, prompt_logprobs=1
                        ),
                    )
                )
                lp = c.logprobs
                assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
                scores = [p.logprob for p in want.prompt_logprobs[1:]] + list(want.logprobs)
                assert lp.token_logprobs[1:] == pytest.approx(scores, abs=1e-6)
                assert all(len(top) == 1 for top in lp.top_logprobs[1:])
                assert (
                    c.text
                    == (await stub.Detokenize(rpb.DetokenizeRequest(token_ids=prompt, skip_special_tokens=True))).text
                    + want.text
                )
            text = await client.completions.create(
                model="model", prompt="Hello", max_tokens=3, temperature=0, echo=True
            )
            streamed = await client.completions.create(
                model="model", prompt="Hello", max_tokens=3, temperature=0, echo=True, stream=True
            )
            chunks = [c.choices[0].text async for c in streamed]
            assert chunks[0].startswith("Hello") and "".join(chunks) == text.choices[0].text

    asyncio.run(body())


async def echoed(base: str, request: dict) -> tuple[dict, str]:
    """The unary answer's first choice and the streamed text of the same request."""
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.post(base + "/v1/completions", json=request) as r:
            whole = await r.json()
            assert r.status == 200, whole
        async with s.post(base + "/v1/completions", json={**request, "stream": True}) as r:
            events = [line[6:] for line in (await r.text()).split("\n\n") if line.startswith("data: {")]
    return whole["choices"][0], "".join(json.loads(e)["choices"][0]["text"] for e in events)


def test_echo_of_a_truncated_prompt_is_what_the_model_saw(tmp_path):
    """truncate_prompt_tokens keeps the prompt's last tokens: the echo starts with those (decoded), not with the text
    as sent, whose cut part the model never saw and the echoed logprobs do not score."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for prompt in ("abcdefgh", byte_ids("abcdefgh")):
                request = {"prompt": prompt, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 2}
                choice, streamed = await echoed(base, request)
                assert choice["text"] == streamed == "ghi", (prompt, choice, streamed)
                whole, _ = await echoed(base, {**request, "truncate_prompt_tokens": 8})  # nothing cut
                assert whole["text"] == "abcdefghi"

    asyncio.run(body())


def test_echo_of_a_prompt_truncate_prompt_tokens_did_not_cut_is_the_text_as_sent(tmp_path):
    """A truncate_prompt_tokens above the prompt's length (a guard set on every request) cuts nothing: the echo is
    the prompt as sent, not its tokens decoded, which drops a special token's text."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            request = {"prompt": "a</s>b", "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 8}
            choice, streamed = await echoed(base, request)
            assert choice["text"].startswith("a</s>b") and streamed == choice["text"], (choice, streamed)

    asyncio.run(body())


def test_echo_of_a_prompt_exactly_truncate_prompt_tokens_long_is_the_text_as_sent(tmp_path):
    """A prompt of exactly truncate_prompt_tokens tokens is not cut: every choice, unary or streamed, echoes it as
    sent, not its tokens decoded ("a</s>b" is 3 tokens, decoded "ab": a special token's text is left out)."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            request = {"prompt": "a</s>b", "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 3, "n": 2}
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + "/v1/completions", json=request) as r:
                    whole = await r.json()
                    assert r.status == 200, whole
                async with s.post(base + "/v1/completions", json={**request, "stream": True}) as r:
                    events = [json.loads(e[6:]) for e in (await r.text()).split("\n\n") if e.startswith("data: {")]
            streamed = ["", ""]
            for event in events:
                for c in event["choices"]:
                    streamed[c["index"]] += c["text"]
            texts = [c["text"] for c in whole["choices"]]
            assert len(texts) == 2 and all(t.startswith("a</s>b") for t in texts + streamed), (texts, streamed)

    asyncio.run(body())


@pytest.mark.slow
def test_echoed_logprobs_of_a_truncated_prompt_line_up_with_its_text(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            request = dict(model="model", prompt="abcdefgh", max_tokens=1, logprobs=1, temperature=0, echo=True)
            got = (await client.completions.create(**request, extra_body={"truncate_prompt_tokens": 2})).choices[0]
            lp = got.logprobs
            assert got.text.startswith("gh") and "".join(lp.tokens) == got.text, got
            assert lp.text_offset == [0, 1, 2] and lp.token_logprobs[0] is None

    asyncio.run(body())


def test_max_completion_tokens_wins_over_max_tokens_which_is_still_checked():
    """Both sent (a client migrating from the deprecated name): max_completion_tokens is the limit, as in vLLM; a
    max_tokens that is no valid count is still a 400 naming it, never dropped unread."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 4}
    assert parse_request(body, "chat", "m").parameters.max_new_tokens == 4
    for bad in ("5", 0, -1, 2.5):
        with pytest.raises(ApiError) as e:
            parse_request(body | {"max_tokens": bad}, "chat", "m")
        assert e.value.param == "max_tokens", bad
