"""A request body's content coding undone step by step (router_service/http_guard.py's read_body uses it), with
aiohttp's own decompressors, checking what they do not: that the body is whole.

aiohttp's decoder (its parser's DeflateBuffer) takes a gzip stream cut off anywhere after its header, the 8 bytes
of its trailer (CRC-32 and length) included, and serves what it decoded so far; a gzip, zstd or brotli body cut
short or ending in a member's first bytes passes the same way. Here a body that claims a coding must hold one or
more complete streams of it and nothing else:

- gzip, deflate and zstd: one or more whole members back to back (`cat a.gz b.gz` is one gzip body, RFC 1952),
  each decoded in turn, at most MAX_MEMBERS of them; bytes after the last that do not start a member are an
  error, and so are a member's first bytes alone. An empty body holds no stream and is an error too.
- deflate: the zlib format (RFC 1950, what the coding names) or raw deflate (RFC 1951, what some clients send
  instead), told apart by the first byte as aiohttp does: a zlib header's low four bits are 8, which a raw
  stream's first block never has but with nonzero padding bits no encoder writes.
- br: one brotli stream, which has an end of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp.compression_utils import (
    MAX_DECOMPRESS_MEMBERS,
    BrotliDecompressor,
    TooManyMembersError,
    ZLibDecompressor,
    ZSTDDecompressor,
)
from aiohttp.http_exceptions import ContentEncodingError

# The most members (gzip's, zlib's, zstd frames) one body may hold: aiohttp's own cap on those decoded in one call,
# held over the whole body, so that how the body is cut into reads makes no difference. Each member costs a fresh
# decompressor (about 10 µs): a body of empty 20-byte gzip members took 9 s of the event loop per 16 MiB. Real
# bodies hold one, a few after `cat`, a 64 KiB block each from bgzip (256 in 16 MiB).
MAX_MEMBERS = MAX_DECOMPRESS_MEMBERS


class TooManyMembers(ContentEncodingError):
    """A body of more than MAX_MEMBERS members."""


def compressed_limit(max_bytes: int) -> int:
    """The most bytes a compressed body decoding to at most `max_bytes` may take: what a coding adds to data it
    cannot shrink (zstd's most, about 1/256, doubled) and 64 KiB for headers, file names and members. No encoder
    writes more; without a bound a client could send bytes that decode to nothing (empty deflate blocks, a gzip
    header's endless file name) for as long as the body timeout lets it."""
    return max_bytes + max_bytes // 128 + 65536


class _Member:
    """One member's raw decompressor (zlib's or zstd's), noting whether it was given any input: aiohttp's handler
    starts a fresh one each time a member ends, so a body is whole when the current one has ended or was never
    fed."""

    def __init__(self, inner) -> None:
        self.inner, self.begun = inner, False

    def decompress(self, data, max_length: int) -> bytes:
        self.begun = self.begun or len(data) > 0
        return self.inner.decompress(data, max_length)

    def __getattr__(self, name: str):  # eof, unused_data, unconsumed_tail, needs_input, flush
        return getattr(self.inner, name)


class _Members:
    """What aiohttp's concatenating handlers (zlib's, zstd's) are given to tell a whole body: `members` started."""

    members = 0
    _decompressor: Any  # a _Member

    def _new_decompressor(self) -> Any:
        self.members += 1
        return _Member(super()._new_decompressor())  # type: ignore[misc]

    @property
    def begun(self) -> int:
        """The members given input so far."""
        return self.members - (not self._decompressor.begun)

    @property
    def whole(self) -> bool:
        """The last member ended, or none was begun after one that ended."""
        current = self._decompressor
        return bool(current.eof) or (not current.begun and self.members > 1)


class _ZLib(_Members, ZLibDecompressor):
    pass


class _Zstd(_Members, ZSTDDecompressor):
    pass


class _Brotli(BrotliDecompressor):
    @property
    def whole(self) -> bool:
        return bool(self._obj.is_finished())


class BodyDecoder:
    """`encoding`'s decoder (gzip, deflate, br or zstd): `feed` each piece of the body as it arrives, then
    `finish`. Raises ContentEncodingError for bytes that are not in the coding and, at `finish`, for a body that
    is not whole."""

    def __init__(self, encoding: str, step_bytes: int):
        self.encoding, self.step_bytes = encoding, step_bytes
        self._handler: _ZLib | _Zstd | _Brotli | None = None

    def _start(self, first: int):
        if self.encoding == "br":
            return _Brotli()
        if self.encoding == "zstd":
            return _Zstd()
        if self.encoding == "gzip":
            return _ZLib(encoding="gzip")
        return _ZLib(encoding="deflate", suppress_deflate_header=first & 0xF != 8)

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """The decoded bytes `chunk` completes, a step of at most `step_bytes` at a time: a small body cannot
        balloon at once, and the caller may stop (a size limit) between steps."""
        if not chunk:
            return
        try:
            if self._handler is None:
                self._handler = self._start(chunk[0])
            handler = self._handler
            out = handler.decompress_sync(chunk, max_length=self.step_bytes)
            while True:
                if isinstance(handler, _Members) and handler.begun > MAX_MEMBERS:
                    raise TooManyMembersError()
                if out:
                    yield out
                if not handler.data_available:
                    return
                out = handler.decompress_sync(b"", max_length=self.step_bytes)
        except ContentEncodingError:
            raise
        except TooManyMembersError:
            raise TooManyMembers(f"more than {MAX_MEMBERS} {self.encoding} members") from None
        except Exception:  # zlib.error, the codec's own errors, too many members in one piece
            raise ContentEncodingError(f"not {self.encoding}") from None

    def finish(self) -> None:
        """Raises ContentEncodingError unless the body held whole streams of the coding (an empty one holds none)."""
        if self._handler is None or not self._handler.whole:
            raise ContentEncodingError(f"not whole {self.encoding}")
