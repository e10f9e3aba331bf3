"""Log-probabilities the worker reports: each chosen token's and the top n of its position, for sampled
tokens and (when asked) prompt tokens.

They are of the model's own distribution -- log_softmax of the raw logits, before penalties, stop-id
suppression, temperature and top-k/top-p -- as vLLM reports them by default (its raw_logprobs mode): the
numbers say what the model thinks of the text, whatever the sampling settings. A constrained sequence's sampled
tokens are the exception, as in vLLM: its grammar mask is applied first, so they are of the constrained
distribution (the disallowed tokens at -inf, never among the top tokens). Vectorised over the rows of a
step; top ids are ordered by log-probability, ties by the lower id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """n positions: the chosen token's log-probability and the k most likely tokens of each."""

    logprobs: np.ndarray  # [n] float32 (NaN: no distribution, the prompt's first token)
    top_ids: np.ndarray  # [n, k] int32, most likely first
    top_logprobs: np.ndarray  # [n, k] float32

    def __len__(self) -> int:
        return len(self.logprobs)

    @classmethod
    def empty(cls, k: int) -> TokenLogprobs:
        return cls(np.zeros(0, np.float32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32))

    @classmethod
    def concat(cls, parts: list[TokenLogprobs]) -> TokenLogprobs:
        return cls(
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.top_ids for p in parts]),
            np.concatenate([p.top_logprobs for p in parts]),
        )


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    """[n, V] float32 log-probabilities (the normaliser summed in float64)."""
    x = np.asarray(logits, np.float32)
    shifted = x - x.max(axis=1, keepdims=True)
    norm = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64)).astype(np.float32)
    return shifted - norm[:, None]


def top_k_rows(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n, k] int32, values [n, k] float32) of each row's k largest values, largest first, ties by id."""
    n, vocab = logprobs.shape
    k = min(k, vocab)
    if k == 0 or n == 0:
        return np.zeros((n, k), np.int32), np.zeros((n, k), np.float32)
    part = np.argpartition(-logprobs, k - 1, axis=1)[:, :k] if k < vocab else np.tile(np.arange(vocab), (n, 1))
    values = np.take_along_axis(logprobs, part, axis=1)
    if k < vocab:  # argpartition keeps arbitrary ids among values tied at the k-th place: keep the lowest
        kth = values.min(axis=1, keepdims=True)
        for r in np.flatnonzero((logprobs == kth).sum(axis=1) > (values == kth).sum(axis=1)):
            above = np.flatnonzero(logprobs[r] > kth[r])
            part[r] = np.concatenate([above, np.flatnonzero(logprobs[r] == kth[r])[: k - len(above)]])
            values[r] = logprobs[r, part[r]]
    order = np.lexsort((part, -values), axis=1)
    ids = np.take_along_axis(part, order, axis=1)
    return ids.astype(np.int32), np.take_along_axis(values, order, axis=1).astype(np.float32)


def token_logprobs(logits: np.ndarray, tokens: np.ndarray, k: int) -> TokenLogprobs:
    """Row i's raw logits [n, V] scored for tokens[i], with its top k."""
    if len(tokens) == 0:
        return TokenLogprobs.empty(k)
    logp = log_softmax_rows(logits)
    chosen = logp[np.arange(len(tokens)), np.asarray(tokens, np.int64)]
    ids, values = top_k_rows(logp, k)
    return TokenLogprobs(chosen.astype(np.float32), ids, values)


def prompt_logprobs(rows: np.ndarray, previous_row: np.ndarray | None, tokens: np.ndarray, k: int) -> TokenLogprobs:
    """One prompt chunk's tokens scored: token 0 under `previous_row` (the last position of the chunk before;
    None for the prompt's first token: NaN, top ids -1), token j > 0 under rows[j - 1].
    rows: [len(tokens) - 1, V] raw logits of the chunk's positions but its last."""
    if previous_row is None:
        kk = min(k, rows.shape[1])
        first = TokenLogprobs(
            np.full(1, np.nan, np.float32), np.full((1, kk), -1, np.int32), np.full((1, kk), np.nan, np.float32)
        )
    else:
        first = token_logprobs(previous_row[None, :], tokens[:1], k)
    return TokenLogprobs.concat([first, token_logprobs(rows, tokens[1:], k)]) if len(tokens) > 1 else first


class StepScores:
    """One step's log-probability work, scored together once the step's logits exist: sampled tokens (one row
    each, one log_softmax over all of them) and prompt chunks (their positions' rows)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._sampled: list[tuple[object, int, int, int]] = []  # (key, row, token, k)
        self._prompts: list[tuple[object, np.ndarray, np.ndarray | None, np.ndarray, int]] = []

    def __bool__(self) -> bool:
        return bool(self._sampled or self._prompts)

    def sampled(self, key, row: int, token: int, k: int) -> None:
        self._sampled.append((key, row, token, k))

    def prompt(self, key, rows: np.ndarray, previous_row: np.ndarray | None, tokens: np.ndarray, k: int) -> None:
        """`rows`: the logits rows of the chunk's positions but its last (see prompt_logprobs)."""
        self._prompts.append((key, rows, previous_row, tokens, k))

    def run(self, logits) -> tuple[dict, dict]:
        """({key: TokenLogprobs of its sampled token}, {key: TokenLogprobs of its prompt chunk}); `logits` is the
        step's Logits (raw rows by index)."""
        sampled = {}
        if self._sampled:
            k_max = max(k for _, _, _, k in self._sampled)
            scored = token_logprobs(
                np.stack([_constrained(logits, row) for _, row, _, _ in self._sampled]),
                np.array([t for _, _, t, _ in self._sampled]),
                k_max,
            )
            for i, (key, _, _, k) in enumerate(self._sampled):
                # a grammar may allow fewer than k tokens: the disallowed (-inf) are not listed
                kk = min(k, scored.top_ids.shape[1], int(np.isfinite(scored.top_logprobs[i]).sum()))
                sampled[key] = TokenLogprobs(
                    scored.logprobs[i : i + 1], scored.top_ids[i : i + 1, :kk], scored.top_logprobs[i : i + 1, :kk]
                )
        prompts = {}
        for key, rows, previous_row, tokens, k in self._prompts:
            block = np.stack([logits[r] for r in rows]) if len(rows) else np.zeros((0, self.vocab_size), np.float32)
            prompts[key] = prompt_logprobs(block, previous_row, tokens, k)
        return sampled, prompts


def _constrained(logits, row: int) -> np.ndarray:
    """The raw row, its grammar-disallowed tokens at -inf when it has a mask."""
    allowed = logits.allowed(row)
    if allowed is None:
        return logits[row]
    out = np.array(logits[row], np.float32, copy=True)
    out[~allowed] = -np.inf
    return out
