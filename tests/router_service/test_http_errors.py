"""The HTTP front's answers to client mistakes: OpenAI-shaped 4xx errors naming what is wrong, never a 500, nothing
logged at ERROR, the requests metric counting them (against the fake worker, with the real metrics hooks).

Also the helpers the other test_http_* files share: `http_harness` (router + fake worker + HTTP port + metrics)
and `raw_exchange` (bytes on a socket, for what an HTTP client library would refuse to send)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
import grpc
import pytest

from common.errors import InvalidRequestError
from expert_service.tools.tiny_model import byte_tokenizer
from router_service import http_api
from router_service.errors import MAX_FIELD
from router_service.observability import router_metrics
from router_service.openai_errors import api_error
from router_service.tokenizer import Tokenizer
from tests.helpers import free_port, worth_reporting
from tests.router_service.fake_worker import FakeWorker, harness, wait_for

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
AUTH = {"Authorization": "Bearer sesame"}
AUTH_LINE = b"Authorization: Bearer sesame\r\n"


@contextlib.asynccontextmanager
async def http_harness(tmp_path, fake=None, template_source: str = TEMPLATE, **overrides):
    """Yields (router, fake worker, base URL, metrics hooks): the router with a chat template, bearer token
    `sesame` and the real metrics hooks, its HTTP port on loopback."""
    template = tmp_path / "chat.jinja"
    template.write_text(template_source)
    hooks, _ = router_metrics("fake", -1)
    settings = dict(
        http_port=free_port(),
        chat_template=str(template),
        auth_token="sesame",
        max_new_tokens=64,
        default_max_new_tokens=8,
    )
    async with harness(fake, tokenizer=Tokenizer(byte_tokenizer()), hooks=hooks, **{**settings, **overrides}) as (
        router,
        fake,
        _,
        _,
    ):
        yield router, fake, f"http://127.0.0.1:{router.http_port}", hooks


async def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Sends `data` on a fresh connection and reads until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def post_bytes(path: str, body: bytes, headers: bytes = b"") -> bytes:
    return (
        b"POST "
        + path.encode()
        + b" HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + headers
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        + body
    )


def status_and_body(raw: bytes) -> tuple[int, dict | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def problems(caplog) -> list[str]:
    """Log records a client may not cause: ERROR or worse, or any traceback (tests.helpers.worth_reporting)."""
    return [f"{r.levelname} {r.name}: {r.getMessage()[:200]}" for r in caplog.records if worth_reporting(r)]


def rejected(hooks, outcome: str) -> float:
    return hooks.m.requests.labels(outcome=outcome)._value.get()


def assert_openai_error(answer, status: int, got: int, param=None, code=None) -> None:
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, answer
    assert error["param"] == param and error["code"] == code, answer
    assert error["type"] == "invalid_request_error", answer
    assert "\n" not in error["message"] and "Error" not in error["message"], answer


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# (path, raw JSON body, status, param, code): lone surrogates arrive as JSON \u escapes.
CLIENT_MISTAKES = [
    (COMPLETIONS, b'{"prompt": "x", "model": "gpt-4"}', 404, "model", "model_not_found"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": "other"}', 404, "model", "model_not_found"),
    (COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, "prompt", None),
    (COMPLETIONS, b'{"prompt": "ab", "stop": ["x", "\\udfff"]}', 400, "stop", None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages", None),
    (CHAT, b'{"messages": [{"role": "bogus", "content": "x"}]}', 400, "messages[0].role", None),
    (CHAT, b'{"messages": [{"role": "tool", "content": "1"}]}', 400, "messages[0].tool_call_id", None),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
        400,
        "messages",
        None,
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"\\ud800": 1}}',
        400,
        "chat_template_kwargs",
        None,
    ),
    # raw surrogate bytes (json.loads decodes bytes with surrogatepass), and the same in a UTF-16 body
    (COMPLETIONS, b'{"prompt": "a\xed\xa0\x80b"}', 400, None, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xed\xb0\x80"}]}', 400, None, None),
    (COMPLETIONS, '{"prompt": "a'.encode("utf-16-le") + b"\x00\xd8" + 'b"}'.encode("utf-16-le"), 400, None, None),
    (COMPLETIONS, '{"prompt": "a\\ud800b"}'.encode("utf-16-le"), 400, "prompt", None),
    (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, None, None),  # past the parser's recursion limit
    # a key past int()'s 4,300 digits (named cut: test_a_hostile_name_or_value_is_not_echoed_whole)
    (
        COMPLETIONS,
        b'{"prompt": "x", "logit_bias": {"' + b"9" * 5000 + b'": 1}}',
        400,
        "logit_bias[" + "9" * (MAX_FIELD - len("logit_bias[")) + "...",
        None,
    ),
    (COMPLETIONS, b'{"prompt": "x", "user": ' + b"[" * 200 + b"]" * 200 + b"}", 400, "user", None),
    # unknown keys of a content part, as of a message (another API's prompt-caching hint, a misspelt key)
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}]}',
        400,
        "messages[0].content[0].cache_control",
        None,
    ),
    (
        CHAT,
        b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", '
        b'"text": "x"}, {"type": "text", "txt": "y", "text": "z"}]}]}',
        400,
        "messages[1].content[1].txt",
        None,
    ),
]


def test_client_mistakes_are_openai_4xx_errors_without_an_error_log(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path, max_message_bytes=1 << 20) as (router, fake, base, hooks):
            before = rejected(hooks, "invalid_argument")
            for path, raw, status, param, code in CLIENT_MISTAKES:
                got, answer = status_and_body(
                    await raw_exchange(router.http_port, post_bytes(path, raw, b"Authorization: Bearer sesame\r\n"))
                )
                assert_openai_error(answer, status, got, param, code)
                assert not problems(caplog), (raw[:80], problems(caplog))
            assert rejected(hooks, "invalid_argument") == before + len(CLIENT_MISTAKES)
            # A pair of surrogates is one character: fine.
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + COMPLETIONS, data=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}') as r:
                    assert r.status == 200, await r.text()
                # JSON may come as UTF-16 (as json.loads reads it)
                utf16 = '{"prompt": "\U0001f600", "max_tokens": 2}'.encode("utf-16")
                async with s.post(base + COMPLETIONS, data=utf16) as r:
                    assert r.status == 200, await r.text()

    asyncio.run(body())


# What no JSON reader but Python's takes (a schema holding one reached the grammar engine), and an integer past
# Python's digit limit (whose own error told the client to call sys.set_int_max_str_digits): the body is not JSON.
NOT_JSON = [
    (COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "n", "schema": {"type": "number", "maximum": -Infinity}}}}',
        "-Infinity is not a JSON number",
    ),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "an integer has more than 4300 digits"),
]


def test_what_only_python_reads_as_json_is_not_json(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path) as (router, _, _, _):
            for path, raw, said in NOT_JSON:
                got, answer = status_and_body(
                    await raw_exchange(router.http_port, post_bytes(path, raw, b"Authorization: Bearer sesame\r\n"))
                )
                assert_openai_error(answer, 400, got)
                assert answer["error"]["message"] == f"the body is not valid JSON: {said}", answer
        assert not problems(caplog)

    asyncio.run(body())


@pytest.mark.parametrize(
    "request_body, param",
    [
        ({"prompt": "x", "n": 5}, "n"),
        ({"prompt": "x", "best_of": 5}, "best_of"),
        ({"prompt": ["a", "b", "c"], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
    ],
    ids=["n", "best_of", "prompt-list", "chat"],
)
def test_more_choices_than_the_router_admits_at_once_is_400_not_429(tmp_path, caplog, request_body, param):
    """Each choice is a request of its own: past max_concurrent_requests they could never be admitted together, so
    a 429 (which clients retry) would be refused forever, even on an idle server."""

    async def body():
        async with http_harness(tmp_path, max_concurrent_requests=4) as (router, fake, base, hooks):
            path = CHAT if "messages" in request_body else COMPLETIONS
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + path, json={**request_body, "max_tokens": 2}) as r:
                    answer = await r.json()
                    assert_openai_error(answer, 400, r.status, param)
                    assert "max_concurrent_requests (4)" in answer["error"]["message"], answer
                async with s.post(base + path, json={**request_body, "n": 1, "best_of": None, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
            assert not problems(caplog)

    asyncio.run(body())


TEXT_MESSAGES = [{"role": "user", "content": "x"}]
BIG_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "description": "d" * 100} for i in range(800)},
}
BIG_TOOL = {"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}


@pytest.mark.parametrize(
    "path, request_body, param, said",
    [
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens", "<= max_tokens (2)"),
        (
            CHAT,
            {"messages": TEXT_MESSAGES, "max_completion_tokens": 2, "min_tokens": 5},
            "min_tokens",
            "<= max_completion_tokens (2)",
        ),
        (COMPLETIONS, {"prompt": "x" * 10, "max_tokens": 1600}, "max_tokens", "+ max_tokens (1600) must be <="),
        (
            CHAT,
            {"messages": TEXT_MESSAGES, "max_completion_tokens": 1600},
            "max_completion_tokens",
            "+ max_completion_tokens (1600) must be <=",
        ),
        (COMPLETIONS, {"prompt": "x" * 1100}, "prompt", "prompt + max_tokens must be <="),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x" * 1100}], "max_completion_tokens": 2},
            "messages",
            "prompt + max_completion_tokens must be <=",
        ),
        (CHAT, {"messages": TEXT_MESSAGES, "tools": [BIG_TOOL], "tool_choice": "required"}, "tools", "65536 bytes"),
        (
            CHAT,
            {
                "messages": TEXT_MESSAGES,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_SCHEMA}},
            },
            "response_format.json_schema.schema",
            "65536 bytes",
        ),
        (COMPLETIONS, {"prompt": "x", "guided_json": BIG_SCHEMA}, "guided_json", "65536 bytes"),
        (COMPLETIONS, {"prompt": "x", "guided_choice": ["a", "b" * 70_000]}, "guided_choice", "65536 bytes"),
        # which prompt of a list, and which token of it
        (COMPLETIONS, {"prompt": [5, 999_999]}, "prompt[1]", "token id must be in [0, "),
        (COMPLETIONS, {"prompt": [[1, 2], [3, 4], [5, 999_999]]}, "prompt[2][1]", "got 999999"),
        (COMPLETIONS, {"prompt": [[5, 999_999]]}, "prompt[0][1]", "got 999999"),
        (COMPLETIONS, {"prompt": [[1], [2, -1]]}, "prompt[1][1]", "must be non-negative"),
        (COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt[1]", "must not be empty"),
        (COMPLETIONS, {"prompt": ["a", "b", ""]}, "prompt[2]", "must not be empty"),
        (COMPLETIONS, {"prompt": ["a", "x" * 1100]}, "prompt[1]", "1100 tokens leave no room"),
    ],
    ids=[
        "min_tokens",
        "min_tokens-chat",
        "max_tokens-room",
        "max_completion_tokens-room",
        "prompt-room",
        "messages-room",
        "tools-size",
        "response_format-size",
        "guided_json-size",
        "guided_choice-size",
        "token-id",
        "prompt-list-token-id",
        "prompt-list-of-one",
        "prompt-list-negative-id",
        "prompt-list-empty",
        "prompt-list-empty-text",
        "prompt-list-room",
    ],
)
def test_a_400_names_the_fields_the_client_sent(tmp_path, caplog, path, request_body, param, said):
    """The router's validation speaks of its own fields (max_new_tokens, a constraint's grammar string); an OpenAI
    client sent max_tokens or max_completion_tokens, and objects where the router holds JSON text."""

    async def body():
        async with http_harness(tmp_path, max_new_tokens=4096) as (router, fake, base, hooks):
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + path, json=request_body) as r:
                    answer = await r.json()
            assert r.status == 400 and answer["error"]["param"] == param, answer
            message = answer["error"]["message"]
            assert message.startswith(param + ": ") and said in message, message
            assert not any(name in message for name in ("max_new_tokens", "min_new_tokens", "a string of")), message
            assert not problems(caplog)

    asyncio.run(body())


LONG = "z" * 100_000
HOSTILE_ECHOES = [
    (COMPLETIONS, {"prompt": "x", LONG: 1}),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"1" * 100_000: 1}}),
    (COMPLETIONS, {"prompt": "x", "n": 10**4000}),
    (COMPLETIONS, {"prompt": "x", "seed": -(10**4000)}),
    (CHAT, {"messages": [{"role": "user", "content": "x", LONG: 1}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", LONG: 1}]}]}),
    (CHAT, {"messages": TEXT_MESSAGES, "stream": True, "stream_options": {LONG: 1}}),
    (CHAT, {"messages": TEXT_MESSAGES, "response_format": {"type": LONG}}),
    (CHAT, {"messages": TEXT_MESSAGES, "response_format": {"type": "json_object", LONG: 1}}),
    (CHAT, {"messages": TEXT_MESSAGES, "structured_outputs": {LONG: 1}}),
    (CHAT, {"messages": TEXT_MESSAGES, "tools": [{"type": "function", "function": {"name": "f", LONG: 1}}]}),
    (
        CHAT,
        {
            "messages": TEXT_MESSAGES,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": LONG}},
        },
    ),
]


def test_a_hostile_name_or_value_is_not_echoed_whole(tmp_path, caplog):
    """A 400 quotes the field it names and often the value; a client's own key or value can be as long as the body
    (16 MiB), and the answer held it twice (message and param). Both are cut: the answer stays small and still
    names the field."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            async with aiohttp.ClientSession(headers=AUTH) as s:
                for path, request_body in HOSTILE_ECHOES:
                    async with s.post(base + path, json=request_body) as r:
                        raw = await r.read()
                    error = json.loads(raw)["error"]
                    assert r.status == 400 and len(raw) < 2048, (r.status, len(raw), raw[:200])
                    assert error["message"].startswith(error["param"]), error
                    assert "\n" not in error["message"], error
            assert not problems(caplog)

    asyncio.run(body())
    # the router's validation, and an error that reaches a stream as its error event, go through api_error
    error = api_error(InvalidRequestError("chat_template_kwargs." + LONG, "x" * 100_000), "chat")
    assert len(json.dumps(error.body())) < 2048 and error.message.startswith(error.param), error.body()


