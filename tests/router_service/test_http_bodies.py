"""The HTTP front holds at most http_max_body_bytes_in_flight bytes of request bodies at once: a request reserves
its Content-Length before its body is read (a chunked one grows its share as it arrives), and one that does not
fit gets a one-line 503 (`code: too_many_body_bytes`, `Retry-After`, `Connection: close`; no 100 Continue when it
expected one), counted in colibri_http_bodies_refused_total. Its share is released once the body is parsed and on
every way out (an error answer, a timeout, a client gone), so the budget never leaks."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from router_service import http_api
from router_service.http_bodies import BodyBudget
from router_service.openai_errors import ApiError
from tests.router_service.fake_worker import FakeWorker, wait_for
from tests.router_service.test_http_errors import AUTH, AUTH_LINE, http_harness, problems, rejected
from tests.router_service.test_http_expect import first_answer
from tests.router_service.test_http_timeouts import closed_by_server

MAX_MESSAGE = 64 * 1024
BUDGET = 100_000
LIMITS = dict(max_message_bytes=MAX_MESSAGE, http_max_body_bytes_in_flight=BUDGET)


def body_of(size: int, **fields) -> bytes:
    """A valid completions body of exactly `size` bytes (JSON allows the trailing whitespace)."""
    body = json.dumps({"prompt": "hello", "max_tokens": 2, **fields}).encode()
    return body + b" " * (size - len(body))


def head(length: int | None, extra: bytes = b"") -> bytes:
    framing = b"Content-Length: %d\r\n" % length if length is not None else b"Transfer-Encoding: chunked\r\n"
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + AUTH_LINE
        + extra
        + framing
        + b"\r\n"
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def held(hooks) -> float:
    """colibri_http_body_bytes as a scrape reads it."""
    return hooks.m.http_body_bytes.collect()[0].samples[0].value


def refused(hooks) -> float:
    return hooks.m.http_bodies_refused._value.get()


async def hold(port: int, length: int, hooks) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request that announces `length` bytes, sends a few and stalls: it holds its reservation."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head(length) + b'{"prompt": ')
    await writer.drain()
    await wait_for(lambda: held(hooks) >= length)
    return reader, writer


def assert_refusal(answer: bytes, error: dict | None) -> None:
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert b"retry-after: 1\r\n" in answer.lower() and b"connection: close" in answer.lower(), answer
    assert error is not None and error["error"]["code"] == "too_many_body_bytes", error
    assert error["error"]["type"] == "server_error" and error["error"]["param"] is None
    message = error["error"]["message"]
    assert "http_max_body_bytes_in_flight" in message and "\n" not in message


def test_a_body_past_the_budget_is_503_until_the_bodies_held_are_released(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path, **LIMITS) as (router, fake, base, hooks):
            port = router.http_port
            _, holder = await hold(port, 60_000, hooks)
            assert held(hooks) == 60_000
            before = rejected(hooks, "unavailable")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head(50_000) + body_of(50_000))
            answer, error = await first_answer(reader)
            assert_refusal(answer, error)
            writer.close()
            assert refused(hooks) == 1 and rejected(hooks, "unavailable") == before + 1
            assert held(hooks) == 60_000  # the refused request kept nothing
            # a body that fits what is left is served meanwhile
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + "/v1/completions", data=body_of(30_000)) as r:
                    assert r.status == 200, await r.text()
                assert held(hooks) == 60_000
                # the holder hangs up mid-body: its handler is cancelled and its share released
                holder.close()
                await wait_for(lambda: held(hooks) == 0)
                async with s.post(base + "/v1/completions", data=body_of(MAX_MESSAGE)) as r:
                    assert r.status == 200, await r.text()
            assert held(hooks) == 0 and refused(hooks) == 1
            assert not problems(caplog)

    asyncio.run(body())


def test_a_request_expecting_100_continue_past_the_budget_gets_its_503_instead(tmp_path, caplog):
    """The budget is checked from the headers, before the 100 Continue: the client is never asked for its body,
    and its connection closes with the answer, as for the other refusals decided from the headers."""

    async def body():
        async with http_harness(tmp_path, **LIMITS) as (router, fake, base, hooks):
            _, holder = await hold(router.http_port, 60_000, hooks)
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            writer.write(head(50_000, b"Expect: 100-continue\r\n"))
            await writer.drain()
            answer, error = await first_answer(reader)
            assert_refusal(answer, error)
            assert await closed_by_server(reader, asyncio.get_running_loop().time() + 5)
            writer.close()
            holder.close()
            await wait_for(lambda: held(hooks) == 0)
            assert refused(hooks) == 1 and fake.seen_ids == set()
            assert not problems(caplog)

    asyncio.run(body())


def test_a_chunked_body_that_outgrows_the_budget_is_refused_mid_read(tmp_path, caplog):
    """A chunked body has no length to reserve up front: its share grows as it arrives, and the request is refused
    when it would pass the budget, its partial share released."""

    async def body():
        async with http_harness(tmp_path, **LIMITS) as (router, fake, base, hooks):
            _, holder = await hold(router.http_port, 60_000, hooks)
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            data = body_of(50_000)
            writer.write(head(None) + b"".join(chunk(data[i : i + 10_000]) for i in range(0, len(data), 10_000)))
            writer.write(b"0\r\n\r\n")
            answer, error = await first_answer(reader)
            assert_refusal(answer, error)
            writer.close()
            assert held(hooks) == 60_000
            holder.close()
            await wait_for(lambda: held(hooks) == 0)
            # alone, the same chunked body fits
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            writer.write(head(None) + chunk(data) + b"0\r\n\r\n")
            answer, completion = await first_answer(reader)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            writer.close()
            assert held(hooks) == 0 and refused(hooks) == 1
            assert not problems(caplog)

    asyncio.run(body())


def test_every_way_out_of_a_request_releases_its_share(tmp_path, caplog):
    """Served, invalid JSON, a field out of range, a chunked body over max_message_bytes (413), a stalled body
    (408), a client gone mid-body, and a stream still running (its body was parsed: it holds nothing)."""

    async def exchange(port: int, data: bytes, answer_status: int | None) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        if answer_status is not None:
            answer, _ = await first_answer(reader)
            assert answer.startswith(b"HTTP/1.1 %d " % answer_status), answer
        writer.close()

    async def body():
        fake = FakeWorker(step_delay=0.02)
        async with http_harness(tmp_path, fake, http_body_timeout_s=0.5, **LIMITS) as (router, _, base, hooks):
            port = router.http_port
            cases = [
                (head(5_000) + body_of(5_000), 200),
                (head(5_000) + b"{" * 5_000, 400),
                (head(5_000) + body_of(5_000, max_tokens=-1), 400),
                (head(None) + chunk(b" " * MAX_MESSAGE) + chunk(b" "), 413),
                (head(5_000) + b'{"prompt": ', 408),
                (head(5_000) + b'{"prompt": ', None),  # closed at once: the handler is cancelled mid-read
            ]
            for data, status in cases:
                await exchange(port, data, status)
                await wait_for(lambda: held(hooks) == 0)
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + "/v1/completions", data=body_of(40_000, stream=True, max_tokens=20)) as r:
                    assert r.status == 200
                    await r.content.readline()
                    assert held(hooks) == 0
                    await r.read()
            assert refused(hooks) == 0
            assert not problems(caplog)

    asyncio.run(body())


def test_a_large_body_is_parsed_off_the_event_loop_holding_its_share_until_parsed(tmp_path, caplog, monkeypatch):
    """Parsing a body of millions of JSON values and checking them takes seconds (an 8 MB `[[1], [1], ...]` prompt
    held the loop for ~4 s), during which every other stream stalled: a large body is parsed on a thread. A client
    that hangs up meanwhile gets its share back only once the thread has let go of its bytes."""
    gate, on_loop = threading.Event(), []
    parse = http_api.parse_request

    def gated(*args, **kwargs):
        on_loop.append(threading.current_thread() is threading.main_thread())
        if not on_loop[-1]:
            gate.wait(10)
        return parse(*args, **kwargs)

    monkeypatch.setattr(http_api, "parse_request", gated)

    async def body():
        async with http_harness(tmp_path, **LIMITS) as (router, fake, base, hooks):
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + "/v1/completions", data=body_of(1_000)) as r:
                    assert r.status == 200, await r.text()
            assert on_loop == [True]  # a small body is parsed where it is: a thread would cost more than it
            size = http_api.INLINE_BODY_BYTES + 1
            cancelled = rejected(hooks, "cancelled")
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            writer.write(head(size) + body_of(size))
            await wait_for(lambda: len(on_loop) == 2)
            assert on_loop[1] is False and held(hooks) == size
            writer.close()
            await asyncio.sleep(0.3)  # the handler is cancelled; the thread still holds the body
            assert held(hooks) == size
            gate.set()
            await wait_for(lambda: held(hooks) == 0 and rejected(hooks, "cancelled") == cancelled + 1)
            assert not problems(caplog)

    try:
        asyncio.run(body())
    finally:
        gate.set()


def test_a_reservation_grows_within_the_limit_and_is_released_once():
    refusals = []
    budget = BodyBudget(100, 1.5, lambda: refusals.append(1))
    with budget.reservation() as first:
        first.grow_to(60)
        first.grow_to(40)  # never shrinks before its release
        assert (first.bytes, budget.held) == (60, 60)
        with budget.reservation() as second:
            second.grow_to(40)
            with pytest.raises(ApiError) as error:
                second.grow_to(41)
            assert error.value.status == 503 and error.value.headers == {"Retry-After": "2"}
            assert budget.held == 100 and refusals == [1]
        assert budget.held == 60
    assert budget.held == 0
    first.release()
    assert budget.held == 0
