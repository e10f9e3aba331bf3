"""Property-based fuzzing of the OpenAI-compatible HTTP front (hypothesis), as tests/router_service/test_fuzz_public.py
does for the gRPC port: the real aiohttp app in front of the fake worker, driven over raw sockets so any byte can
be sent. Bodies (random JSON in and out of the fields' bounds, lone surrogate escapes, deep nesting, raw bytes),
headers (X-Request-Id, Authorization, traceparent, Content-Type with any bytes) and slow clients (headers or body
cut short or stalled, streams left unread or dropped).

Each case asserts: no 5xx; an error answer to a well-formed HTTP request is OpenAI's JSON error shape with a
one-line message naming no Python class; nothing logged at ERROR and no traceback. After all cases the router
still answers /health, holds no request and the worker no sequence. Derandomized; a minute or so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import LogRecords, free_port, worth_reporting
from tests.router_service.fake_worker import harness
from tests.router_service.test_http_errors import TEMPLATE

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
ACCEPTABLE = {200, 400, 401, 404, 405, 408, 413, 415, 429}
CLASS_NAME = re.compile(r"\b[A-Z][a-z]+(Error|Exception)\b|<class |Traceback")
TOKEN = b"sesame"


class Router:
    """The router with its HTTP port (fake worker behind it) on an event loop in a background thread."""

    def __init__(self, tokenizer, tmp_path):
        self._tokenizer, self._tmp, self._ready = tokenizer, tmp_path, threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self):
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        template = self._tmp / "chat.jinja"
        template.write_text(TEMPLATE)
        async with harness(
            tokenizer=self._tokenizer,
            http_port=free_port(),
            chat_template=str(template),
            auth_token=TOKEN.decode(),
            max_new_tokens=48,
            default_max_new_tokens=8,
            max_concurrent_requests=4,
            max_message_bytes=64 * 1024,
            http_header_timeout_s=0.5,
            http_body_timeout_s=0.5,
            http_write_timeout_s=1.0,
            chat_template_timeout_s=2.0,
        ) as (router, fake, _, _):
            self.router, self.fake = router, fake
            self._ready.set()
            await self._stop.wait()

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(30), "router did not start"
        self.port = self.router.http_port
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def exchange(self, data: bytes, pauses: tuple[int, ...] = (), read: bool = True, limit: int = 1 << 20) -> bytes:
        """Sends `data` (pausing 0.1 s after each offset in `pauses`), then reads the answer until the server
        closes (at most `limit` bytes; `read` False hangs up at once)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=15) as sock:
            at = 0
            try:
                for cut in sorted(p for p in pauses if p < len(data)) + [len(data)]:
                    sock.sendall(data[at:cut])
                    at = cut
                    if cut < len(data):
                        time.sleep(0.1)
            except OSError:  # the server closed first (a timeout, an answer before the whole body)
                pass
            out = b""
            try:
                while read and len(out) < limit and (piece := sock.recv(65536)):
                    out += piece
            except OSError:
                pass
            return out


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    records = LogRecords()
    logging.getLogger().addHandler(records)
    try:
        with Router(tokenizer, tmp_path_factory.mktemp("http-fuzz")) as router:
            router.records = records
            yield router
            # Afterwards: still serving, nothing held.
            assert status_of(router.exchange(request(b"GET", b"/health", b""))) == 200
            ok = router.exchange(request(b"POST", b"/v1/completions", b'{"prompt": [5, 6], "max_tokens": 3}'))
            assert status_of(ok) == 200, ok[:300]
            loop = router.router.batching_loop
            deadline = time.monotonic() + 10
            while (
                loop.num_active or loop.scheduler.num_used_blocks or router.fake.seqs
            ) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert loop.num_active == 0 and loop.scheduler.num_used_blocks == 0
            assert not router.fake.seqs, "the worker still holds sequences"
    finally:
        logging.getLogger().removeHandler(records)


def request(
    method: bytes, path: bytes, body: bytes, headers: bytes = b"", auth: bool = True, length: int | None = None
) -> bytes:
    return (
        method
        + b" "
        + path
        + b" HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        + (b"Authorization: Bearer " + TOKEN + b"\r\n" if auth else b"")
        + headers
        + b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length)
        + body
    )


def status_of(raw: bytes) -> int | None:
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", raw)
    return int(match.group(1)) if match else None


def check(server, what: str, raw: bytes, well_formed: bool = True, answered: bool = True) -> None:
    """One case's answer and the log since the previous case."""
    problems = []
    status = status_of(raw)
    if status is None:
        if answered:
            problems.append(f"no answer: {raw[:100]!r}")
    elif status not in ACCEPTABLE:
        problems.append(f"status {status}")
    elif status >= 400 and well_formed:
        head, _, body = raw.partition(b"\r\n\r\n")
        try:
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            message = error["message"]
            if "\n" in message or CLASS_NAME.search(message) or len(message) > 500:
                problems.append(f"message {message[:200]!r}")
        except (ValueError, KeyError, TypeError, AssertionError):
            problems.append(f"not OpenAI's error shape: {body[:200]!r}")
    logged = [r for r in server.records.records if worth_reporting(r)]
    server.records.records.clear()
    if logged:
        problems.append(
            f"logged {logged[0].levelname} {logged[0].name}: {logged[0].getMessage()[:160]}"
            + (" with a traceback" if logged[0].exc_info else "")
        )
    assert not problems, f"{what[:300]}: {'; '.join(problems)}"


