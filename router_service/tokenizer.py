"""Text in and out: the model's tokenizer.json (HF `tokenizers`), incremental detokenisation, stop sequences.

Streams must never emit broken or retracted text, which takes two hold-backs:
- IncrementalDetokenizer: a token can end inside a multi-byte UTF-8 character (byte-level BPE), and some
  tokenizers change the text of a token depending on what precedes it (SentencePiece's leading space).
  `tokenizers.decoders.DecodeStream` handles both: it decodes a short window that starts a few tokens back
  and emits only the text past what that window already produced, and only when it does not end in U+FFFD
  (an incomplete character) -- the technique of TGI's `decode_token` and vLLM's `detokenize_incrementally`.
  The window starts on a character: Llama/Mixtral's ByteFallback decodes a run of `<0xNN>` tokens cut inside
  one as a U+FFFD per byte, its whole characters too. Where that rewrites text already emitted (an invalid byte
  after valid ones), the text past the emitted is measured by length, as vLLM does.
- StopSequenceMatcher: text that might be the beginning of a stop sequence is held back until the next text
  proves it is not; when a stop sequence completes, the output ends right before it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.files import read_setting_file
from router_service.call_deadline import run_in_time
from router_service.chat_tokens import ESC, SpecialTokenGuard
from router_service.thread_pools import HELPER_THREADS, LazyPool

REPLACEMENT = "\ufffd"
# Texts up to this many characters tokenize inline (tens of microseconds); longer ones on a thread.
INLINE_MAX_CHARS = 1024
# Threads tokenizing long texts, leaving a core to the event loop on small machines.
TOKENIZER_THREADS = HELPER_THREADS
_pool = LazyPool("colibri-tokenize", TOKENIZER_THREADS)


# Prompt tokens the stream starts from: enough for every tokenizer's look-back (TGI uses 5).
PREFIX_WINDOW = 5
# Tokens a window reaches back past PREFIX_WINDOW to start on a whole character (byte tokens: 3 at most).
CHAR_REACH = 3
RECENT_IDS = PREFIX_WINDOW + CHAR_REACH
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token (SentencePiece's, Mixtral's)


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet (tokenizers' ByteLevel): printable bytes stand for themselves, the others for
    the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


BYTE_OF_CHAR = _byte_level_chars()


@dataclass(frozen=True)
class _DecoderKind:
    """What a tokenizer.json decoder does to one token's string: byte-level characters to bytes, `<0xNN>` to a
    byte, string replacements (SentencePiece's `▁` to a space)."""

    byte_level: bool = False
    byte_fallback: bool = False
    replacements: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, decoder: dict) -> _DecoderKind:
        parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        types = {part.get("type") for part in parts}
        replacements = []
        for part in parts:
            pattern = part.get("pattern")
            if part.get("type") == "Replace" and isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
                replacements.append((pattern["String"], str(part.get("content", ""))))
            elif part.get("type") == "Metaspace":
                replacements.append((str(part.get("replacement", "▁")), " "))
        return cls("ByteLevel" in types, "ByteFallback" in types, tuple(replacements))