def test_a_body_over_the_limit_is_413(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path, max_message_bytes=4096) as (router, fake, base, hooks):
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + COMPLETIONS, json={"prompt": "x" * 10_000}) as r:
                    answer = await r.json()
                    assert_openai_error(answer, 413, r.status, code="request_too_large")
                    assert "4096 bytes (max_message_bytes)" in answer["error"]["message"]
            assert not problems(caplog)

    asyncio.run(body())


@pytest.mark.parametrize("value", [b"\xff\xfe", b"\x80", b"\xed\xa0\x80", "é".encode(), b"x" * 200])
def test_a_request_id_header_that_is_not_printable_ascii_is_400(tmp_path, caplog, value):
    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            got, answer = status_and_body(
                await raw_exchange(
                    router.http_port,
                    post_bytes(
                        COMPLETIONS,
                        b'{"prompt": "x", "max_tokens": 1}',
                        b"Authorization: Bearer sesame\r\nX-Request-Id: " + value + b"\r\n",
                    ),
                )
            )
            assert_openai_error(answer, 400, got)
            assert answer["error"]["message"].startswith("X-Request-Id header:")
            assert not problems(caplog)

    asyncio.run(body())


async def served_with_headers(router, headers: bytes) -> None:
    """A one-token completion sent with extra raw header lines `headers` is served (200)."""
    got, answer = status_and_body(
        await raw_exchange(
            router.http_port,
            post_bytes(COMPLETIONS, b'{"prompt": "x", "max_tokens": 1}', AUTH_LINE + headers + b"\r\n"),
        )
    )
    assert got == 200, answer


