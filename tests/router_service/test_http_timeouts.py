"""HTTP connections are bounded in time: headers (http_header_timeout_s), body (http_body_timeout_s) and each
write of an answer (http_write_timeout_s). Slow or stalled clients lose their connection (and their request),
nothing is logged at ERROR, and the router keeps serving."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest

from tests.router_service.fake_worker import FakeWorker
from tests.router_service.test_http_errors import AUTH, http_harness, problems, status_and_body


async def closed_by_server(reader: asyncio.StreamReader, deadline: float) -> bool:
    """True once the server closed the connection (EOF or reset) before `deadline` (loop time)."""
    loop = asyncio.get_running_loop()
    try:
        while (left := deadline - loop.time()) > 0:
            if not await asyncio.wait_for(reader.read(65536), left):
                return True
    except (TimeoutError, ConnectionError):
        return loop.time() < deadline
    return False


def test_connections_that_never_finish_their_headers_are_closed(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path, http_header_timeout_s=0.5) as (router, fake, base, hooks):
            connections = []
            for i in range(50):
                reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n" if i % 2 else b"")
                connections.append((reader, writer))
            started = time.monotonic()
            deadline = asyncio.get_running_loop().time() + 10
            closed = await asyncio.gather(*(closed_by_server(r, deadline) for r, _ in connections))
            assert all(closed), f"{closed.count(False)} of 50 connections still open"
            assert time.monotonic() - started < 5
            for _, writer in connections:
                writer.close()
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/health") as r:
                    assert r.status == 200
            assert not problems(caplog)

    asyncio.run(body())


def test_a_body_that_stalls_is_408_and_its_connection_closed(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path, http_body_timeout_s=0.5) as (router, fake, base, hooks):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            payload = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sesame\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload[:10]
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            got, answer = status_and_body(head + await reader.readexactly(length))
            assert got == 408 and answer["error"]["code"] == "request_timeout", answer
            assert b"connection: close" in head.lower()
            assert await closed_by_server(reader, asyncio.get_running_loop().time() + 5)
            writer.close()
            assert router.batching_loop.num_active == 0 and not problems(caplog)

    asyncio.run(body())


@pytest.mark.slow  # about 10 s: the socket buffers take megabytes of events to fill
def test_a_streaming_client_that_stops_reading_is_disconnected_and_its_request_cancelled(tmp_path, caplog):
    """It reads the first bytes, then nothing: once the socket buffers are full, a write waits
    http_write_timeout_s, then the connection is aborted (its buffered bytes dropped) and the request cancelled,
    long before its request timeout."""
    roomy = FakeWorker(num_blocks=50_000, max_position_embeddings=200_000)

    async def body():
        async with http_harness(
            tmp_path, roomy, http_write_timeout_s=1.0, max_new_tokens=150_000, request_timeout_s=600
        ) as (router, fake, base, hooks):
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", router.http_port))
            payload = json.dumps(
                {"prompt": "x", "max_tokens": 150_000, "ignore_eos": True, "stream": True, "logprobs": 5}
            ).encode()
            await loop.sock_sendall(
                sock,
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                b"sesame\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload,
            )
            assert (await asyncio.wait_for(loop.sock_recv(sock, 100), 10)).startswith(b"HTTP/1.1 200")
            deadline = loop.time() + 60
            while router.batching_loop.num_active and loop.time() < deadline:
                await asyncio.sleep(0.1)
            assert router.batching_loop.num_active == 0, "the request still runs for a client that stopped reading"
            reset = False
            try:
                while await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10):
                    pass
            except ConnectionResetError:
                reset = True
            assert reset, "the connection ended cleanly: it should have been aborted"
            sock.close()
            assert fake.seqs == {} or await _freed(fake)
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                    assert r.status == 200
            assert not problems(caplog)

    asyncio.run(body())


async def _freed(fake, timeout=10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while fake.seqs and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return not fake.seqs
