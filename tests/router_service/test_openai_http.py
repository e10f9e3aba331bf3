"""The OpenAI-compatible HTTP front, driven by the official `openai` package against a real router and CPU worker:
its answers equal the gRPC front's, errors have OpenAI's shape and status, a disconnect frees the request."""

import asyncio
import contextlib
import json
import math
import random
import socket

import aiohttp
import pytest

from common.pb import router_pb2 as rpb
from router_service.openai_errors import ApiError
from router_service.openai_request import parse_request
from tests.helpers import LoggedProcess, free_port, running_router, serve_command, serve_env, worker_kv_blocks_used

openai = pytest.importorskip("openai", reason="the HTTP tests drive the router with the test extra's openai client")

pytestmark = pytest.mark.slow
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GREEDY = dict(max_new_tokens=8, ignore_eos=True, logprobs=True)


@contextlib.asynccontextmanager
async def http_router(worker, tiny_model, tmp_path, **overrides):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    async with running_router(
        worker.address, model=str(tiny_model), chat_template=str(template), http_port=free_port(), **overrides
    ) as (router, stub):
        base = f"http://127.0.0.1:{router.http_port}"
        client = openai.AsyncOpenAI(
            base_url=base + "/v1", api_key=overrides.get("auth_token") or "unused", max_retries=0
        )
        try:
            yield router, stub, client, base
        finally:
            await client.close()


def test_openai_client_answers_equal_the_grpc_front(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            model = (await client.models.list()).data[0].id
            assert model == "model" and (await client.models.retrieve(model)).id == model
            extra = {"ignore_eos": True}
            want = await stub.Generate(rpb.GenerateRequest(text="Hello", parameters=rpb.SamplingParameters(**GREEDY)))

            got = await client.completions.create(
                model=model, prompt="Hello", max_tokens=8, temperature=0, logprobs=0, extra_body=extra
            )
            assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
            assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == 8
            assert got.choices[0].logprobs.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-6)
            by_ids = await client.completions.create(
                model=model, prompt=[72, 101], max_tokens=4, temperature=0, extra_body=extra
            )
            ids = await stub.Generate(
                rpb.GenerateRequest(
                    token_ids=rpb.TokenIds(ids=[72, 101]),
                    parameters=rpb.SamplingParameters(max_new_tokens=4, ignore_eos=True),
                )
            )
            assert by_ids.choices[0].text == ids.text

            chunks = [
                c
                async for c in await client.completions.create(
                    model=model,
                    prompt="Hello",
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=extra,
                )
            ]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
            assert all(c.usage is None for c in chunks[:-1])
            assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"

            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é"}]
            want = await stub.Chat(
                rpb.ChatRequest(
                    messages=[rpb.ChatMessage(**m) for m in messages], parameters=rpb.SamplingParameters(**GREEDY)
                )
            )
            got = await client.chat.completions.create(
                model=model, messages=messages, max_completion_tokens=8, temperature=0, logprobs=True, extra_body=extra
            )
            assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
            assert got.usage.prompt_tokens == want.prompt_tokens and got.object == "chat.completion"
            assert [t.logprob for t in got.choices[0].logprobs.content] == pytest.approx(list(want.logprobs), abs=1e-6)
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=extra,
                )
            ]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
            assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == want.prompt_tokens + 8
            assert len({c.id for c in chunks}) == 1

            # The raw stream: SSE framing, [DONE] last.
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}
                ) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                    raw = (await r.read()).decode()
            events = raw.split("\n\n")
            assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])

    asyncio.run(body())


