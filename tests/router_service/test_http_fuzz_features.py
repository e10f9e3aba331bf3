"""Property-based fuzzing (hypothesis) of the request fields that came with constrained decoding, tool calling,
several choices and prefix caching, through the real services: the OpenAI front of a router in front of the CPU
worker on the tiny model. Values are drawn to look plausible and go wrong: schemas with $ref loops, unsupported
keywords and deep nesting, regex and Lark fragments, tools with duplicate or odd names and non-object parameters,
tool_choice naming unknown tools, n / best_of up to 128 with streaming and logprobs, prompt lists mixing strings and
token ids (some outside the vocabulary), cache salts of every JSON type.

Each case: a 200, or a 400 / 413 / 422 in OpenAI's error shape with a one-line message naming no Python class;
nothing logged at ERROR. Afterwards the router holds no request and the worker no KV block. Derandomized.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import (
    BackgroundWorker,
    LogRecords,
    free_port,
    running_router,
    worker_kv_blocks_used,
    worth_reporting,
)
from tests.router_service.test_openai_http import TEMPLATE

pytestmark = pytest.mark.slow

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
STREAM_ERROR = b'data: {"error"'
CLASS_NAME = re.compile(r"\b[A-Z][a-z]+(Error|Exception)\b|<class |Traceback")


class Served:
    """The router (HTTP port) and a CPU worker, on an event loop in a background thread."""

    def __init__(self, model, tmp_path):
        self.model, self.tmp = model, tmp_path
        self.ready, self.result = threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            asyncio.run(self._main())
        finally:
            self.ready.set()  # a failed start is reported by the fixture, not a 60 s wait

    async def _main(self):
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        template = self.tmp / "chat.jinja"
        template.write_text(TEMPLATE)
        worker = BackgroundWorker(self.model, kv_block_size=4, kv_cache_tokens=1024).start()
        try:
            config = dict(model=str(self.model), chat_template=str(template), http_port=free_port())
            config.update(max_new_tokens=8, default_max_new_tokens=8)
            async with running_router(worker.address, **config) as (router, _):
                self.router, self.url = router, f"http://127.0.0.1:{router.http_port}"
                self.ready.set()
                await self.stop.wait()
                for _ in range(500):  # afterwards: nothing held
                    blocks = await worker_kv_blocks_used(router.worker)
                    if router.batching_loop.num_active == 0 and blocks == 0:
                        break
                    await asyncio.sleep(0.02)
                self.result = (router.batching_loop.num_active, blocks)
        finally:
            worker.stop()

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    records = LogRecords()
    logging.getLogger().addHandler(records)
    s = Served(tiny_model, tmp_path_factory.mktemp("fuzz-features"))
    s.thread.start()
    assert s.ready.wait(60) and s.thread.is_alive(), "the router did not start"
    s.records = records
    try:
        yield s
    finally:
        s.loop.call_soon_threadsafe(s.stop.set)
        s.thread.join(60)
        logging.getLogger().removeHandler(records)
    assert s.result == (0, 0), f"requests / KV blocks still held afterwards: {s.result}"


def check(served, what: str, status: int, raw: bytes) -> None:
    if __import__("os").environ.get("FUZZ_SHOW"):
        print("STATUS", status, raw[:150])
    problems = []
    if status not in (200, 400, 413, 422):
        problems.append(f"status {status}")
    elif status >= 400 or STREAM_ERROR in raw:  # a stream's error event: the client's (a grammar past its limits)
        try:
            event = raw[raw.index(STREAM_ERROR) + 6 :].split(b"\n", 1)[0] if status == 200 else raw
            error = json.loads(event)["error"]
            if status == 200 and error["type"] != "invalid_request_error":
                problems.append(f"stream error {error}")
            assert set(error) == {"message", "type", "param", "code"}
            if "\n" in error["message"] or CLASS_NAME.search(error["message"]) or len(error["message"]) > 500:
                problems.append(f"message {error['message'][:200]!r}")
        except (ValueError, KeyError, TypeError, AssertionError):
            problems.append(f"not OpenAI's error shape: {raw[:200]!r}")
    logged = [r for r in served.records.records if worth_reporting(r)]
    served.records.records.clear()
    if logged:
        problems.append(f"logged {logged[0].levelname} {logged[0].name}: {logged[0].getMessage()[:160]}")
    assert not problems, f"{what[:400]}: {'; '.join(problems)}"


# ---- strategies ----
def mostly(good, bad, odds: int = 6):
    """`good` odds times in odds + 1, else `bad`: cases that are mostly valid reach past validation."""
    return st.sampled_from([good] * odds + [bad]).flatmap(lambda strategy: strategy)


ODD = st.sampled_from(["", "a", "é", "🙂", "a b", "<tool_call>", "\x00", "x" * 70, "get_weather", "$ref", "#"])
TEXT = st.text(max_size=12) | ODD
REGEX = st.lists(
    st.sampled_from(
        ["a", "b*", "(", ")", "|", "{3}", "{1000}", "[a-z]", ".", "\\d", "+", "?", "(?=x)", "\\", "^", "$"]
    ),
    max_size=8,
).map("".join)
GRAMMAR = st.sampled_from(
    [
        'start: "a"+',
        'start: "a" start',
        'start: x\nx: x x | "a" | ',
        'start: /[0-9]{1,3}/ "," start?',
        "root ::= [a-z]+",
        "start: ",
        "%import common.NUMBER\nstart: NUMBER",
        'start: "a"{1000}',
        "start: %json {}",
    ]
)
SCHEMA = st.recursive(
    st.sampled_from(
        [
            {"type": "string"},
            {"type": "integer", "minimum": 3, "maximum": 1},
            {"type": "string", "pattern": "(a|b)*a(a|b){12}"},
            {"type": "string", "format": "email"},
            {"$ref": "#"},
            {"$ref": "#/$defs/missing"},
            {"not": {"type": "string"}},
            {"enum": ["x", 1, None]},
            {"type": "array", "minItems": 5000},
            {"x-unknown": 1},
            {},
        ]
    ),
    lambda inner: (
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(TEXT, inner, max_size=3)})
        | st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)})
        | st.fixed_dictionaries({"type": st.just("array"), "items": inner})
        | st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"n": inner}), "$ref": st.just("#/$defs/n")})
    ),
    max_leaves=6,
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
TOOL = st.fixed_dictionaries(
    {"type": mostly(st.just("function"), TEXT), "function": st.fixed_dictionaries(
        {"name": mostly(st.sampled_from(["f", "f", "get_weather", "g-1"]), TEXT, 3)},
        optional={"parameters": mostly(SCHEMA, JSON, 3), "strict": mostly(st.booleans(), JSON), "description": TEXT},
    )},
)  # fmt: skip
TOOL_CHOICE = st.sampled_from(["auto", "none", "required", "any"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "nope"]) | TEXT})}
)
TOKEN = mostly(st.integers(0, 258), st.sampled_from([259, 10**6, -1, True, 2.5]), 20)
PROMPT = mostly(
    st.lists(st.text(min_size=1, max_size=6) | st.lists(TOKEN, min_size=1, max_size=5), min_size=1, max_size=130),
    TEXT,
    1,
)
SALT = mostly(TEXT, JSON | st.just("s" * 257), 3)
CONSTRAINT = st.one_of(
    st.fixed_dictionaries({"guided_json": SCHEMA | JSON}),
    st.fixed_dictionaries({"guided_regex": REGEX}),
    st.fixed_dictionaries({"guided_choice": st.lists(TEXT, max_size=4) | JSON}),
    st.fixed_dictionaries({"guided_grammar": GRAMMAR}),
    st.fixed_dictionaries(
        {
            "response_format": st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": SCHEMA}),
                }
            )
        }
    ),  # fmt: skip
    st.fixed_dictionaries({"structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice"]), JSON)}),
    st.just({}),
    st.just({}),
    st.just({}),
)


@st.composite
def completion(draw):
    body = {"prompt": draw(PROMPT), "max_tokens": draw(st.integers(1, 8)), **draw(CONSTRAINT)}
    body["n"] = draw(mostly(st.sampled_from([1, 1, 2, 3, 128]), JSON))
    if draw(st.booleans()):
        body["best_of"] = draw(mostly(st.sampled_from([1, 4, 128]), JSON))
    for name, values in [("stream", st.booleans()), ("logprobs", st.sampled_from([0, 2])), ("cache_salt", SALT)]:
        if draw(st.booleans()):
            body[name] = draw(values)
    return body


@st.composite
def chat(draw):
    messages = [{"role": "user", "content": draw(TEXT)}]
    if draw(st.booleans()):  # a tool turn, its id known or not
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": draw(st.just("{}") | TEXT)}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": draw(st.sampled_from(["call_1", "unknown"]) | TEXT), "content": "1"},
        ]
    body = {"messages": messages, "max_tokens": draw(st.integers(1, 8)), **draw(CONSTRAINT)}
    body["tools"] = draw(mostly(st.lists(TOOL, min_size=1, max_size=4), st.sampled_from([[], None]), 3))
    for name, values in [
        ("tool_choice", TOOL_CHOICE),
        ("parallel_tool_calls", mostly(st.booleans(), JSON)),
        ("n", st.sampled_from([1, 2, 128])),
        ("stream", st.booleans()),
        ("cache_salt", SALT),
    ]:
        if draw(st.booleans()):
            body[name] = draw(values)
    return body


@FUZZ
@given(body=completion())
def test_completion_fields(served, body):
    status, raw = served.post("/v1/completions", body)
    check(served, json.dumps(body), status, raw)


@FUZZ
@given(body=chat())
def test_chat_fields(served, body):
    status, raw = served.post("/v1/chat/completions", body)
    check(served, json.dumps(body), status, raw)
