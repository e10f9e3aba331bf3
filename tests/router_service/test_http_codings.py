"""Compressed request bodies as a hostile client sends them (router_service/http_codings.py behind the real HTTP
front, the fake worker behind it): streams cut short, concatenated members, trailing bytes, both deflate forms,
the decoded-size limit at its boundary, a trickled body, and the body budget after each refusal."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest

from router_service.http_codings import MAX_MEMBERS, compressed_limit
from router_service.http_guard import DECODE_STEP_BYTES
from tests.router_service.test_http_errors import (
    AUTH_LINE,
    COMPLETIONS,
    assert_openai_error,
    http_harness,
    post_bytes,
    problems,
    raw_exchange,
    status_and_body,
)
from tests.router_service.test_http_guard import _raw_deflate, _with_stand_in_codecs

BODY = b'{"prompt": "x", "max_tokens": 1}'
GZ = gzip.compress(BODY, mtime=0)  # mtime=0: the same bytes (and test ids) in every xdist worker
ZL = zlib.compress(BODY)


async def _post(router, coding: bytes, payload: bytes, headers: bytes = b"") -> tuple[int, dict | None]:
    head = AUTH_LINE + headers + (b"Content-Encoding: " + coding + b"\r\n" if coding else b"")
    return status_and_body(await raw_exchange(router.http_port, post_bytes(COMPLETIONS, payload, head)))


def _assert_unreadable(got: int, answer, coding: bytes) -> None:
    assert_openai_error(answer, 400, got, code="unreadable_body")
    message = answer["error"]["message"]
    assert message.startswith("Content-Encoding header:") and coding.decode() in message, answer


NOT_WHOLE = {
    "gzip-no-trailer": (b"gzip", GZ[:-8]),
    "gzip-half-trailer": (b"gzip", GZ[:-3]),
    "gzip-cut-mid": (b"gzip", GZ[:15]),
    "gzip-header-only": (b"gzip", GZ[:10]),
    "gzip-empty": (b"gzip", b""),
    "gzip-then-member-cut": (b"gzip", GZ + GZ[:12]),
    "gzip-then-magic-byte": (b"gzip", GZ + b"\x1f"),
    "gzip-then-zeros": (b"gzip", GZ + b"\0" * 8),
    "gzip-then-junk": (b"gzip", GZ + b"junk"),
    "zlib-no-adler": (b"deflate", ZL[:-4]),
    "raw-deflate-cut": (b"deflate", _raw_deflate(BODY)[:-2]),
    "zlib-then-junk": (b"deflate", ZL + b"x"),
    "deflate-empty": (b"deflate", b""),
}


def test_a_body_that_is_not_whole_streams_of_its_coding_is_400(tmp_path, caplog):
    """aiohttp's decoder does not check that a gzip stream ends: one cut off in its 8-byte trailer (CRC-32 and
    length) was served, one cut off earlier was parsed as the JSON it held so far, and a whole member followed by
    another's first bytes was served as the first alone; an empty body labelled with a coding was read as empty.
    Each is the front's 400 naming Content-Encoding, and the body budget is whole again after it."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for name, (coding, payload) in NOT_WHOLE.items():
                got, answer = await _post(router, coding, payload)
                assert got == 400, (name, answer)
                _assert_unreadable(got, answer, coding)
                assert router.http.bodies.held == 0, name
            assert not fake.seen_ids
            assert not problems(caplog)

    asyncio.run(body())


def _split(data: bytes, at: int) -> bytes:
    packer = zlib.compressobj(wbits=31)
    return gzip.compress(data[:at], mtime=0) + packer.compress(data[at:]) + packer.flush()


