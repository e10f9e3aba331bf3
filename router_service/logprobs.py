"""Log-probabilities on the router: the worker's scored positions (packed arrays) as plain data for the fronts.

A generated token comes with its log-probability and, with top_logprobs, the most likely tokens of its
position; with prompt_logprobs every prompt token comes scored (the first with no log-probability: nothing
predicts it), gathered chunk by chunk while the prompt is prefilled and delivered with the first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Top = list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class Scored:
    """n scored positions: the scored token's log-probability (NaN: none) and the k most likely tokens."""

    logprobs: np.ndarray  # [n] float32
    top_ids: np.ndarray  # [n, k] int32 (-1: none)
    top_logprobs: np.ndarray  # [n, k] float32

    @classmethod
    def concat(cls, parts: list[Scored]) -> Scored:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("logprobs", "top_ids", "top_logprobs")))

    def __len__(self) -> int:
        return len(self.logprobs)

    def tops(self) -> list[Top]:
        """Each position's most likely tokens."""
        return [
            [(int(i), float(v)) for i, v in zip(ids, values) if i >= 0]
            for ids, values in zip(self.top_ids.tolist(), self.top_logprobs.tolist())
        ]


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token scored."""

    token_id: int
    logprob: float | None  # None for the prompt's first token
    top: Top


def prompt_logprobs(prompt_ids, scored: Scored) -> list[PromptLogprob]:
    """The prompt's tokens with their scores (one position per prompt token)."""
    if len(scored) != len(prompt_ids):
        raise ValueError(f"prompt scores: {len(scored)} positions for {len(prompt_ids)} prompt tokens")
    return [
        PromptLogprob(int(t), None if math.isnan(lp) else float(lp), top)
        for t, lp, top in zip(prompt_ids, scored.logprobs.tolist(), scored.tops())
    ]


class TokenTexts:
    """Each token's text as the fronts show scored tokens: as it reads inside a text (a SentencePiece word keeps
    its leading space; special tokens included; a piece of a character is U+FFFD), and its own bytes; cached,
    since the same ids recur at every position. Without a tokenizer: `token_id:N`, as OpenAI-compatible servers
    show an id they cannot decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.token_text(token_id) if self.tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own UTF-8 bytes, as OpenAI's `bytes` lists them: those of a character it holds only part of,
        where its text has U+FFFD, so a character split across tokens adds up from them."""
        value = self._bytes.get(token_id)
        if value is None:
            raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else self(token_id).encode()
            value = self._bytes[token_id] = list(raw)
        return value
