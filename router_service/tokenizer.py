"""Text in and out: the model's tokenizer.json (HF `tokenizers`), incremental detokenisation, stop sequences.

Streams must never emit broken or retracted text, which takes two hold-backs:
- IncrementalDetokenizer: a token can end inside a multi-byte UTF-8 character (byte-level BPE), and some
  tokenizers change the text of a token depending on what precedes it (SentencePiece's leading space).
  `tokenizers.decoders.DecodeStream` handles both: it decodes a short window that starts a few tokens back
  and emits only the text past what that window already produced, and only when it does not end in U+FFFD
  (an incomplete character) -- the technique of TGI's `decode_token` and vLLM's `detokenize_incrementally`.
- StopSequenceMatcher: text that might be the beginning of a stop sequence is held back until the next text
  proves it is not; when a stop sequence completes, the output ends right before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError

REPLACEMENT = "\ufffd"
# Texts up to this many characters tokenize inline (tens of microseconds); longer ones on a thread.
INLINE_MAX_CHARS = 1024
# Threads tokenizing long texts, leaving a core to the event loop on small machines.
TOKENIZER_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="colibri-tokenize")
    return _executor


# Prompt tokens the stream starts from: enough for every tokenizer's look-back (TGI uses 5).
PREFIX_WINDOW = 5
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
        if not p.is_file():
            raise ConfigError(f"tokenizer: {p} is not a file" if p.exists() else f"tokenizer: {p} not found")
        try:
            return cls(HFTokenizer.from_file(str(p)), str(p))
        except Exception as e:  # the library raises bare Exceptions with a message
            raise ConfigError(f"tokenizer: {p} is not a valid tokenizer.json: {e}") from None

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
        """A token's own bytes, read off its vocabulary string as the tokenizer's decoder reads it: a byte-level
        or byte-fallback token may be part of a character, which its decoded text shows as U+FFFD, and a
        SentencePiece token keeps its leading space. Other tokens: their decoded text's bytes."""
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
        return self.decode([token_id], skip_special_tokens=False).encode()

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
        return await asyncio.get_running_loop().run_in_executor(
            _pool(), self._encode_released, text, add_special_tokens
        )

    def _encode_released(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    async def encode_details_async(self, text: str, add_special_tokens: bool = True):
        """(ids, vocabulary strings, character offsets) of `text`; a long text on a thread, as encode_async."""
        if len(text) <= INLINE_MAX_CHARS:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        else:
            enc = await asyncio.get_running_loop().run_in_executor(
                _pool(), lambda: self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            )
        return list(enc.ids), list(enc.tokens), list(enc.offsets)

    async def decode_async(self, ids, skip_special_tokens: bool = True) -> str:
        """`decode` that never holds the event loop for long: many ids decode on a thread (`decode_batch`)."""
        ids = list(ids)
        if len(ids) <= INLINE_MAX_CHARS:
            return self.decode(ids, skip_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            _pool(), lambda: self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        )

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
        # a list or tuple is sliced, not copied whole first (half of this constructor's time at 2,112 ids)
        ids = prompt_ids if isinstance(prompt_ids, (list, tuple)) else list(prompt_ids)
        context = [int(i) for i in ids[-PREFIX_WINDOW:]]
        tail: list[int] = []
        while context and self._decode(context).endswith(REPLACEMENT):
            tail.insert(0, context.pop())
        self._stream = self._new_stream(context)
        self._emitted = context  # the last ids behind emitted text (flush decodes against them)
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
        prefix, text = self._decode(self._emitted), self._decode(self._emitted + self._held)
        self._held, self._held_from_prompt = [], 0
        return text[len(prefix) :] if text.startswith(prefix) else text

    def _step(self, token_id: int) -> str:
        self._held.append(token_id)
        try:
            text = self._stream.step(self._hf, token_id)
        except Exception as e:  # the library raises a bare Exception
            if "Invalid prefix" not in str(e):
                raise
            # A decoder rewrote text it had already produced: restart the window after the emitted text.
            held, self._held = self._held, []
            self._stream = self._new_stream(self._emitted)
            return "".join(self._step(i) for i in held)
        if text is None:
            return ""
        self._emitted, self._held = (self._emitted + self._held)[-PREFIX_WINDOW:], []
        self._held_from_prompt = 0
        return text


class StopSequenceMatcher:
    """Finds stop sequences in streamed text; holds back text that may still become one."""

    def __init__(self, stop_sequences=()):
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Adds new text; returns (text safe to emit now, whether a stop sequence completed)."""
        if self.stopped:
            return "", True
        if not self.stop_sequences:
            return text, False
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stop_sequences) if i >= 0]
        if hits:
            emit, self._pending, self.stopped = self._pending[: min(hits)], "", True
            return emit, True
        cut = self._partial_match_start(self._pending)
        emit, self._pending = self._pending[:cut], self._pending[cut:]
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