def test_whole_bodies_in_every_form_are_served(tmp_path, caplog):
    """gzip members back to back (`cat a.gz b.gz`, RFC 1952) are decoded whole, a request split across them; so
    are zlib streams; deflate is taken zlib-wrapped (RFC 1950) or raw (RFC 1951); the coding's name in any case
    and padded with blanks; an empty Content-Encoding and identity are no coding."""
    served = [
        (b"gzip", _split(BODY, 10)),
        (b"gzip", _split(BODY, 0) + gzip.compress(b"", mtime=0)),  # empty members too
        (b"deflate", zlib.compress(BODY[:10]) + zlib.compress(BODY[10:])),
        (b"deflate", ZL),
        (b"deflate", _raw_deflate(BODY)),
        (b"GZIP", GZ),
        (b"  gzip\t", GZ),
        (b"DeFlate", ZL),
        (b"identity", BODY),
        (b"", BODY),
    ]

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for coding, payload in served:
                head = AUTH_LINE + b"Content-Encoding:" + coding + b"\r\n"
                got, answer = status_and_body(
                    await raw_exchange(router.http_port, post_bytes(COMPLETIONS, payload, head))
                )
                assert got == 200, (coding, payload, answer)
            assert router.http.bodies.held == 0
            assert not problems(caplog)

    asyncio.run(body())


def test_stacked_or_listed_codings_are_415(tmp_path, caplog):
    """A list of codings is legal HTTP (applied in order), but the front decodes one: each list is the 415 naming
    the header, the body unread, whatever the list holds."""
    lists = [b"gzip,", b", gzip", b"gzip, identity", b"deflate, gzip", b"identity, identity", b"gzip gzip"]

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for coding in lists:
                got, answer = await _post(router, coding, gzip.compress(GZ, mtime=0))
                assert_openai_error(answer, 415, got, code="unsupported_content_encoding")
                assert answer["error"]["message"].startswith("Content-Encoding header:"), answer
            assert router.http.bodies.held == 0
            assert not problems(caplog)

    asyncio.run(body())


@pytest.mark.parametrize("coding", [b"br", b"zstd"])
def test_br_and_zstd_bodies_must_be_whole(tmp_path, caplog, monkeypatch, coding):
    """The same for br and zstd (stand-in codecs: the packages need not be installed): a stream cut short or an
    empty body is the 400; zstd frames back to back are decoded whole."""
    _with_stand_in_codecs(monkeypatch)
    whole = _raw_deflate(BODY)

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for payload in (whole[:-2], whole[:1], b""):
                got, answer = await _post(router, coding, payload)
                _assert_unreadable(got, answer, coding)
                assert router.http.bodies.held == 0
            got, answer = await _post(router, coding, whole)
            assert got == 200, answer
            if coding == b"zstd":
                got, answer = await _post(router, coding, _raw_deflate(BODY[:9]) + _raw_deflate(BODY[9:]))
                assert got == 200, answer
            assert not problems(caplog)

    asyncio.run(body())


def _padded(size: int) -> bytes:
    """A request of exactly `size` bytes (blanks after its JSON): thousands to one under gzip."""
    return BODY + b" " * (size - len(BODY))


@pytest.mark.parametrize("limit", [1024, DECODE_STEP_BYTES, 3 * DECODE_STEP_BYTES + 7])
def test_the_decoded_size_limit_holds_at_its_boundary(tmp_path, caplog, limit):
    """--max-message-bytes counts decoded bytes: a gzip body that decodes to exactly the limit is served, one a byte
    over is the 413 (at a decoding step's edge too), and either way the body budget is whole after it."""

    async def body():
        async with http_harness(tmp_path, max_message_bytes=limit) as (router, fake, base, hooks):
            for coding, pack in ((b"gzip", lambda b: gzip.compress(b, mtime=0)), (b"deflate", zlib.compress)):
                got, answer = await _post(router, coding, pack(_padded(limit)))
                assert got == 200, answer
                got, answer = await _post(router, coding, pack(_padded(limit + 1)))
                assert_openai_error(answer, 413, got, code="request_too_large")
                # two members that reach the limit only together
                half = limit // 2
                got, answer = await _post(router, coding, pack(_padded(limit)[:half]) + pack(b" " * (limit + 1 - half)))
                assert_openai_error(answer, 413, got, code="request_too_large")
                assert router.http.bodies.held == 0
            assert not problems(caplog)

    asyncio.run(body())