def test_logprobs_and_penalties_equal_the_grpc_front(worker, tiny_model, tmp_path):
    """Top log-probabilities (chat: top_logprobs; completions: logprobs = n), vLLM's prompt_logprobs and the
    penalties, through the openai package, unary and streamed, equal the gRPC front's answers."""

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            extra = {"ignore_eos": True}
            grpc_params = dict(GREEDY, temperature=0.0, top_logprobs=3, prompt_logprobs=2)
            want = await stub.Generate(
                rpb.GenerateRequest(text="Hello", parameters=rpb.SamplingParameters(**grpc_params))
            )
            got = await client.completions.create(
                model="model",
                prompt="Hello",
                max_tokens=8,
                temperature=0,
                logprobs=3,
                extra_body={**extra, "prompt_logprobs": 2},
            )
            lp = got.choices[0].logprobs
            assert lp.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-6)
            assert lp.top_logprobs == [
                pytest.approx(dict(zip(t.texts, t.logprobs)), abs=1e-6) for t in want.top_logprobs
            ]
            prompt = got.choices[0].model_extra["prompt_logprobs"]
            assert prompt[0] is None and len(prompt) == want.prompt_tokens
            for entry, p in zip(prompt[1:], want.prompt_logprobs[1:]):
                assert entry[str(p.token_id)]["logprob"] == pytest.approx(p.logprob, abs=1e-6)
                assert entry[str(p.token_id)]["decoded_token"] == p.text
                assert [entry[str(i)]["rank"] for i in p.top_logprobs.token_ids] == [1, 2]
            chunks = [
                c
                async for c in await client.completions.create(
                    model="model",
                    prompt="Hello",
                    max_tokens=8,
                    temperature=0,
                    logprobs=3,
                    stream=True,
                    extra_body=extra,
                )
            ]
            parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            assert [t for p in parts for t in p.tokens] == lp.tokens  # float sums differ by row count: approx
            assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
            assert [d for p in parts for d in p.top_logprobs] == [pytest.approx(d, abs=1e-5) for d in lp.top_logprobs]
            assert [o for p in parts for o in p.text_offset] == lp.text_offset

            messages = [{"role": "user", "content": "Hi"}]
            want = await stub.Chat(
                rpb.ChatRequest(
                    messages=[rpb.ChatMessage(**m) for m in messages],
                    parameters=rpb.SamplingParameters(**dict(GREEDY, top_logprobs=4)),
                )
            )
            got = await client.chat.completions.create(
                model="model",
                messages=messages,
                max_tokens=8,
                temperature=0,
                logprobs=True,
                top_logprobs=4,
                extra_body=extra,
            )
            content = got.choices[0].logprobs.content
            assert [[t.token for t in c.top_logprobs] for c in content] == [list(t.texts) for t in want.top_logprobs]
            for c, t in zip(content, want.top_logprobs):
                assert [x.logprob for x in c.top_logprobs] == pytest.approx(list(t.logprobs), abs=1e-6)
                # the token's own bytes (one per byte token here), which its text shows as U+FFFD past ASCII
                assert bytes(c.top_logprobs[0].bytes).decode("utf-8", "replace") == c.top_logprobs[0].token
                if t.token_ids[0] >= 3:  # the tiny model's byte b is id b + 3
                    assert c.top_logprobs[0].bytes == [t.token_ids[0] - 3]
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    model="model",
                    messages=messages,
                    max_tokens=8,
                    temperature=0,
                    logprobs=True,
                    top_logprobs=4,
                    stream=True,
                    extra_body=extra,
                )
            ]
            streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]

            penalties, prompt = (
                dict(presence_penalty=0.5, frequency_penalty=0.7),
                [40, 41, 40, 77, 105, 40, 41, 9, 200, 77, 13],
            )
            greedy = dict(max_new_tokens=12, ignore_eos=True, temperature=0.0, logprobs=True)
            want, plain = [
                await stub.Generate(
                    rpb.GenerateRequest(
                        token_ids=rpb.TokenIds(ids=prompt), parameters=rpb.SamplingParameters(**greedy, **extra_params)
                    )
                )
                for extra_params in (dict(repetition_penalty=1.4, **penalties), {})
            ]
            assert list(want.token_ids) != list(plain.token_ids)
            got = await client.completions.create(
                model="model",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                logprobs=0,
                extra_body={**extra, "repetition_penalty": 1.4},
                **penalties,
            )
            assert got.choices[0].text == want.text  # (many byte tokens decode alike: the logprobs tell them apart)
            assert got.choices[0].logprobs.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-5)

    asyncio.run(body())


async def post(session, url, payload, headers=None):
    data = payload if isinstance(payload, (bytes, str)) else json.dumps(payload)
    async with session.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, dict(r.headers), await r.json()


