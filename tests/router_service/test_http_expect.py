"""`Expect: 100-continue` on the HTTP front: the interim `100 Continue` goes out only once the request is
accepted and its body is about to be read. A request the router refuses from its headers alone (no or a wrong
bearer token, an unknown path, a wrong method, a Content-Length over max_message_bytes, a bad X-Request-Id, a
router at max_concurrent_requests or draining) gets its final answer at once instead, with `Connection: close`
(its body was never asked for, so the connection cannot carry another request), and the client never uploads it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from common.pb import router_pb2_grpc
from tests.router_service.fake_worker import FakeWorker, ids_request
from tests.router_service.test_http_errors import AUTH, AUTH_LINE, http_harness, problems, rejected
from tests.router_service.test_http_timeouts import closed_by_server

BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()


def expect_head(method: str, path: str, headers: bytes = AUTH_LINE, length: int = len(BODY)) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n".encode()
        + headers
        + b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % length
    )


async def first_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict | None]:
    """The first response head the server sends (an interim 100 included) and its JSON body, if it has one."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    body = await asyncio.wait_for(reader.readexactly(length), 10) if length else b""
    return head, json.loads(body) if body else None


# (name, request head, status, error code): each refusal can be decided from the head alone.
REFUSALS = [
    ("no token", expect_head("POST", "/v1/completions", b""), 401, "invalid_api_key"),
    ("wrong token", expect_head("POST", "/v1/completions", b"Authorization: Bearer nope\r\n"), 401, "invalid_api_key"),
    ("unknown path", expect_head("POST", "/v1/embeddings"), 404, None),
    ("wrong method", expect_head("PUT", "/v1/completions"), 405, None),
    ("GET route", expect_head("POST", "/v1/models"), 405, None),
    ("asterisk-form", expect_head("OPTIONS", "*"), 404, None),
    ("too large", expect_head("POST", "/v1/completions", length=1 << 30), 413, "request_too_large"),
    (
        "bad request id",
        expect_head("POST", "/v1/completions", AUTH_LINE + b"X-Request-Id: %s\r\n" % (b"a" * 200)),
        400,
        None,
    ),
    (
        "unknown expectation",
        expect_head("POST", "/v1/completions").replace(b"100-continue", b"200-ok"),
        417,
        "expectation_failed",
    ),
]


@pytest.mark.parametrize("name, head, status, code", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_request_refused_from_its_headers_gets_no_100_continue(tmp_path, caplog, name, head, status, code):
    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            writer.write(head)
            await writer.drain()
            answer, error = await first_answer(reader)
            assert answer.startswith(b"HTTP/1.1 %d " % status), answer
            assert error is not None and error["error"]["code"] == code, error
            assert "\n" not in error["error"]["message"]
            assert b"connection: close" in answer.lower(), answer
            assert await closed_by_server(reader, asyncio.get_running_loop().time() + 5)
            writer.close()
            assert fake.seen_ids == set() and not problems(caplog)

    asyncio.run(body())


def test_an_accepted_request_gets_100_continue_then_its_answer(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            writer.write(expect_head("POST", "/v1/completions"))
            await writer.drain()
            interim, _ = await first_answer(reader)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(BODY)
            answer, completion = await first_answer(reader)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            assert completion is not None and completion["usage"]["completion_tokens"] == 2
            # the connection stays open for the next request, which may expect again
            writer.write(expect_head("GET", "/v1/models", length=0))
            answer, models = await first_answer(reader)
            assert answer.startswith(b"HTTP/1.1 200 ") and models is not None and models["object"] == "list"
            writer.close()
            # and a client library that sends Expect gets its answer
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + "/v1/completions", data=BODY, expect100=True) as r:
                    assert r.status == 200, await r.text()
            assert not problems(caplog)

    asyncio.run(body())


def test_at_capacity_or_draining_an_expecting_request_gets_its_refusal_instead_of_100(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path, FakeWorker(step_delay=0.05), max_concurrent_requests=1) as (
            router,
            _,
            base,
            hooks,
        ):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
                stub = router_pb2_grpc.GenerationServiceStub(channel)
                holder = stub.GenerateStream(
                    ids_request([1], max_new_tokens=60), metadata=(("authorization", AUTH["Authorization"]),)
                )
                await holder.read()
                before = rejected(hooks, "resource_exhausted")
                reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
                writer.write(expect_head("POST", "/v1/chat/completions"))
                await writer.drain()
                answer, error = await first_answer(reader)
                assert answer.startswith(b"HTTP/1.1 429 ") and b"retry-after" in answer.lower(), answer
                assert error is not None and error["error"]["code"] == "overloaded"
                assert b"connection: close" in answer.lower()
                writer.close()
                assert rejected(hooks, "resource_exhausted") == before + 1
                holder.cancel()
            router.batching_loop.start_draining()
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            writer.write(expect_head("POST", "/v1/completions"))
            await writer.drain()
            answer, error = await first_answer(reader)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert error is not None and error["error"]["code"] == "draining"
            writer.close()
            assert not problems(caplog)

    asyncio.run(body())


def test_an_empty_expect_header_expects_nothing(tmp_path, caplog):
    """`Expect:` with no value (how some clients turn 100-continue off) is no expectation: the request is served
    and its connection kept, as aiohttp served it, rather than refused with 417."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            head = expect_head("POST", "/v1/completions").replace(b"Expect: 100-continue", b"Expect: ")
            writer.write(head + BODY)
            await writer.drain()
            answer, completion = await first_answer(reader)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            assert completion is not None and completion["usage"]["completion_tokens"] == 2
            assert b"connection: close" not in answer.lower()
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + AUTH_LINE + b"Expect:\r\n\r\n")
            answer, models = await first_answer(reader)
            assert answer.startswith(b"HTTP/1.1 200 ") and models is not None and models["object"] == "list"
            writer.close()
            assert not problems(caplog)

    asyncio.run(body())