def test_a_body_corrupt_past_its_first_megabyte_releases_its_reservation(tmp_path, caplog):
    """A gzip body that decodes a megabyte (the reservation grown to hold it) before its bytes go bad is the 400,
    and what it reserved is released."""
    good = gzip.compress(_padded(1_000_000), mtime=0)
    corrupt = good[:-20] + bytes(b ^ 0x55 for b in good[-20:])

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            got, answer = await _post(router, b"gzip", corrupt)
            _assert_unreadable(got, answer, b"gzip")
            assert router.http.bodies.held == 0
            assert not problems(caplog)

    asyncio.run(body())


def test_a_trickled_or_overdeclared_compressed_body_meets_the_body_timeout(tmp_path, caplog):
    """A gzip body sent a byte at a time, or one declaring many more bytes than it sends, is the 408 once
    http_body_timeout_s has passed, and releases what it reserved."""

    async def trickle(port: int, payload: bytes, length: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # the answer alone, not the connection's end: a refused body's connection is closed behind the answer, and
        # a byte this loop sends after that close is answered with a reset that would lose what was not read yet
        answer = asyncio.ensure_future(asyncio.wait_for(_one_answer(reader), 10))
        head = post_bytes(COMPLETIONS, b"", AUTH_LINE + b"Content-Encoding: gzip\r\n")
        try:
            writer.write(head.replace(b"Content-Length: 0", b"Content-Length: %d" % length))
            for byte in payload:
                await asyncio.wait([answer], timeout=0.05)
                if answer.done():
                    break
                writer.write(bytes([byte]))
            return await answer
        finally:
            writer.close()

    async def body():
        async with http_harness(tmp_path, http_body_timeout_s=0.5) as (router, fake, base, hooks):
            for payload, length in ((GZ, len(GZ)), (GZ, 1_000_000)):
                got, answer = status_and_body(await trickle(router.http_port, payload, length))
                assert_openai_error(answer, 408, got, code="request_timeout")
                assert router.http.bodies.held == 0
            assert not fake.seen_ids
            assert not problems(caplog)

    asyncio.run(body())


def _inflated(size: int) -> bytes:
    """BODY as a raw deflate stream of exactly `size` bytes: empty stored blocks (5 bytes each, decoding to nothing)
    after the data, filler any encoder could write but none does at length."""
    packer = zlib.compressobj(wbits=-15)
    data, end = packer.compress(BODY) + packer.flush(zlib.Z_SYNC_FLUSH), packer.flush()
    blocks, extra = divmod(size - len(data) - len(end), 5)
    assert extra == 0 or blocks > 0
    filler = b"\x00\x00\x00\xff\xff" * (blocks - (extra > 0))
    if extra:  # one stored block of `extra` bytes more: 5 + extra, data of its own, so split the last empty one
        filler += b"\x00" + (extra).to_bytes(2, "little") + (0xFFFF ^ extra).to_bytes(2, "little") + b" " * extra
    return data + filler + end


async def _answer(port: int, data: bytes) -> bytes:
    """The answer to `data`, read without waiting for the connection to close (aiohttp may linger, reading on the
    body the request announced)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(_one_answer(reader), 5)
    finally:
        writer.close()


async def _one_answer(reader: asyncio.StreamReader) -> bytes:
    """One HTTP answer read off `reader`: its head, then the Content-Length bytes of its body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0])
    return head + await reader.readexactly(length)


