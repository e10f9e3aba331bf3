"""What router_service/http_guard.py decides from a request's headers before its body is read (the fake worker
behind the real HTTP front; raw sockets, for headers an HTTP client library would not send)."""

from __future__ import annotations

import asyncio
import gzip
import types
import zlib

import aiohttp.compression_utils
import aiohttp.http_parser
import pytest

from router_service import http_guard
from router_service.http_guard import decoded_codings
from router_service.http_json import parse_json
from router_service.openai_errors import ApiError
from tests.router_service.test_http_errors import (
    AUTH_LINE,
    COMPLETIONS,
    assert_openai_error,
    http_harness,
    post_bytes,
    problems,
    raw_exchange,
    rejected,
    status_and_body,
)

BODY = b'{"prompt": "x", "max_tokens": 1}'


@pytest.mark.parametrize(
    "codings",
    [
        [b"compress"],
        [b"x-compress"],  # compress's old name (RFC 9110): compress is not decoded either
        [b"frobnicate"],
        [b"gzip, gzip"],  # a stacked coding aiohttp does not undo
        [b"identity, gzip"],
        [b"gzip", b"frobnicate"],  # two headers: aiohttp's parser heeds the last, the request's headers the first
    ],
)
def test_a_content_encoding_the_server_does_not_decode_is_415(tmp_path, caplog, codings):
    """aiohttp decodes gzip and deflate and passes any other coding through as it came: a plain JSON body labelled
    with one was answered as if unlabelled, the header ignored, and a compressed one was a JSON error about its
    bytes. RFC 9110's answer is a 415 naming the codings it takes; the body is not read."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            headers = AUTH_LINE + b"".join(b"Content-Encoding: " + c + b"\r\n" for c in codings)
            raw = await raw_exchange(router.http_port, post_bytes(COMPLETIONS, BODY, headers))
            got, answer = status_and_body(raw)
            assert_openai_error(answer, 415, got, code="unsupported_content_encoding")
            assert answer["error"]["message"].startswith("Content-Encoding header:")
            head = raw.partition(b"\r\n\r\n")[0].lower()
            assert b"\r\naccept-encoding: gzip, deflate" in head and b"\r\nconnection: close" in head
            assert rejected(hooks, "invalid_argument") == 1
            assert not problems(caplog)

    asyncio.run(body())


@pytest.mark.parametrize(
    "coding,payload",
    # mtime=0: the gzip header holds no clock, so every xdist worker collects the same test ids
    [
        (b"gzip", gzip.compress(BODY, mtime=0)),
        (b"GZip", gzip.compress(BODY, mtime=0)),
        (b"x-gzip", gzip.compress(BODY, mtime=0)),  # gzip's old name: RFC 9110 asks to take it as gzip
        (b"X-GZIP", gzip.compress(BODY, mtime=0)),
        (b"identity", BODY),
        (b"", BODY),
    ],
    ids=["gzip", "GZip", "x-gzip", "X-GZIP", "identity", "none"],
)
def test_the_codings_it_decodes_are_served(tmp_path, caplog, coding, payload):
    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            headers = AUTH_LINE + b"Content-Encoding: " + coding + b"\r\n"
            got, answer = status_and_body(
                await raw_exchange(router.http_port, post_bytes(COMPLETIONS, payload, headers))
            )
            assert got == 200, answer
            assert answer["choices"][0]["finish_reason"] == "length"
            assert not problems(caplog)

    asyncio.run(body())


def test_the_codings_taken_follow_aiohttps_optional_packages():
    assert decoded_codings(False, False) == ("gzip", "deflate")
    assert decoded_codings(True, False) == ("gzip", "deflate", "br")
    assert decoded_codings(False, True) == ("gzip", "deflate", "zstd")
    assert decoded_codings(True, True) == ("gzip", "deflate", "br", "zstd")
    has = aiohttp.compression_utils
    assert http_guard.DECODED_CODINGS == decoded_codings(has.HAS_BROTLI, has.HAS_ZSTD)


@pytest.mark.parametrize(
    "encoding,payload",
    [
        (b"gzip", BODY),
        (b"deflate", BODY),
        (b"gzip", gzip.compress(BODY, mtime=0) + b"junk"),
        (b"gzip", gzip.compress(BODY, mtime=0)[:-8] + b"\0\0\0\0" + gzip.compress(BODY, mtime=0)[-4:]),  # its CRC
        (b"deflate", zlib.compress(BODY)[:-6]),  # cut short
    ],
    ids=["gzip-plain", "deflate-plain", "gzip-junk", "gzip-crc", "deflate-cut"],
)
def test_a_body_that_cannot_be_decoded_is_400(tmp_path, caplog, encoding, payload):
    """Content-Encoding: gzip on a plain body: aiohttp's decoding error escaped the handler as a 500; and a
    deflate stream cut short was found by aiohttp's parser after the body, a plain-text 400 of one word
    ("deflate"). Each is the front's 400 naming the header."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            got, answer = status_and_body(
                await raw_exchange(
                    router.http_port,
                    post_bytes(COMPLETIONS, payload, AUTH_LINE + b"Content-Encoding: " + encoding + b"\r\n"),
                )
            )
            assert_openai_error(answer, 400, got, code="unreadable_body")
            assert answer["error"]["message"].startswith("Content-Encoding header:"), answer
            assert encoding.decode() in answer["error"]["message"]
            assert not problems(caplog)

    asyncio.run(body())