# ---- strategies ----
SURROGATES = ["\\ud800", "\\udfff", "\\ud83d", "a\\udc00b", "\\ud83d\\ude00"]  # the last one is a valid pair
TEXT = st.text(max_size=30) | st.sampled_from(["", "\x00", "é", "🙂", "a" * 300, "\r\n"])
NUMBER = st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.sampled_from([0, 1, -1, 0.5, 1e-300, 10**400])
JSON = st.recursive(
    st.none() | st.booleans() | NUMBER | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "seed",
    "n",
    "echo",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt_logprobs",
    "chat_template_kwargs",
    "continue_final_message",
    "add_generation_prompt",
    "response_format",
    "truncate_prompt_tokens",
    "user",
    "best_of",
    "cache_salt",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", ""]) | JSON},
    optional={
        "content": TEXT | JSON | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)
    },
)


@st.composite
def bodies(draw):
    """A request body's bytes: mostly an object of the OpenAI fields with random values, sometimes with a lone
    surrogate escape spliced into a string, nested deep, cut short, or not JSON at all."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "surrogate", "deep", "cut", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=80))
    if kind == "deep":
        depth = draw(st.sampled_from([70, 500, 5000, 50_000]))
        return b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
    value = {name: draw(JSON) for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True))}
    value.setdefault("prompt", draw(TEXT | st.lists(st.integers(0, 300), max_size=8)))
    value.setdefault("messages", draw(st.lists(MESSAGE, max_size=3)))
    if draw(st.booleans()):
        value["max_tokens"] = draw(st.integers(1, 6))
    raw = json.dumps(value, ensure_ascii=True).encode()
    if kind == "surrogate":
        at = [m.end() for m in re.finditer(rb'"', raw)]
        cut = draw(st.sampled_from(at)) if at else 0
        raw = raw[:cut] + draw(st.sampled_from(SURROGATES)).encode() + raw[cut:]
    if kind == "cut":
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


HEADER_VALUE = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b) | st.sampled_from(
    [
        b"",
        b"ok-1",
        b"\xff\xfe",
        b"\xc3\xa9",
        b"\xed\xa0\x80",
        b"x" * 300,
        b"a b",
        b"\x00",
        b"gzip",
        b"deflate",
        b"br",
        b"Bearer sesame",
        b"application/json; charset=latin-1",
    ]
)


@settings(FUZZ, max_examples=150)
@given(body=bodies(), path=st.sampled_from([b"/v1/completions", b"/v1/chat/completions"]))
def test_any_body(server, body, path):
    raw = server.exchange(request(b"POST", path, body))
    check(server, f"body {path!r} {body[:200]!r}", raw)


@settings(FUZZ, max_examples=120)
@given(
    name=st.sampled_from(
        [
            b"X-Request-Id",
            b"Authorization",
            b"traceparent",
            b"tracestate",
            b"Content-Type",
            b"Accept",
            b"Content-Encoding",
        ]
    ),
    value=HEADER_VALUE,
    path=st.sampled_from(
        [b"/v1/completions", b"/v1/chat/completions", b"/v1/models", b"/health", b"/v1/models/fake", b"/v1/nowhere"]
    ),
)
def test_any_header(server, name, value, path):
    body = b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    method = b"GET" if path in (b"/v1/models", b"/health", b"/v1/models/fake", b"/v1/nowhere") else b"POST"
    auth = name != b"Authorization"
    raw = server.exchange(request(method, path, body, name + b": " + value + b"\r\n", auth=auth))
    # Bytes HTTP forbids in a header value (controls) are aiohttp's own plain-text 400.
    well_formed = not any(c < 0x20 and c != 0x09 or c == 0x7F for c in value)
    check(server, f"header {name!r}: {value!r} on {path!r}", raw, well_formed)


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_slow_clients(server, data):
    """Headers in pieces, a body shorter than its Content-Length, streams left unread or dropped: every
    connection ends (the server's timeouts), nothing leaks, nothing is logged at ERROR."""
    kind = data.draw(st.sampled_from(["pieces", "short body", "stalled headers", "unread stream", "dropped"]))
    body = json.dumps(
        {"prompt": "hello", "max_tokens": 40, "stream": kind in ("unread stream", "dropped"), "ignore_eos": True}
    ).encode()
    whole = request(b"POST", b"/v1/completions", body)
    if kind == "pieces":
        pauses = tuple(data.draw(st.lists(st.integers(1, len(whole) - 1), max_size=3)))
        check(server, f"pieces at {pauses}", server.exchange(whole, pauses))
    elif kind == "short body":
        missing = data.draw(st.integers(1, len(body)))
        raw = server.exchange(request(b"POST", b"/v1/completions", body[:-missing], length=len(body)))
        check(server, f"body missing {missing} bytes", raw)
        assert status_of(raw) == 408, raw[:200]
    elif kind == "stalled headers":
        raw = server.exchange(whole[: data.draw(st.integers(0, whole.index(b"\r\n\r\n")))])
        check(server, "stalled headers", raw, answered=False)
    else:
        raw = server.exchange(whole, read=kind == "unread stream", limit=data.draw(st.integers(0, 400)))
        check(server, kind, raw, answered=kind == "unread stream")