def test_errors_have_openai_shape_and_the_server_keeps_serving(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path, max_concurrent_requests=1, auth_token="sesame") as (
            router,
            stub,
            client,
            base,
        ):
            auth = {"Authorization": "Bearer sesame"}
            chat, comp = base + "/v1/chat/completions", base + "/v1/completions"
            async with aiohttp.ClientSession() as s:
                cases = [
                    (chat, b"{not json", 400, None, None),
                    (chat, {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n", None),
                    (chat, {"max_tokens": 3}, 400, "messages", None),
                    (
                        chat,
                        {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
                        400,
                        "temperature",
                        None,
                    ),
                    (
                        chat,
                        {"messages": [{"role": "user", "content": "x" * 3000}]},
                        400,
                        "messages",
                        "context_length_exceeded",
                    ),
                    (comp, {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", None),
                    (comp, {"prompt": "x", "stop": ["a", ""]}, 400, "stop[1]", None),
                    (comp, {"prompt": ["a", 5]}, 400, "prompt[1]", None),
                    (comp, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
                    (comp, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", None),
                    (comp, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", None),
                    (comp, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
                    (comp, {"prompt": "x", "frequency_penalty": 10**400}, 400, "frequency_penalty", None),
                    (
                        chat,
                        {"messages": [{"role": "user", "content": "x"}], "temperature": -(10**400)},
                        400,
                        "temperature",
                        None,
                    ),
                    (comp, {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
                    (comp, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
                    (
                        chat,
                        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                        400,
                        "top_logprobs",
                        None,
                    ),
                    (
                        chat,
                        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
                        400,
                        "top_logprobs",
                        None,
                    ),
                ]
                for url, payload, status, param, code in cases:
                    got, headers, answer = await post(s, url, payload, auth)
                    assert got == status, (payload, answer)
                    error = answer["error"]
                    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, answer
                    assert error["code"] == code and error["type"] == "invalid_request_error", answer
                got, headers, answer = await post(s, comp, {"prompt": "x"})
                assert got == 401 and answer["error"]["code"] == "invalid_api_key"
                assert headers["WWW-Authenticate"] == "Bearer"
                async with s.get(base + "/health") as r:  # probes carry no token
                    assert r.status == 200 and (await r.json()) == {"status": "ok"}
                async with s.get(base + "/v1/nowhere", headers=auth) as r:
                    assert r.status == 404 and "error" in await r.json()
                async with s.get(base + "/v1/completions", headers=auth) as r:
                    assert r.status == 405 and "error" in await r.json()

                # Full: the second request gets 429 with Retry-After while the first one streams.
                async with s.post(
                    comp, json={"prompt": "x", "max_tokens": 2000, "stream": True, "ignore_eos": True}, headers=auth
                ) as first:
                    await first.content.readline()
                    got, headers, answer = await post(s, comp, {"prompt": "x"}, auth)
                    assert got == 429 and headers["Retry-After"] == "1", answer
                    assert answer["error"]["type"] == "rate_limit_error"

            with pytest.raises(openai.BadRequestError) as e:  # the openai package reads the shape too
                await client.chat.completions.create(model="model", messages=[], max_tokens=2)
            assert e.value.status_code == 400 and e.value.param == "messages"
            ok = await client.chat.completions.create(
                model="model", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            assert ok.usage.completion_tokens <= 2  # still serving

    asyncio.run(body())


def test_disconnect_cancels_the_request(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            for stream in (True, False):
                async with aiohttp.ClientSession() as s:
                    payload = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": stream}
                    call = asyncio.ensure_future(s.post(base + "/v1/completions", json=payload))
                    if stream:
                        await (await call).content.readline()
                    for _ in range(300):
                        if router.batching_loop.num_active:
                            break
                        await asyncio.sleep(0.01)
                    assert router.batching_loop.num_active == 1
                    if stream:
                        call.result().close()
                    else:
                        call.cancel()  # gives up waiting: the connection closes
                        await asyncio.gather(call, return_exceptions=True)
                for _ in range(300):
                    if router.batching_loop.num_active == 0:
                        break
                    await asyncio.sleep(0.01)
                assert router.batching_loop.num_active == 0
                for _ in range(500):  # the free rides the router's next step: a loaded box takes a while
                    if (used := await worker_kv_blocks_used(router.worker)) == 0:
                        break
                    await asyncio.sleep(0.02)
                assert used == 0

    asyncio.run(body())


def test_parse_request_converts_openai_fields():
    parsed = parse_request({"prompt": "x", "top_k": -1, "seed": -1, "stop": "END", "logprobs": 0}, "completion", "m")
    p = parsed.parameters
    assert (p.top_k, p.seed, list(p.stop_sequences), p.max_new_tokens, p.logprobs) == (0, 2**64 - 1, ["END"], 16, True)
    assert p.temperature == 1.0 and p.top_p == 0.0 and not p.HasField("repetition_penalty")  # 0 = off / the default
    assert not p.HasField("prompt_logprobs") and p.top_logprobs == 0
    assert (
        parse_request({"prompt": "x", "truncate_prompt_tokens": 5}, "completion", "m").parameters.truncate_input_tokens
        == 5
    )
    chat = parse_request(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5, "continue_final_message": True},
        "chat",
        "m",
    )
    assert chat.parameters.max_new_tokens == 5 and chat.max_tokens_name == "max_completion_tokens"
    assert chat.chat_options.continue_final_message and not chat.chat_options.add_generation_prompt
    for body, param in [
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "stream_options": {}}, "stream_options"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "presence_penalty": "a"}, "presence_penalty"),
    ] + [
        # integers past float range (JSON allows any digits): 400, not a crash in float()
        ({"prompt": "x", name: sign * 10**400}, name)
        for sign in (1, -1)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    ]:
        with pytest.raises(ApiError) as e:
            parse_request(body, "completion", "m")
        assert e.value.status == 400 and e.value.param == param


def test_parse_request_keeps_tiny_positive_numbers_positive():
    """A positive JSON number below float32's range is not flushed to 0, which means "off" or "the model's
    default" (top_p 1e-50 must not sample the whole vocabulary; a tiny repetition_penalty is not 0)."""
    rng = random.Random()
    for name in ("top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "temperature"):
        for sign in (1, -1):
            value = sign * 10.0 ** -rng.uniform(46, 300)
            p = parse_request({"prompt": "x", name: value}, "completion", "m").parameters
            assert getattr(p, name) != 0 and math.copysign(1, getattr(p, name)) == sign, (name, value)


def test_parse_request_leaves_model_defaults_to_the_router():
    """With generation_config.json defaults, a field left out stays unset (the router fills the model's value);
    given fields win, and top_k -1 turns a default top_k off."""
    from router_service.generation_defaults import GenerationDefaults

    defaults = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
    p = parse_request({"prompt": "x"}, "completion", "m", defaults, vocab_size=259).parameters
    assert not p.HasField("temperature") and p.top_p == 0 and p.top_k == 0 and not p.HasField("repetition_penalty")
    p = parse_request(
        {"prompt": "x", "temperature": 0, "top_k": -1, "repetition_penalty": 1.0, "top_p": 0.5},
        "completion",
        "m",
        defaults,
        vocab_size=259,
    ).parameters
    assert p.HasField("temperature") and p.temperature == 0 and p.top_k == 259 and p.repetition_penalty == 1.0
    chat = parse_request(
        {
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 3,
            "prompt_logprobs": 2,
            "presence_penalty": -1.5,
            "frequency_penalty": 0.25,
        },
        "chat",
        "m",
    )
    p = chat.parameters
    assert (p.logprobs, p.top_logprobs, p.prompt_logprobs, p.presence_penalty, p.frequency_penalty) == (
        True,
        3,
        2,
        -1.5,
        0.25,
    ) and chat.prompt_logprobs
    comp = parse_request({"prompt": "x", "logprobs": 5}, "completion", "m")
    assert comp.logprobs and comp.parameters.top_logprobs == 5


def test_a_taken_http_port_is_address_in_use():
    from common.errors import AddressInUseError
    from router_service.config import RouterConfig
    from router_service.main import start_router

    async def body():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            config = RouterConfig(host="127.0.0.1", port=0, metrics_port=0, http_port=taken.getsockname()[1])
            with pytest.raises(AddressInUseError, match="router HTTP 127.0.0.1:"):
                await start_router(config, "127.0.0.1:1")

    asyncio.run(body())


def test_colibri_serve_with_http_port(tiny_model, tmp_path):
    """The real processes: `colibri serve --http-port`, driven by the synchronous openai client."""
    import subprocess
    import time
    import urllib.error
    import urllib.request

    import grpc

    from common.pb import router_pb2_grpc

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    port, http = free_port(), free_port()
    env = serve_env()
    serve = LoggedProcess(
        serve_command(
            str(tiny_model),
            str(port),
            "--http-port",
            str(http),
            "--chat-template",
            str(template),
            "--worker-retry-s",
            "0.1",
        ),
        env,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline and serve.poll() is None, (
                f"colibri serve never became healthy: {serve.log()}"
            )
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Hello"}]
        whole = client.chat.completions.create(
            model="model", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        pieces = client.chat.completions.create(
            model="model", messages=messages, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(c.choices[0].delta.content or "" for c in pieces) == whole.choices[0].message.content
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            chat = router_pb2_grpc.GenerationServiceStub(channel).Chat(
                rpb.ChatRequest(
                    messages=[rpb.ChatMessage(**m) for m in messages],
                    parameters=rpb.SamplingParameters(max_new_tokens=6, ignore_eos=True),
                ),
                timeout=30,
            )
        assert chat.text == whole.choices[0].message.content
    finally:
        serve.send_signal(2)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