def _num_chars(value) -> int:
    """The characters of the strings in `value` (nested lists and dicts, keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_num_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(_num_chars(k) + _num_chars(v) for k, v in value.items())
    return 0


class Tokenizer:
    """The model's tokenizer: text <-> token ids."""

    def __init__(self, tokenizer, path: str = ""):
        self._tok = tokenizer
        self.path = path
        self._added: frozenset[int] | None = None  # token_bytes' lookups, read on first use
        self._decoder_kind: _DecoderKind | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer  # imported here: only text-serving routers need it

        p = Path(path)
        # opened without blocking: a FIFO there is refused saying so, never waited on
        text = read_setting_file(p, "tokenizer").decode("utf-8", "surrogateescape")
        try:
            tokenizer = cls(HFTokenizer.from_str(text), str(p))
        except Exception as e:  # the library raises bare Exceptions with a message
            raise ConfigError(f"tokenizer: {p} is not a valid tokenizer.json: {e}") from None
        # computed at start (a walk over the vocabulary, a matcher of the special tokens), not in a request
        tokenizer.continuation_byte_ids  # noqa: B018
        tokenizer.special_guard  # noqa: B018
        return tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> Tokenizer | None:
        """The directory's tokenizer.json, or None when the model has none (token-id prompts only)."""
        p = Path(model_dir) / "tokenizer.json"
        if not Path(model_dir).is_dir():
            raise ConfigError(f"--model: {model_dir} is not a directory")
        # Only a model with no tokenizer.json at all serves token ids alone: one that is there but is no file (a
        # directory, a dangling link) is a broken model directory, refused rather than silently served without text.
        return cls.from_file(p) if p.exists() or p.is_symlink() else None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar engine builds its token table from)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str) -> int | None:
        """The id of a whole token (a special token's text included), None when the vocabulary lacks it."""
        return self._tok.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (OpenAI's logprobs `bytes`), read off its vocabulary string as the tokenizer's
        decoder reads it: a byte-level or byte-fallback token may be part of a character (a `<0xE6>`, a piece of
        an emoji), and a SentencePiece word keeps its leading space. Other tokens (added ones, other decoders):
        the bytes of their text as it reads inside a text."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id not in self._added_ids():  # an added token's string is its text
            decoder = self._decoder()
            if decoder.byte_level and all(c in BYTE_OF_CHAR for c in piece):
                return bytes(BYTE_OF_CHAR[c] for c in piece)
            byte = BYTE_PIECE.fullmatch(piece) if decoder.byte_fallback else None
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            if decoder.replacements:
                for old, new in decoder.replacements:
                    piece = piece.replace(old, new)
                return piece.encode()
        return self._text_in_context(token_id).encode()

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads inside a text (special tokens included): its own bytes decoded, so a
        SentencePiece word keeps its leading space ("▁world" alone decodes as "world") and a token holding part
        of a character shows U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def _text_in_context(self, token_id: int) -> str:
        """The token decoded after an anchor token, since a decoder may drop a text's first space."""
        alone = self.decode([token_id], skip_special_tokens=False)
        anchor = self._anchor
        if anchor is None:
            return alone
        before, text = self.decode([anchor], False), self.decode([anchor, token_id], False)
        return text[len(before) :] if text.startswith(before) else alone

    @functools.cached_property
    def _anchor(self) -> int | None:
        """A plain token ("a") that _text_in_context decodes after; None if the vocabulary writes "a" otherwise."""
        ids = self.encode("a", add_special_tokens=False)
        return ids[-1] if ids and self.decode(ids[-1:]) == "a" else None

    def _added_ids(self) -> frozenset[int]:
        if self._added is None:
            self._added = frozenset(self._tok.get_added_tokens_decoder())
        return self._added

    def _decoder(self) -> _DecoderKind:
        if self._decoder_kind is None:
            decoder = self._tok.decoder
            self._decoder_kind = _DecoderKind.of(json.loads(decoder.__getstate__()) if decoder is not None else {})
        return self._decoder_kind

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` that never holds the event loop for long: a text past INLINE_MAX_CHARS is tokenized on one of
        the TOKENIZER_THREADS threads, through `encode_batch`, which releases the GIL (`encode` does not: an
        8 MB text would stall every other request on the loop for seconds). Callers bound the text's size."""
        if len(text) <= INLINE_MAX_CHARS:
            return self.encode(text, add_special_tokens)
        return await run_in_time(_pool(), "tokenizing", self._encode_released, text, add_special_tokens)

    def _encode_released(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    @functools.cached_property
    def special_guard(self) -> SpecialTokenGuard:
        """Keeps a chat's strings from becoming special tokens (router_service.chat_tokens)."""
        return SpecialTokenGuard(self._tok)

    async def escape_chat_async(self, value):
        """SpecialTokenGuard.escape of a chat's strings (nested lists and dicts), on a thread when they are long."""
        if _num_chars(value) <= INLINE_MAX_CHARS:
            return self.special_guard.escape(value)
        return await run_in_time(_pool(), "escaping", self.special_guard.escape, value)

    async def encode_chat_async(self, text: str) -> list[int]:
        """The ids of a chat template's output rendered from escaped strings (SpecialTokenGuard.escape), without
        added special tokens: only the template's own special tokens are special. Off the event loop unless short
        and free of placeholders (splitting needs copies of the tokenizer, made on first use)."""
        if ESC not in text or not self.special_guard.enabled:
            return await self.encode_async(text, add_special_tokens=False)
        return await run_in_time(_pool(), "tokenizing", self.special_guard.encode, text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    async def encode_details_async(self, text: str, add_special_tokens: bool = True):
        """(ids, vocabulary strings, character offsets) of `text`; a long text on a thread, as encode_async."""
        if len(text) <= INLINE_MAX_CHARS:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        else:
            enc = await run_in_time(
                _pool(), "tokenizing", lambda: self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            )
        return list(enc.ids), list(enc.tokens), list(enc.offsets)

    async def decode_async(self, ids, skip_special_tokens: bool = True) -> str:
        """`decode` that never holds the event loop for long: many ids decode on a thread (`decode_batch`)."""
        ids = list(ids)
        if len(ids) <= INLINE_MAX_CHARS:
            return self.decode(ids, skip_special_tokens)
        return await run_in_time(
            _pool(), "detokenizing", lambda: self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        )

    @functools.cached_property
    def continuation_byte_ids(self) -> frozenset[int]:
        """The ids of tokens whose bytes start inside a UTF-8 character: byte-fallback tokens `<0x80>` to `<0xBF>`,
        and with a ByteLevel decoder every token whose first character stands for such a byte (GPT-2's table)."""
        ids = {self._tok.token_to_id(f"<0x{b:02X}>") for b in range(0x80, 0xC0)}
        if self._decoder().byte_level:
            chars = {c for c, b in BYTE_OF_CHAR.items() if 0x80 <= b < 0xC0}
            ids.update(i for piece, i in self._tok.get_vocab(with_added_tokens=False).items() if piece[:1] in chars)
        ids.discard(None)
        return frozenset(ids)

    def detokenizer(self, prompt_ids) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, piece by piece, emitting only complete characters.

    The DecodeStream starts from the prompt's last tokens, so the first piece decodes in context. A prompt
    that ends inside a character starts it from the complete part and steps the rest like generated tokens:
    the character comes out whole once the generated tokens complete it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids=()):
        from tokenizers.decoders import DecodeStream  # imported here, like the tokenizer itself

        self._new_stream = lambda ids: DecodeStream(ids, skip_special_tokens=True)
        self._hf, self._decode = tokenizer._tok, tokenizer.decode
        self._continuations = tokenizer.continuation_byte_ids
        # a list or tuple is sliced, not copied whole first (half of this constructor's time at 2,112 ids)
        ids = prompt_ids if isinstance(prompt_ids, (list, tuple)) else list(prompt_ids)
        window = self._window([int(i) for i in ids[-RECENT_IDS:]])
        context, tail = list(window), list[int]()
        # the tokens of an incomplete last character (at most CHAR_REACH: more would be invalid bytes, not one)
        while context and len(tail) < CHAR_REACH and self._decode(context).endswith(REPLACEMENT):
            tail.insert(0, context.pop())
        if context and self._decode(context).endswith(REPLACEMENT):  # invalid bytes, not an incomplete character
            context, tail = list(window), list[int]()
        self._stream = self._stream_after(context)
        self._recent = context  # the last ids behind emitted text (flush decodes a window of them)
        self._held: list[int] = []  # ids stepped since the last emitted text
        self._held_from_prompt = 0
        for token_id in tail:
            self._step(token_id)
        self._held_from_prompt = len(self._held)

    def step(self, token_id: int) -> str:
        """Adds one token; returns the new complete text (often "", e.g. mid-character)."""
        return self._step(int(token_id))

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held (an incomplete character decodes as U+FFFD)."""
        if len(self._held) <= self._held_from_prompt:
            return ""
        text = self._past_emitted()
        self._held, self._held_from_prompt = [], 0
        return text

    def _window(self, ids: list[int]) -> list[int]:
        """The last PREFIX_WINDOW of `ids`, reaching back over continuation bytes (up to CHAR_REACH more) to start
        on a character: ByteFallback decodes a run of byte tokens cut inside a character as one U+FFFD per byte,
        its whole characters too, and the text after it would be measured against that."""
        start = max(0, len(ids) - PREFIX_WINDOW)
        reach = start - CHAR_REACH
        while start > max(0, reach) and ids[start] in self._continuations:
            start -= 1
        return ids[start:]

    def _stream_after(self, ids: list[int]) -> Any:
        """A DecodeStream continuing `ids`, or None (decoding without one, in _step) when their text ends in U+FFFD:
        a DecodeStream would emit such a context's text with the first new one."""
        return None if ids and self._decode(ids).endswith(REPLACEMENT) else self._new_stream(ids)

    def _past_emitted(self) -> str:
        """The text of the held ids after the emitted ones. Measured by length, not as a suffix: ByteFallback turns
        every byte of an invalid sequence into U+FFFD, so a lone continuation byte rewrites the valid bytes emitted
        before it, and what was emitted stays emitted (vLLM's rule too)."""
        emitted = self._window(self._recent)
        return self._decode(emitted + self._held)[len(self._decode(emitted)) :]

    def _step(self, token_id: int) -> str:
        self._held.append(token_id)
        text = None
        if self._stream is not None:
            try:
                text = self._stream.step(self._hf, token_id)
            except Exception as e:  # the library raises a bare Exception
                if "Invalid prefix" not in str(e):
                    raise
                # A decoder rewrote text already emitted: decoded here until the held ids end a character, then a
                # new window starts after them (one restarted after the emitted text would fail the same way).
                self._stream = None
        if self._stream is None:
            if self._decode(self._window(self._recent) + self._held).endswith(REPLACEMENT):
                return ""  # maybe an incomplete character: held like one
            text = self._past_emitted()
            self._stream = self._stream_after(self._window(self._recent + self._held))
        if text is None:
            return ""
        self._recent, self._held = (self._recent + self._held)[-RECENT_IDS:], []
        self._held_from_prompt = 0
        return text


class StopSequenceMatcher:
    """Finds stop sequences in streamed text; holds back text that may still become one."""

    def __init__(self, stop_sequences=()):
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        self._pending = ""
        self._unarmed = 0  # how much of the pending text came before the arming: no stop may end inside it
        self.stopped = False

    def push(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """Adds new text; returns (text safe to emit now, whether a stop sequence completed). Not armed (the
        request's min_new_tokens not reached yet), a stop sequence is emitted as text rather than ending the
        sequence; one that begins before the arming and completes after it still stops it."""
        if self.stopped:
            return "", True
        if not self.stop_sequences:
            return text, False
        self._pending += text
        if not armed:
            self._unarmed = len(self._pending)
        # a stop counts if it ends past the unarmed text (a held one of several may be whole already)
        starts = (self._pending.find(s, max(0, self._unarmed - len(s) + 1)) for s in self.stop_sequences)
        hits = [i for i in starts if i >= 0] if armed else []
        if hits:
            emit, self._pending, self.stopped = self._pending[: min(hits)], "", True
            return emit, True
        cut = self._partial_match_start(self._pending)
        emit, self._pending = self._pending[:cut], self._pending[cut:]
        self._unarmed = max(0, self._unarmed - cut)
        return emit, False

    def flush(self) -> str:
        """The held-back text, once the sequence ended for another reason."""
        emit, self._pending = ("" if self.stopped else self._pending), ""
        return emit

    def _partial_match_start(self, text: str) -> int:
        """The smallest i such that text[i:] is a proper prefix of some stop sequence (len(text) if none)."""
        longest = max(len(s) for s in self.stop_sequences)
        for i in range(max(0, len(text) - longest + 1), len(text)):
            tail = text[i:]
            if any(s.startswith(tail) for s in self.stop_sequences):
                return i
        return len(text)