@pytest.mark.parametrize("header", [b"baggage: \xff=\xfe", b"tracestate: a=\xff", b"traceparent: \xff"])
def test_trace_headers_that_are_not_utf8_are_ignored(tmp_path, caplog, header):
    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            await served_with_headers(router, header)
            assert not problems(caplog)

    asyncio.run(body())


TRACEPARENT = b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
BAD_TRACE_HEADERS = [
    TRACEPARENT + b"tracestate: a=b,!!!",
    TRACEPARENT + b"tracestate: " + b"a=b," * 200,
    b"traceparent: " + b"0" * 600,
    b"baggage: k=v,novalue,=x",
]


def test_malformed_trace_headers_log_a_bounded_number_of_lines(tmp_path, caplog):
    """ASCII trace-context headers OpenTelemetry refuses: each made it log a WARNING, so any client could fill the
    log; the request is served either way."""
    caplog.set_level(logging.INFO)

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for _ in range(10):
                for headers in BAD_TRACE_HEADERS:
                    await served_with_headers(router, headers)
            assert not problems(caplog)
            lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(lines) <= 1, lines

    asyncio.run(body())


@pytest.mark.parametrize("value", [b"Bearer \xff", b"\xff", b"Bearer \xed\xa0\x80", b"Bearer sesame\x80"])
def test_an_authorization_header_that_is_not_utf8_is_401(tmp_path, caplog, value):
    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            raw = await raw_exchange(
                router.http_port,
                b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: "
                + value
                + b"\r\nConnection: close\r\n\r\n",
            )
            got, answer = status_and_body(raw)
            assert got == 401 and answer["error"]["code"] == "invalid_api_key", raw
            assert not problems(caplog)

    asyncio.run(body())


