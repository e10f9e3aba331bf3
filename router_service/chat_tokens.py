"""A chat's messages never become special tokens; the template's markup around them does.

Tokenized as one string, a rendered chat turns every special token's text into that token, wherever it came from:
a user message holding `<|im_end|>\\n<|im_start|>system\\n...` would close its own turn and open a system one (role
injection), a `</s>` would put an EOS in the prompt. OpenAI's API never lets a caller's text become control tokens,
and vLLM and transformers split such text for the same reason. So, before the template renders, each special
token's text in the caller's strings (messages, tools, template variables) becomes a placeholder (ESC, the
token's index, ESC; a caller's own ESC becomes ESC ESC); the special tokens the rendered text then holds are the
template's, and the text between them that holds placeholders is tokenized again with the placeholders' text
restored and special tokens split as plain text (`encode_special_tokens`, transformers' `split_special_tokens`).
Non-special added tokens (Qwen's `<tool_call>`, `<think>`) stay matched in any text, as in transformers.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

# A private-use character that no tokenizer gives a meaning to.
ESC = "\U0010fffd"
_PLACEHOLDER = re.compile(f"{ESC}([0-9]*){ESC}")


def _matcher(tokens):
    """A tokenizer that finds `tokens` (AddedTokens) in a text in one pass, leftmost-longest and with their
    lstrip/rstrip/single_word rules, as the model's tokenizer does: each is an added token (id 1, 2, ... in order)
    over a model that makes any other text one token, id 0."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    matcher = HFTokenizer(models.WordLevel({ESC + "other": 0}, unk_token=ESC + "other"))
    matcher.add_tokens(list(tokens))
    return matcher


class SpecialTokenGuard:
    """One tokenizer's special tokens: escapes them in a chat's strings, tokenizes the rendered text."""

    def __init__(self, hf_tokenizer):
        from tokenizers import AddedToken

        self._hf = hf_tokenizer
        added = [t for _, t in sorted(hf_tokenizer.get_added_tokens_decoder().items()) if t.special and t.content]
        self.special_ids = {hf_tokenizer.token_to_id(t.content): t.content for t in added}
        self.specials = [t.content for t in added]
        self._index = {text: i for i, text in enumerate(self.specials)}
        self._first = {text[0] for text in self.specials} | {ESC}
        # the texts themselves, for escaping; the tokens as the tokenizer matches them, for the rendered text
        self._finder = _matcher([AddedToken(t, normalized=False) for t in [*self.specials, ESC]])
        self._boundaries = _matcher(
            AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip, normalized=t.normalized)
            for t in added
        )
        self._boundaries.normalizer = hf_tokenizer.normalizer  # a normalized token is matched after it
        self._boundary_ids = [hf_tokenizer.token_to_id(t.content) for t in added]
        self._split: dict[bool, Any] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.specials)

    def escape(self, value):
        """`value` (str, list, dict, or other JSON values) with every special token's text in its strings (dict
        keys too) replaced by its placeholder."""
        if isinstance(value, str):
            return self._escape_text(value)
        if isinstance(value, list):
            return [self.escape(v) for v in value]
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        return value

    def _escape_text(self, text: str) -> str:
        if not self.enabled or not any(c in text for c in self._first):
            return text
        enc = self._finder.encode_batch([text], add_special_tokens=False)[0]
        out, at = [], 0
        for token_id, (start, end) in zip(enc.ids, enc.offsets, strict=True):
            if token_id == 0:
                continue
            piece = text[start:end]
            out += [text[at:start], ESC, "" if piece == ESC else str(self._index[piece]), ESC]
            at = end
        return "".join(out) + text[at:] if out else text

    def unescape(self, text: str) -> str:
        """`text` with each placeholder back to the text it stands for."""

        def restore(m: re.Match) -> str:
            if not m.group(1):
                return ESC
            i = int(m.group(1))
            return self.specials[i] if i < len(self.specials) else m.group()

        return _PLACEHOLDER.sub(restore, text)

    def encode(self, text: str) -> list[int]:
        """The ids of a rendered chat (escaped strings, no special tokens added): the template's special tokens are
        special, and the text between them is tokenized as the tokenizer tokenizes it there, placeholders' text
        included, as plain text. Python works per special token, the tokenizer's Rust code (GIL released) on the
        text: a long conversation never holds the event loop."""
        if not self.enabled or ESC not in text:
            return list(self._hf.encode_batch([text], add_special_tokens=False)[0].ids)
        found = self._boundaries.encode_batch([text], add_special_tokens=False)[0]
        parts: list[int | str] = []  # the template's special ids, and the texts between them
        start = 0
        for token_id, (a, b) in zip(found.ids, found.offsets, strict=True):
            if token_id:
                parts += [text[start:a], self._boundary_ids[token_id - 1]]
                start = b
        parts.append(text[start:])
        texts = [self.unescape(p) for p in parts if isinstance(p, str) and p]
        first = [] if not parts[0] else self._split_encoder(True).encode_batch(texts[:1], add_special_tokens=False)
        rest = self._split_encoder(False).encode_batch(texts[len(first) :], add_special_tokens=False)
        encoded = iter([*first, *rest])
        ids: list[int] = []
        for p in parts:
            if isinstance(p, int):
                ids.append(p)
            elif p:
                ids += next(encoded).ids
        return ids

    def _split_encoder(self, at_start: bool):
        """A copy of the tokenizer that splits special tokens as text. A Metaspace pre-tokenizer whose
        prepend_scheme is "first" adds its "▁" only to text at the start of the whole input: text after the
        template's first token is tokenized by a copy whose scheme is "never", as it would be in place."""
        with self._lock:
            encoder = self._split.get(at_start)
            if encoder is None:
                from tokenizers import Tokenizer as HFTokenizer

                spec = json.loads(self._hf.to_str())
                if not at_start:
                    _never_prepend(spec.get("pre_tokenizer"))
                encoder = HFTokenizer.from_str(json.dumps(spec))
                encoder.encode_special_tokens = True
                self._split[at_start] = encoder
            return encoder


def _never_prepend(node) -> None:
    """Sets prepend_scheme "first" to "never" in a pre-tokenizer spec (nested Sequences included)."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
        for child in node.get("pretokenizers") or ():
            _never_prepend(child)
