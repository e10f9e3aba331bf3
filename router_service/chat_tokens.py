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

# A private-use character that no tokenizer gives a meaning to.
ESC = "\U0010fffd"
_PLACEHOLDER = re.compile(f"{ESC}([0-9]*){ESC}")


class SpecialTokenGuard:
    """One tokenizer's special tokens: escapes them in a chat's strings, tokenizes the rendered text."""

    def __init__(self, hf_tokenizer):
        from tokenizers import AddedToken, models
        from tokenizers import Tokenizer as HFTokenizer

        self._hf = hf_tokenizer
        added = sorted(hf_tokenizer.get_added_tokens_decoder().items())
        self.special_ids = {i: t.content for i, t in added if t.special and t.content}
        self.specials = list(self.special_ids.values())
        self._index = {text: i for i, text in enumerate(self.specials)}
        self._first = {text[0] for text in self.specials} | {ESC}
        # Finds the special tokens' texts (leftmost-longest, as the tokenizer does) in one pass: a tokenizer of
        # just those, each as an added token over a model that maps any other text to one id.
        self._finder = HFTokenizer(models.WordLevel({ESC + "other": 0}, unk_token=ESC + "other"))
        self._finder.add_tokens([AddedToken(t, normalized=False) for t in [*self.specials, ESC]])
        self._split: dict[bool, object] = {}
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
        enc = self._finder.encode(text, add_special_tokens=False)
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
        special, the text between them as the tokenizer reads it, placeholders' text included, as plain text.
        Runs the tokenizer's Rust code through `encode_batch`, which releases the GIL."""
        if not self.enabled or ESC not in text:
            return list(self._hf.encode_batch([text], add_special_tokens=False)[0].ids)
        enc = self._hf.encode_batch([text], add_special_tokens=False)[0]
        ids: list[int] = []
        start, pending = 0, list[int]()
        for token_id, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            special = self.special_ids.get(token_id)
            # the template's special token (its offsets cover the spaces an lstrip/rstrip token takes); not an
            # unknown character the model wrote as `<unk>`
            if special is not None and special in text[a:b]:
                ids += self._segment(text, start, a, pending)
                ids.append(token_id)
                start, pending = b, []
            else:
                pending.append(token_id)
        return ids + self._segment(text, start, len(text), pending)

    def _segment(self, text: str, start: int, end: int, ids: list[int]) -> list[int]:
        """The ids of text[start:end], between two of the template's special tokens: `ids` (the whole text's
        tokens there) unless it holds placeholders, else its restored text tokenized with special tokens split."""
        piece = text[start:end]
        if ESC not in piece:
            return ids
        encoder = self._split_encoder(at_start=start == 0)
        return list(encoder.encode_batch([self.unescape(piece)], add_special_tokens=False)[0].ids)

    def _split_encoder(self, at_start: bool):
        """A copy of the tokenizer that splits special tokens as text. A Metaspace pre-tokenizer whose
        prepend_scheme is "first" adds its "▁" only to text at the start of the whole input: a piece after the
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
