"""A request the HTTP front refuses before reading all of its body (401, 404, 413, 415, a bad Transfer-Encoding,
a 413 found mid-body) is answered with `Connection: close`, and its connection is closed after a bounded linger
(router_service.http_connections.REFUSAL_LINGER_BYTES and _S): aiohttp would go on reading and dropping the body
for 10 s at whatever rate the client sends, then take the next request on the same connection. Raw sockets on
loopback; the bytes the server reads are counted where its connections take them."""

from __future__ import annotations

import asyncio
import random
import ssl

import pytest

from router_service import http_connections
from tests.router_service.certs import issue, make_ca
from tests.router_service.test_http_errors import AUTH_LINE, COMPLETIONS, http_harness, problems

PIECE = 64 * 1024
# what the server may read besides the linger's bytes: the head and what its parser buffers before the refusal
SLACK = 1024 * 1024
MAX_MESSAGE = 64 * 1024


def head(path: str, headers: bytes, length: int | None) -> bytes:
    framing = b"Content-Length: %d\r\n" % length if length is not None else b""
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n".encode()
        + headers
        + framing
        + b"\r\n"
    )


def chunk(size: int) -> bytes:
    return b"%x\r\n" % size + b"x" * size + b"\r\n"


# (name, request head, one piece of its endless body, status)
HUGE = 1 << 40
REFUSED = [
    ("no token", head(COMPLETIONS, b"", HUGE), b"x" * PIECE, 401),
    ("unknown path", head("/v1/embeddings", AUTH_LINE, HUGE), b"x" * PIECE, 404),
    ("too large", head(COMPLETIONS, AUTH_LINE, HUGE), b"x" * PIECE, 413),
    ("coding", head(COMPLETIONS, AUTH_LINE + b"Content-Encoding: compress\r\n", HUGE), b"x" * PIECE, 415),
    (
        "transfer coding",
        head(COMPLETIONS, AUTH_LINE + b"Transfer-Encoding: gzip, chunked\r\n", None),
        chunk(PIECE),
        400,
    ),
    ("too large mid-body", head(COMPLETIONS, AUTH_LINE + b"Transfer-Encoding: chunked\r\n", None), chunk(PIECE), 413),
]


@pytest.fixture
def server_reads(monkeypatch) -> list[int]:
    """Counts the bytes the HTTP port's connections take from their sockets."""
    counted = [0]
    taken = http_connections._Gated.data_received

    def counting(self, data: bytes) -> None:
        counted[0] += len(data)
        taken(self, data)

    monkeypatch.setattr(http_connections._Gated, "data_received", counting)
    return counted


async def answers_until_closed(reader: asyncio.StreamReader, received: bytearray) -> None:
    """Collects into `received` everything the server sends until it closes the connection (EOF or reset)."""
    try:
        while data := await reader.read(65536):
            received += data
    except ConnectionError:
        pass