def _without_optional_codecs(monkeypatch) -> None:
    """This process as if neither brotli nor a zstd module were installed (aiohttp's flags and the front's set)."""
    for module in (aiohttp.compression_utils, aiohttp.http_parser):
        monkeypatch.setattr(module, "HAS_BROTLI", False)
        monkeypatch.setattr(module, "HAS_ZSTD", False)
    monkeypatch.setattr(http_guard, "DECODED_CODINGS", decoded_codings(False, False))


@pytest.mark.parametrize("coding", [b"br", b"zstd", b"BR"])
@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions"])
def test_br_or_zstd_without_their_package_is_the_fronts_415(tmp_path, caplog, monkeypatch, coding, path):
    """Without brotli (zstd) installed, aiohttp's parser refused such a request itself, before the middleware: a
    plain-text 400 ("Can not decode content-encoding: brotli (br). Please install `Brotli`"), not the OpenAI
    error shape, and unauthenticated clients got it too. It is the front's 415 naming the codings it takes."""
    _without_optional_codecs(monkeypatch)

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            headers = AUTH_LINE + b"Content-Encoding: " + coding + b"\r\n"
            raw = await raw_exchange(router.http_port, post_bytes(path, BODY, headers))
            got, answer = status_and_body(raw)
            assert_openai_error(answer, 415, got, code="unsupported_content_encoding")
            message = answer["error"]["message"]
            assert message.startswith("Content-Encoding header:") and "send one of gzip, deflate, or none" in message
            assert b"\r\naccept-encoding: gzip, deflate\r\n" in raw.partition(b"\r\n\r\n")[0].lower()
            # without a token it is the 401, as for any other request
            raw = await raw_exchange(router.http_port, post_bytes(path, BODY, b"Content-Encoding: " + coding + b"\r\n"))
            assert_openai_error(status_and_body(raw)[1], 401, status_and_body(raw)[0], code="invalid_api_key")
            # a request without a body is not concerned
            get = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + AUTH_LINE + b"Content-Encoding: " + coding
            got, answer = status_and_body(await raw_exchange(router.http_port, get + b"\r\nConnection: close\r\n\r\n"))
            assert got == 200, answer
            assert not problems(caplog)

    asyncio.run(body())


class _FakeBrotli:
    """A stand-in for the brotli module's Decompressor (raw deflate inside): aiohttp's br path, packages or not."""

    def __init__(self):
        self._z = zlib.decompressobj(-15)

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        return self._z.decompress(self._z.unconsumed_tail + data, max_length)

    def is_finished(self) -> bool:
        return self._z.eof


class _FakeZstd:
    """A stand-in for compression.zstd's ZstdDecompressor (raw deflate inside)."""

    def __init__(self):
        self._z = zlib.decompressobj(-15)

    def decompress(self, data: bytes, max_length: int = -1) -> bytes:
        return self._z.decompress(self._z.unconsumed_tail + data, max(max_length, 0))

    @property
    def eof(self) -> bool:
        return self._z.eof

    @property
    def unused_data(self) -> bytes:
        return self._z.unused_data

    @property
    def needs_input(self) -> bool:
        return not self._z.unconsumed_tail


