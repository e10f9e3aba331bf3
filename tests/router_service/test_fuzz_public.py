"""Property-based fuzzing of the public port (hypothesis): every GenerationService RPC, plus health, with random
field values inside and outside their bounds, messages of the wrong type, mutated encodings and raw random bytes
(sent through a generic channel call with identity serializers).

Each case asserts: the status is one a client can act on (OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED), its message is
one line without a Python class name, nothing was logged at ERROR and no traceback was logged. After all cases the
router still serves and its KV blocks are back to zero. Runs against the fake worker, derandomized, in seconds.

`COLIBRI_FUZZ_SURVEY=1` records violations instead of failing at the first one and prints the counts at the end
(what the suite reported before the fixes it drove).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import VOCAB_SIZE
from tests.helpers import LogRecords, worth_reporting
from tests.router_service.fake_worker import harness

SERVICE = "/colibri.router.v1.GenerationService/"
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
SURVEY = os.environ.get("COLIBRI_FUZZ_SURVEY") == "1"
COUNTS: collections.Counter = collections.Counter()
FINDINGS: list[tuple[str, list[str]]] = []
FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
CLASS_NAME = re.compile(r"\b[A-Z][a-z]+(Error|Exception)\b|<class ")


class Router:
    """The router (fake worker behind it) on an event loop in a background thread; the tests call it with a
    blocking channel, as an outside client would."""

    def __init__(self, tokenizer):
        self._tokenizer, self._ready, self._loop = tokenizer, threading.Event(), None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self):
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with harness(
            tokenizer=self._tokenizer, max_new_tokens=48, default_max_new_tokens=8, max_concurrent_requests=4
        ) as (router, fake, _, _):
            self.router, self.fake = router, fake
            self._ready.set()
            await self._stop.wait()

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(30), "router did not start"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.router.port}")
        return self

    def __exit__(self, *exc):
        self.channel.close()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def raw(self, method: str, payload: bytes, stream: bool = False):
        """(status code, details, responses) of one call with `payload` as the request's bytes."""
        try:
            if stream:
                call = self.channel.unary_stream(method)(payload, timeout=20)
                return grpc.StatusCode.OK, "", list(call)
            return grpc.StatusCode.OK, "", [self.channel.unary_unary(method)(payload, timeout=20)]
        except grpc.RpcError as e:
            return e.code(), e.details() or "", []


@pytest.fixture(scope="module")
def server(tokenizer):
    records = LogRecords()
    logging.getLogger().addHandler(records)
    try:
        with Router(tokenizer) as router:
            router.records = records
            yield router
            # Afterwards: still serving, nothing held.
            ok = router.raw(
                SERVICE + "Generate",
                rpb.GenerateRequest(
                    token_ids=rpb.TokenIds(ids=[5, 6]), parameters=rpb.SamplingParameters(max_new_tokens=3)
                ).SerializeToString(),
            )
            assert ok[0] == grpc.StatusCode.OK, ok
            loop = router.router.batching_loop
            deadline = time.monotonic() + 5
            while (
                loop.num_active or loop.scheduler.num_used_blocks or router.fake.seqs
            ) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert loop.num_active == 0 and loop.scheduler.num_used_blocks == 0
            assert not router.fake.seqs, "the worker still holds sequences"
    finally:
        logging.getLogger().removeHandler(records)
        kinds = collections.Counter(
            f"{what.split(' ')[0]}: {problem.split(' ')[0]} {problem.split(' ')[1]}"
            for what, problems in FINDINGS
            for problem in problems
        )
        print(f"\nfuzz cases: {dict(COUNTS)}; failing cases: {len(FINDINGS)}; by kind: {dict(kinds)}")


def _check(server, what: str, code, details: str) -> None:
    COUNTS[what.split(" ")[0]] += 1
    problems = []
    if code not in ACCEPTABLE:
        problems.append(f"status {code.name}")
    if "\n" in details or CLASS_NAME.search(details) or len(details) > 500:
        problems.append(f"message {details[:200]!r}")
    logged = [r for r in server.records.records if worth_reporting(r)]
    server.records.records.clear()
    if logged:
        problems.append(
            f"logged {logged[0].levelname} {logged[0].name}: {logged[0].getMessage()[:120]}"
            + (" with a traceback" if logged[0].exc_info else "")
        )
    if problems:
        if not SURVEY:
            raise AssertionError(f"{what}: {'; '.join(problems)}")
        FINDINGS.append((what, problems))