def test_compressed_bytes_past_what_any_coding_makes_are_413(tmp_path, caplog):
    """A compressed body's bytes were not bounded, only what they decode to: a client could send bytes that decode
    to nothing (empty deflate blocks) for as long as the body timeout let it, and a Content-Length of a gigabyte
    with Content-Encoding was read on. Past compressed_limit(--max-message-bytes) either is the 413, the declared
    length before anything is read; a body of exactly that many bytes is served."""
    limit = 4096
    most = compressed_limit(limit)

    async def body():
        async with http_harness(tmp_path, max_message_bytes=limit) as (router, fake, base, hooks):
            got, answer = await _post(router, b"deflate", _inflated(most))
            assert got == 200, answer
            got, answer = await _post(router, b"deflate", _inflated(most + 1))
            assert_openai_error(answer, 413, got, code="request_too_large")
            assert f"larger than {most} bytes" in answer["error"]["message"]
            head = post_bytes(COMPLETIONS, b"", AUTH_LINE + b"Content-Encoding: gzip\r\n")
            for length in (most + 1, 10**9):
                declared = head.replace(b"Content-Length: 0", b"Content-Length: %d" % length)
                got, answer = status_and_body(await _answer(router.http_port, declared + GZ))
                assert_openai_error(answer, 413, got, code="request_too_large")
            assert router.http.bodies.held == 0
            assert not problems(caplog)

    asyncio.run(body())


async def _in_parts(port: int, request: bytes, parts: int) -> bytes:
    """`request` sent in `parts` writes a moment apart, so that its body reaches the server in as many reads."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        step = -(-len(request) // parts)
        for at in range(0, len(request), step):
            writer.write(request[at : at + step])
            await writer.drain()
            await asyncio.sleep(0.02)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def test_a_body_of_more_members_than_the_cap_is_400_however_it_arrives(tmp_path, caplog):
    """aiohttp caps the members it decodes in one call (1024), not in a body: a body of 1025 gzip members was a
    400 saying it was corrupt when they came in one read and served when they came in many, and a body of empty
    members cost the event loop seconds per megabytes. A body holds at most MAX_MEMBERS members however its bytes
    arrive; past them it is the 400 saying so."""
    empty = gzip.compress(b"", mtime=0)

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for count in (MAX_MEMBERS, MAX_MEMBERS + 1):
                members = [GZ] + [empty] * (count - 1)
                request = post_bytes(COMPLETIONS, b"".join(members), AUTH_LINE + b"Content-Encoding: gzip\r\n")
                for parts in (1, 8):  # in one read; in reads of fewer members than aiohttp's cap
                    got, answer = status_and_body(await _in_parts(router.http_port, request, parts))
                    if count == MAX_MEMBERS:
                        assert got == 200, answer
                        continue
                    assert_openai_error(answer, 400, got, code="unreadable_body")
                    assert answer["error"]["message"] == (
                        f"Content-Encoding header: the body holds more than {MAX_MEMBERS} gzip members"
                    )
                    assert router.http.bodies.held == 0
            assert not problems(caplog)

    asyncio.run(body())


def test_a_compressed_body_the_budget_cannot_hold_as_it_decodes_is_503_and_releases_its_share(tmp_path, caplog):
    """A gzip body reserves its compressed length, then grows its share as it decodes: past what the body budget
    has left (another body holding most of it) it is the 503, and what it had grown to is released at once."""
    limit = 4 * DECODE_STEP_BYTES
    held_elsewhere = 3 * DECODE_STEP_BYTES
    settings = dict(max_message_bytes=limit, http_max_body_bytes_in_flight=limit)

    async def body():
        async with http_harness(tmp_path, **settings) as (router, fake, base, hooks):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port)
            try:  # a plain body that reserves its Content-Length and sends nothing
                writer.write(
                    post_bytes(COMPLETIONS, b"", AUTH_LINE).replace(b"Length: 0", b"Length: %d" % held_elsewhere)
                )
                for _ in range(100):
                    if router.http.bodies.held == held_elsewhere:
                        break
                    await asyncio.sleep(0.02)
                assert router.http.bodies.held == held_elsewhere
                got, answer = await _post(router, b"gzip", gzip.compress(_padded(2 * DECODE_STEP_BYTES), mtime=0))
                assert got == 503 and answer["error"]["code"] == "too_many_body_bytes", answer
                assert router.http.bodies.held == held_elsewhere
            finally:
                writer.close()
            for _ in range(100):
                if router.http.bodies.held == 0:
                    break
                await asyncio.sleep(0.02)
            assert router.http.bodies.held == 0
            assert not problems(caplog)

    asyncio.run(body())