def test_malformed_http_is_400_and_one_rate_limited_warning(tmp_path, caplog):
    """A header line over 8 KiB, more than 128 headers, a bad header byte: aiohttp answers 400; the log gets one
    WARNING line for the lot (it logged an ERROR with a traceback for each)."""
    caplog.set_level(logging.INFO)
    malformed = [
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Bad: a\x7fb\r\n\r\n",
    ]

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for _ in range(5):
                for data in malformed:
                    raw = await raw_exchange(router.http_port, data)
                    assert raw.startswith(b"HTTP/1.") and raw.split(b" ")[1] == b"400", raw[:200]
            assert not problems(caplog)
            warnings = [
                r for r in caplog.records if r.levelno == logging.WARNING and "malformed HTTP" in r.getMessage()
            ]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/health") as r:
                    assert r.status == 200

    asyncio.run(body())


def test_a_fault_of_the_router_is_an_openai_500_without_internals(tmp_path, caplog, monkeypatch):
    """An exception escaping a handler is the router's own fault: logged at ERROR with its traceback, answered
    500 in OpenAI's shape saying nothing of it."""

    async def broken(self, request):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(http_api.HttpFront, "models", broken)

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.get(base + "/v1/models") as r:
                    answer = await r.json()
                    assert r.status == 500 and answer["error"]["code"] == "internal", answer
                    assert "secret" not in json.dumps(answer) and answer["error"]["type"] == "server_error"
            assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)

    asyncio.run(body())