async def push(port: int, request_head: bytes, piece: bytes, seconds: float, tls=None) -> tuple[bytes, float]:
    """Sends `request_head`, then `piece` after piece for up to `seconds`, as fast as the server takes them and
    whatever it answers (a hostile client); returns what the server answered and how long after the head the
    connection could no longer be written (the server closed it; inf: it did not)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
    started, closed_after = loop.time(), float("inf")
    writer.write(request_head)
    received = bytearray()
    answer = asyncio.create_task(answers_until_closed(reader, received))
    try:
        while loop.time() < started + seconds:
            if writer.transport.is_closing():
                closed_after = loop.time() - started
                break
            writer.write(piece)
            try:
                await asyncio.wait_for(writer.drain(), max(0.01, started + seconds - loop.time()))
            except ConnectionError:
                closed_after = loop.time() - started
                break
            except TimeoutError:
                break
        await asyncio.wait([answer], timeout=1)
        return bytes(received), closed_after
    finally:
        answer.cancel()
        writer.transport.abort()


@pytest.mark.parametrize("name, request_head, piece, status", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_refused_body_is_not_read_on_and_its_connection_closes(
    tmp_path, caplog, server_reads, name, request_head, piece, status
):
    async def body():
        async with http_harness(tmp_path, max_message_bytes=MAX_MESSAGE) as (router, fake, base, hooks):
            answer, closed_after = await push(router.http_port, request_head, piece, 6.0)
            assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
            assert b"\r\nconnection: close\r\n" in answer.partition(b"\r\n\r\n")[0].lower() + b"\r\n", answer[:400]
            # the linger's second and some time to spare on a loaded machine; aiohttp's own linger was 10 s
            assert closed_after < http_connections.REFUSAL_LINGER_S + 3, closed_after
            limit = len(request_head) + MAX_MESSAGE + http_connections.REFUSAL_LINGER_BYTES + SLACK
            assert server_reads[0] <= limit, f"the server read {server_reads[0]} bytes, more than {limit}"
            assert answer.count(b"HTTP/1.1 ") == 1, answer[:400]
            assert fake.seen_ids == set() and not problems(caplog)

    asyncio.run(body())


def test_over_tls_a_refused_body_is_not_read_on_either(tmp_path, caplog, server_reads):
    """TLS has no half-close: the refusal is sent, the body read on within the same bounds, the connection closed."""

    async def body():
        ca = make_ca()
        pair = issue(ca, "localhost", server=True)
        (tmp_path / "tls.crt").write_bytes(pair.cert)
        (tmp_path / "tls.key").write_bytes(pair.key)
        files = dict(tls_cert_file=str(tmp_path / "tls.crt"), tls_key_file=str(tmp_path / "tls.key"))
        trust = ssl.create_default_context(cadata=ca.cert.decode())
        trust.check_hostname = False
        async with http_harness(tmp_path, **files) as (router, fake, base, hooks):
            answer, closed_after = await push(router.http_port, head(COMPLETIONS, b"", HUGE), b"x" * PIECE, 6.0, trust)
            assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
            assert closed_after < http_connections.REFUSAL_LINGER_S + 3, closed_after
            limit = http_connections.REFUSAL_LINGER_BYTES + 2 * SLACK
            assert server_reads[0] <= limit, f"the server read {server_reads[0]} bytes, more than {limit}"
            assert not problems(caplog)

    asyncio.run(body())


def test_a_request_pipelined_behind_a_refused_body_is_not_served(tmp_path, caplog, server_reads):
    """The body's rest arrives after the refusal, a request behind it: the connection ends with the refusal (the
    router answered before it had the body, so it cannot vouch for what follows; aiohttp drained the body and
    served the next request)."""

    async def body():
        rng = random.Random()
        length = rng.randrange(2048, 200_000)
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            first = rng.randrange(0, 1024)
            writer.write(head(COMPLETIONS, b"", length) + b"{" * first)
            received = bytearray()
            answer = asyncio.create_task(answers_until_closed(reader, received))
            await asyncio.sleep(0.2)  # the 401 is sent before the rest arrives
            writer.write(b" " * (length - first) + b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            done, _ = await asyncio.wait([answer], timeout=http_connections.REFUSAL_LINGER_S + 3)
            answer.cancel()
            writer.transport.abort()
            assert received.startswith(b"HTTP/1.1 401 "), received[:200]
            assert received.count(b"HTTP/1.1 ") == 1, bytes(received)
            assert done, "the connection was kept for another request"
            assert not problems(caplog)

    asyncio.run(body())


def test_a_connection_past_the_cap_is_read_on_only_a_little(tmp_path, caplog, server_reads):
    """The canned 503 of a connection past http_max_connections lingers as a refused body does: bounded in bytes
    too, where it dropped whatever arrived for a second."""

    async def body():
        async with http_harness(tmp_path, http_max_connections=1) as (router, fake, base, hooks):
            held = await asyncio.open_connection("127.0.0.1", router.http_port)
            await asyncio.sleep(0.1)  # the router has taken it
            answer, closed_after = await push(router.http_port, head(COMPLETIONS, AUTH_LINE, HUGE), b"x" * PIECE, 6.0)
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
            assert closed_after < http_connections.REFUSAL_LINGER_S + 3, closed_after
            limit = http_connections.REFUSAL_LINGER_BYTES + SLACK
            assert server_reads[0] <= limit, f"the server read {server_reads[0]} bytes, more than {limit}"
            held[1].close()
            assert not problems(caplog)

    asyncio.run(body())


def chunked_head() -> bytes:
    return head(COMPLETIONS, AUTH_LINE + b"Transfer-Encoding: chunked\r\n", None)


# (name, the body's start, filler sent on and on: chunk framing that carries (next to) no body byte)
FRAMING_FILLERS = [
    ("extension", b"1;", b"a" * PIECE),
    ("leading zeros", b"", b"0" * PIECE),
    ("extension per chunk", b"", (b"1;" + b"e" * 4000 + b"\r\n \r\n") * 16),
]


@pytest.mark.parametrize("name, start, filler", FRAMING_FILLERS, ids=[f[0] for f in FRAMING_FILLERS])
def test_a_chunked_body_of_framing_is_refused_once_it_outgrows_its_bytes(
    tmp_path, caplog, server_reads, name, start, filler
):
    """Chunk extensions and leading zeros are framing that carries no body: aiohttp reads them on for as long as
    the body timeout lets the client send (GBs), where max_message_bytes bounds the body itself."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            answer, closed_after = await push(router.http_port, chunked_head() + start, filler, 6.0)
            assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
            assert b"unreadable_body" in answer and b"framing" in answer, answer[:600]
            assert closed_after < http_connections.REFUSAL_LINGER_S + 3, closed_after
            limit = http_connections.FRAMING_SLACK_BYTES + http_connections.REFUSAL_LINGER_BYTES + 2 * SLACK
            assert server_reads[0] <= limit, f"the server read {server_reads[0]} bytes, more than {limit}"
            assert fake.seen_ids == set() and not problems(caplog)

    asyncio.run(body())


