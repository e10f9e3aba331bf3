"""Log-probabilities the worker reports: each chosen token's and the top n of its position, for sampled
tokens and (when asked) prompt tokens.

They are of the model's own distribution -- log_softmax of the raw logits, before penalties, stop-id
suppression, temperature and top-k/top-p -- as vLLM reports them by default (its raw_logprobs mode): the
numbers say what the model thinks of the text, whatever the sampling settings. Vectorised over the rows of a
step; top ids are ordered by log-probability, ties by the lower id.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20      # OpenAI's bound on top_logprobs


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """n positions: the chosen token's log-probability and the k most likely tokens of each."""
    logprobs: np.ndarray       # [n] float32 (NaN: no distribution, the prompt's first token)
    top_ids: np.ndarray        # [n, k] int32, most likely first
    top_logprobs: np.ndarray   # [n, k] float32

    def __len__(self) -> int:
        return len(self.logprobs)

    @classmethod
    def empty(cls, k: int) -> TokenLogprobs:
        return cls(np.zeros(0, np.float32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32))

    @classmethod
    def concat(cls, parts: list[TokenLogprobs]) -> TokenLogprobs:
        return cls(np.concatenate([p.logprobs for p in parts]), np.concatenate([p.top_ids for p in parts]),
                   np.concatenate([p.top_logprobs for p in parts]))


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
        first = TokenLogprobs(np.full(1, np.nan, np.float32), np.full((1, kk), -1, np.int32),
                              np.full((1, kk), np.nan, np.float32))
    else:
        first = token_logprobs(previous_row[None, :], tokens[:1], k)
    return TokenLogprobs.concat([first, token_logprobs(rows, tokens[1:], k)]) if len(tokens) > 1 else first