# ---- strategies ----
ANY_FLOAT = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, 1e-45, 1e-38, 1e-3, 1e-2, 0.5, 1.0, 1.0000001, 2.0, 100.0, 1e38, -0.0]
)
UINT32 = st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, VOCAB_SIZE - 1, VOCAB_SIZE, 2**31, 2**32 - 1])
SMALL = st.integers(0, 70)
TEXT = st.text(max_size=40) | st.sampled_from(["", "a", "\x00", "\n", "é", "🙂", "\ud7ff", "a" * 300])
REQUEST_ID = st.text(max_size=20) | st.sampled_from(["", "ok-1", "\x00", "\r\n", "é", "a b", "x" * 200])


@st.composite
def generate_requests(draw):
    params = rpb.SamplingParameters(
        temperature=draw(ANY_FLOAT),
        top_k=draw(st.integers(0, 400) | UINT32),
        top_p=draw(ANY_FLOAT),
        max_new_tokens=draw(SMALL | UINT32),
        min_new_tokens=draw(st.integers(0, 10) | UINT32),
        stop_sequences=draw(st.lists(TEXT, max_size=6)),
        stop_token_ids=draw(st.lists(SMALL | UINT32, max_size=5)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.booleans()),
    )
    if draw(st.booleans()):
        params.seed = draw(st.integers(0, 2**64 - 1))
    request = rpb.GenerateRequest(parameters=params, request_id=draw(REQUEST_ID))
    kind = draw(st.sampled_from(["text", "ids", "none", "empty ids"]))
    if kind == "text":
        request.text = draw(TEXT)
    elif kind == "ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB_SIZE + 2) | UINT32, max_size=30)))
    elif kind == "empty ids":
        request.token_ids.SetInParent()
    return request


OTHER_MESSAGES = [
    rpb.GenerateResponse(request_id="x", token_ids=[1, 2], text="t"),
    rpb.ModelInfoResponse(model_name="m", vocab_size=7),
    rpb.TokenizeResponse(token_ids=[3]),
    health_pb2.HealthCheckRequest(service="s"),
    rpb.TokenizeRequest(text="hello"),
    rpb.GenerateStreamResponse(stop_reason=2),
]


@st.composite
def mutated(draw):
    """A valid request's bytes, or another message's, truncated, bit-flipped or with garbage appended."""
    base = draw(
        st.sampled_from(
            OTHER_MESSAGES
            + [
                rpb.GenerateRequest(
                    text="hi", parameters=rpb.SamplingParameters(max_new_tokens=4, stop_sequences=["x"])
                )
            ]
        )
    ).SerializeToString()
    data = bytearray(base)
    for _ in range(draw(st.integers(0, 3))):
        if data and draw(st.booleans()):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    data += draw(st.binary(max_size=8))
    return bytes(data)


# ---- properties ----
@settings(FUZZ, max_examples=160)
@given(request=generate_requests(), stream=st.booleans())
def test_generate_any_field_values(server, request, stream):
    code, details, _ = server.raw(
        SERVICE + ("GenerateStream" if stream else "Generate"), request.SerializeToString(), stream
    )
    _check(server, f"fields {'GenerateStream' if stream else 'Generate'} {request!r}"[:400], code, details)


@settings(FUZZ, max_examples=80)
@given(text=st.text(max_size=200) | st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
def test_tokenize_any_text(server, text):
    code, details, _ = server.raw(SERVICE + "Tokenize", rpb.TokenizeRequest(text=text).SerializeToString())
    _check(server, f"tokenize {text[:60]!r}", code, details)


METHODS = [("Generate", False), ("GenerateStream", True), ("Tokenize", False), ("ModelInfo", False)]


@settings(FUZZ, max_examples=200)
@given(payload=st.binary(max_size=120), method=st.sampled_from(METHODS + [("health", False)]))
def test_raw_bytes(server, payload, method):
    name, stream = method
    path = "/grpc.health.v1.Health/Check" if name == "health" else SERVICE + name
    code, details, _ = server.raw(path, payload, stream)
    _check(server, f"raw {name} {payload[:60]!r}", code, details)


@settings(FUZZ, max_examples=160)
@given(payload=mutated(), method=st.sampled_from(METHODS))
def test_wrong_and_mutated_messages(server, payload, method):
    name, stream = method
    code, details, _ = server.raw(SERVICE + name, payload, stream)
    _check(server, f"mutated {name} {payload[:60]!r}", code, details)