def _with_stand_in_codecs(monkeypatch) -> None:
    """br and zstd as aiohttp sees them with their packages installed, decoded by the stand-ins above."""
    for module in (aiohttp.compression_utils, aiohttp.http_parser):
        monkeypatch.setattr(module, "HAS_BROTLI", True)
        monkeypatch.setattr(module, "HAS_ZSTD", True)
    monkeypatch.setattr(
        aiohttp.compression_utils, "brotli", types.SimpleNamespace(Decompressor=_FakeBrotli), raising=False
    )
    monkeypatch.setattr(aiohttp.compression_utils, "ZstdDecompressor", _FakeZstd, raising=False)
    monkeypatch.setattr(http_guard, "DECODED_CODINGS", decoded_codings(True, True))


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize("coding", [b"br", b"zstd"])
def test_br_and_zstd_with_their_package_are_decoded(tmp_path, caplog, monkeypatch, coding):
    """With the package aiohttp looks for, the coding is taken and decoded by aiohttp's decoder, and a body that is
    not in it is the front's 400 (here a stand-in codec: the packages need not be installed)."""
    _with_stand_in_codecs(monkeypatch)

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            headers = AUTH_LINE + b"Content-Encoding: " + coding + b"\r\n"
            got, answer = status_and_body(
                await raw_exchange(router.http_port, post_bytes(COMPLETIONS, _raw_deflate(BODY), headers))
            )
            assert got == 200, answer
            got, answer = status_and_body(await raw_exchange(router.http_port, post_bytes(COMPLETIONS, BODY, headers)))
            assert_openai_error(answer, 400, got, code="unreadable_body")
            assert answer["error"]["message"].startswith("Content-Encoding header:")
            got, answer = status_and_body(
                await raw_exchange(
                    router.http_port, post_bytes(COMPLETIONS, BODY, AUTH_LINE + b"Content-Encoding: x\r\n")
                )
            )
            assert_openai_error(answer, 415, got, code="unsupported_content_encoding")
            assert "send one of gzip, deflate, br, zstd, or none" in answer["error"]["message"]
            assert not problems(caplog)

    asyncio.run(body())


def test_a_compressed_body_past_the_limit_is_413_as_it_decodes(tmp_path, caplog):
    """A small gzip body that decodes past max_message_bytes (a compression bomb) is refused once the decoded bytes
    pass the limit."""
    bomb = gzip.compress(b'{"prompt": "' + b"x" * 4_000_000 + b'"}', mtime=0)

    async def body():
        async with http_harness(tmp_path, max_message_bytes=65536) as (router, fake, base, hooks):
            headers = AUTH_LINE + b"Content-Encoding: gzip\r\n"
            got, answer = status_and_body(await raw_exchange(router.http_port, post_bytes(COMPLETIONS, bomb, headers)))
            assert_openai_error(answer, 413, got, code="request_too_large")
            assert router.http.bodies.held == 0
            assert not problems(caplog)

    asyncio.run(body())


def _post_chunked(transfer_encoding: bytes, payload: bytes, headers: bytes = b"") -> bytes:
    return (
        b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" + AUTH_LINE
        + headers + b"Transfer-Encoding: " + transfer_encoding + b"\r\nConnection: close\r\n\r\n"
        + b"%x\r\n" % len(payload) + payload + b"\r\n0\r\n\r\n"
    )  # fmt: skip


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"identity, chunked"])
def test_a_transfer_coding_besides_chunked_is_refused(tmp_path, caplog, coding):
    """aiohttp takes a Transfer-Encoding list ending in chunked and undoes only the chunking: a gzip body sent
    `Transfer-Encoding: gzip, chunked` was read as JSON with its gzip left on (a 400 about a byte 0x8b that is not
    UTF-8), a plain one labelled so was served as if the header said chunked. It is a 400 naming the header."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            for payload in (gzip.compress(BODY, mtime=0), BODY):
                got, answer = status_and_body(await raw_exchange(router.http_port, _post_chunked(coding, payload)))
                assert_openai_error(answer, 400, got, code="unsupported_transfer_encoding")
                assert answer["error"]["message"].startswith("Transfer-Encoding header:"), answer
            assert not problems(caplog)

    asyncio.run(body())


@pytest.mark.parametrize("coding", [b"chunked", b"Chunked"])
def test_a_chunked_body_is_served(tmp_path, caplog, coding):
    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            got, answer = status_and_body(await raw_exchange(router.http_port, _post_chunked(coding, BODY)))
            assert got == 200, answer
            gzipped = _post_chunked(coding, gzip.compress(BODY, mtime=0), b"Content-Encoding: gzip\r\n")
            got, answer = status_and_body(await raw_exchange(router.http_port, gzipped))
            assert got == 200, answer
            assert not problems(caplog)

    asyncio.run(body())


def _post_typed(content_types: list[bytes]) -> bytes:
    """A completions POST with exactly these Content-Type headers (none: no header)."""
    typed = b"".join(b"Content-Type: " + t + b"\r\n" for t in content_types)
    return (
        b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nHost: localhost\r\n" + AUTH_LINE + typed
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY) + BODY
    )  # fmt: skip


@pytest.mark.parametrize(
    "content_types",
    [
        [b"text/plain"],
        [b"text/plain;charset=UTF-8"],  # what a page's fetch() sends for a string body
        [b"Application/X-WWW-Form-Urlencoded"],  # curl -d's, and an HTML form's
        [b"multipart/form-data; boundary=x"],
    ],
)
def test_a_body_labelled_with_a_form_type_is_415(tmp_path, caplog, content_types):
    """A browser posts these three types to any site without asking it first: a web page could make its visitors
    spend this server's compute (or read its answers after a DNS rebinding) with a JSON text labelled as one.
    The body is not read, the answer names the header and what to send."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            raw = await raw_exchange(router.http_port, _post_typed(content_types))
            got, answer = status_and_body(raw)
            assert_openai_error(answer, 415, got, code="unsupported_media_type")
            message = answer["error"]["message"]
            assert message.startswith("Content-Type header:") and "application/json" in message
            head = raw.partition(b"\r\n\r\n")[0].lower()
            assert b"\r\naccept-post: application/json" in head and b"\r\nconnection: close" in head
            assert not fake.seen_ids  # nothing reached the worker
            assert not problems(caplog)

    asyncio.run(body())