@pytest.mark.parametrize("path, request_body", [(COMPLETIONS, {"prompt": "abc"}), (CHAT, {"messages": TEXT_MESSAGES})])
def test_a_failure_of_several_choices_names_the_request_the_log_names(tmp_path, caplog, path, request_body):
    """n > 1 without an X-Request-Id: the 500 said `internal error; the router's log has the details` without an id,
    and the log line had none either. The router assigns the request its id up front, which its samples share."""

    async def body():
        async with http_harness(tmp_path, FakeWorker(step_delay=0.02)) as (router, fake, base, hooks):
            async with aiohttp.ClientSession(headers=AUTH) as s:
                for _ in range(20):  # a loaded box: a health poll timing out loses the worker (503) before the step
                    await wait_for(lambda: router.batching_loop.is_worker_ready)
                    fake.fail_next = grpc.StatusCode.INTERNAL
                    caplog.clear()
                    async with s.post(base + path, json={**request_body, "n": 2, "max_tokens": 8}) as r:
                        answer = await r.json()
                    if r.status != 503:
                        break
                request_id = r.headers.get("X-Request-Id", "")
                assert r.status == 500 and request_id.startswith("chatcmpl-" if path == CHAT else "cmpl-"), answer
                assert f"(request {request_id})" in answer["error"]["message"], answer
                failed = [r for r in caplog.records if r.getMessage().startswith("request failed")]
                assert failed and {getattr(r, "request_id", None) for r in failed} == {request_id}
                # a request of several choices that succeeds: one id, in the answer and its header
                for _ in range(100):  # 503 until the router reconnected after the failure
                    await wait_for(lambda: router.batching_loop.is_worker_ready)
                    async with s.post(base + path, json={**request_body, "n": 2, "max_tokens": 2}) as r:
                        answer = await r.json()
                    if r.status != 503:
                        break
                assert r.status == 200 and answer["id"] == r.headers["X-Request-Id"], answer

    asyncio.run(body())


def test_the_error_code_never_carries_an_exception_text():
    """UnicodeError has a `reason` attribute (its own text): only the router's errors give the code."""
    error = api_error(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert error.status == 500 and error.code == "internal"
    assert "surrogates" not in json.dumps(error.body())


def test_rejection_outcomes_are_the_metrics_labels():
    from common.metrics import OUTCOMES

    for status in (400, 401, 404, 405, 408, 413, 429, 499, 500, 503, 504):
        assert http_api.rejection_outcome(status) in OUTCOMES
    assert [http_api.rejection_outcome(s) for s in (404, 429, 503, 504)] == [
        "invalid_argument",
        "resource_exhausted",
        "unavailable",
        "deadline_exceeded",
    ]