def test_a_chunked_body_in_the_smallest_chunks_is_served(tmp_path, caplog):
    """Honest framing is never refused: chunks of one byte or a few, with an extension now and then."""

    async def body():
        rng = random.Random()
        prompt, padding = b"p" * rng.randrange(1, 1000), b" " * rng.randrange(0, 60_000)
        text = b'{"prompt": "%s",%s "max_tokens": 2}' % (prompt, padding)
        chunks, at = [], 0
        while at < len(text):
            size = min(rng.choice((1, 1, 1, 2, 3, rng.randrange(1, 64))), len(text) - at)
            extension = b";x=%d" % rng.randrange(100) if rng.random() < 0.1 else b""
            chunks.append(b"%x%s\r\n%s\r\n" % (size, extension, text[at : at + size]))
            at += size
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            writer.write(chunked_head().replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
            for i in range(0, len(chunks), 500):
                writer.write(b"".join(chunks[i : i + 500]))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            received = bytearray()
            await asyncio.wait_for(answers_until_closed(reader, received), 10)
            writer.close()
            assert received.startswith(b"HTTP/1.1 200 "), bytes(received[:400])
            assert not problems(caplog)

    asyncio.run(body())


@pytest.mark.parametrize("path", [COMPLETIONS, "/health"])
def test_an_http_1_0_request_with_transfer_encoding_ends_its_connection(tmp_path, caplog, path):
    """HTTP/1.0 has no Transfer-Encoding: RFC 9112 has such a message's framing treated as faulty (a sender may
    have kept part of it) and the connection closed after it; aiohttp served the keep-alive request behind it."""

    async def body():
        text = b'{"prompt": "x", "max_tokens": 2}'
        request = (
            f"{'POST' if path == COMPLETIONS else 'GET'} {path} HTTP/1.0\r\nHost: localhost\r\nConnection: keep-alive\r\nContent-Type: application/json\r\n".encode()
            + AUTH_LINE
            + b"Transfer-Encoding: chunked\r\n\r\n"
            + chunk(len(text)).replace(b"x" * len(text), text)
            + b"0\r\n\r\n"
            + b"GET /health HTTP/1.0\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n"
        )
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            writer.write(request)
            received = bytearray()
            answer = asyncio.create_task(answers_until_closed(reader, received))
            done, _ = await asyncio.wait([answer], timeout=http_connections.REFUSAL_LINGER_S + 3)
            answer.cancel()
            writer.transport.abort()
            assert received.count(b"HTTP/1.") == 1, bytes(received)
            assert received.startswith(b"HTTP/1.0 200 "), bytes(received)
            assert b"\r\nconnection: keep-alive\r\n" not in received.lower(), bytes(received)  # HTTP/1.0: it closes
            assert done, "the connection was kept for another request"
            assert not problems(caplog)

    asyncio.run(body())