@pytest.mark.parametrize(
    "content_types", [[], [b"application/json"], [b"application/json; charset=utf-8"], [b"application/octet-stream"]]
)
def test_json_and_types_a_browser_must_ask_for_are_served(tmp_path, caplog, content_types):
    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            got, answer = status_and_body(await raw_exchange(router.http_port, _post_typed(content_types)))
            assert got == 200, answer
            assert not problems(caplog)

    asyncio.run(body())


@pytest.mark.parametrize(
    "raw,where",
    [
        (b'{"prompt": "x", "max_tokens": 1, "max_tokens": 900}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "a", "role": "system"}]}', "messages[0].role"),
        (b'{"prompt": "x", "logit_bias": {"5": 100, "5": -100}}', "logit_bias.5"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true, "include_usage": false}}', None),
    ],
)
def test_a_body_repeating_a_key_is_refused(raw, where):
    """Python's json keeps a repeated key's last value and drops the others in silence; a proxy or gateway in
    front that reads the first (for quotas or policy) would see another request than the one served."""
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    error = e.value
    assert error.status == 400 and "appears twice" in error.message and "\n" not in error.message
    if where is not None:
        assert error.message.startswith(f"{where}: ") and error.param == where.partition("[")[0].partition(".")[0]


def test_equal_keys_in_different_objects_are_fine():
    raw = b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "n": 1}'
    assert parse_json(raw)["messages"][1]["content"] == "b"


@pytest.mark.parametrize(
    "headers,name",
    [
        (AUTH_LINE + AUTH_LINE, "Authorization"),
        (AUTH_LINE + b"Authorization: Bearer other\r\n", "Authorization"),
        (AUTH_LINE + b"X-Request-Id: a\r\nX-Request-Id: b\r\n", "X-Request-Id"),
    ],
    ids=["same-token-twice", "two-tokens", "two-request-ids"],
)
def test_a_single_valued_header_sent_twice_is_refused(tmp_path, caplog, headers, name):
    """The router read the first of two Authorization or X-Request-Id headers while a proxy in front may have
    checked or logged the other: the request is a 400 naming the header, and reaches no worker."""

    async def body():
        async with http_harness(tmp_path) as (router, fake, base, hooks):
            got, answer = status_and_body(await raw_exchange(router.http_port, post_bytes(COMPLETIONS, BODY, headers)))
            assert_openai_error(answer, 400, got)
            assert answer["error"]["message"] == f"{name} header: sent 2 times; a request carries one"
            assert not fake.seen_ids
            assert not problems(caplog)
            # one of each is served
            once = AUTH_LINE + b"X-Request-Id: a\r\n"
            got, answer = status_and_body(await raw_exchange(router.http_port, post_bytes(COMPLETIONS, BODY, once)))
            assert got == 200, answer

    asyncio.run(body())
