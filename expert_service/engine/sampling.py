"""Token sampling on the worker, vLLM semantics: the penalties (expert_service/engine/penalties.py, applied by the
backend), then a constrained sequence's grammar mask (engine/token_masks.py, applied by the backend), then the
logit bias, then stop-id suppression, then temperature 0 = greedy; otherwise logits /
temperature, then top-k (0 = off), then top-p (1 = off), then min-p (0 = off), then one draw from the sequence's
own seeded generator, so the same seed gives the same tokens whatever else shares the batch (filters and draw
without sorting the vocabulary: `filtered_weights`, bench/sampler_host.py). Log-probabilities
are of the raw logits (expert_service/engine/logprobs.py): no bias, no filter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.errors import InvalidRequestError
from expert_service.engine.logprobs import MAX_TOP_LOGPROBS
from expert_service.engine.penalties import PenaltyParams

MAX_STOP_TOKEN_IDS = 4096
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # suppressed until min_new_tokens tokens were generated
    min_new_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: the most likely tokens of each sampled position
    prompt_logprobs: int | None = None  # score the prompt with this many top tokens per position; None = off
    penalties: PenaltyParams = PenaltyParams()
    min_p: float = 0.0  # keep tokens with probability >= min_p x the top token's; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids distinct
    constrained: bool = False  # every sampling step carries a grammar mask for it (engine/token_masks.py)

    def __post_init__(self):
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0, got {self.top_k}")
        if self.seed < 0:  # numpy's generator refuses it, with a bare ValueError, only when the sequence starts
            raise InvalidRequestError("seed", f"must be >= 0, got {self.seed}")
        if not (0 < self.top_p <= 1) or not np.isfinite(self.top_p):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"{len(self.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS}")
        for name, value in (("top_logprobs", self.top_logprobs), ("prompt_logprobs", self.prompt_logprobs or 0)):
            if not 0 <= value <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if not (0 <= self.min_p <= 1):  # NaN fails too
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError("logit_bias", f"{len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias[{token_id}]",
                    f"id must be >= 0 and bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
                )

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every id this sequence names must be a row of the logits."""
        if self.stop_token_ids and max(self.stop_token_ids) >= vocab_size:
            raise InvalidRequestError(
                "stop_token_ids", f"ids must be in [0, {vocab_size}), got {max(self.stop_token_ids)}"
            )
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidRequestError(f"logit_bias[{token_id}]", f"token id must be in [0, {vocab_size})")


class Sampler:
    """Per-sequence sampling state: the parameters and a generator seeded once."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))
        self.num_generated = 0
        # Built once: every step adds the same bias.
        self._bias = (
            np.array([i for i, _ in params.logit_bias], dtype=np.int64),
            np.array([b for _, b in params.logit_bias], dtype=np.float32),
        )

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the (penalised) logits is the token: no bias, no stop-token suppression, no temperature
        (min-p keeps the top token, so greedy ignores it). Log-probabilities are scored apart from the choice."""
        p = self.params
        return (
            p.temperature == 0 and not p.logit_bias and not (self.num_generated < p.min_new_tokens and p.stop_token_ids)
        )

    def take_greedy(self, token: int) -> int:
        """Records a token chosen by the backend's argmax (only when `plain_greedy`)."""
        self.num_generated += 1
        return token

    def sample(self, logits: np.ndarray, processed: np.ndarray | None = None) -> int | None:
        """The next token from `processed` (the row after the step's penalties; the raw `logits` [V] float32 when
        None); None if the raw logits are non-finite."""
        if not np.all(np.isfinite(logits)):
            return None
        p = self.params
        logits = (logits if processed is None else processed).astype(np.float32, copy=True)
        if p.logit_bias:
            ids, biases = self._bias
            logits[ids] += biases
        if self.num_generated < p.min_new_tokens and p.stop_token_ids:
            logits[list(p.stop_token_ids)] = -np.inf
        # float32 like the logits: a temperature below its range is greedy (the limit), one above it the largest
        # float32 (every allowed token equally likely; -inf / inf would be NaN)
        temperature = np.float32(min(p.temperature, float(np.finfo(np.float32).max)))
        if temperature == 0:
            token = int(np.argmax(logits))
        else:
            # Shifted to <= 0 before dividing: a tiny temperature sends every other token to -inf (never
            # inf - inf = NaN), so it degrades to greedy instead of to the last id.
            logits -= logits.max()
            logits /= temperature
            token = self._draw_filtered(logits)
        self.num_generated += 1
        return token

    def _draw_filtered(self, scaled: np.ndarray) -> int:
        """One draw from softmax(scaled) [V] float32 (<= 0, 0 at the top token) after top-k, top-p and min-p:
        the tokens filter_logits keeps, with the same probabilities (float32 exponentials, float64 sums: cut-offs
        within ~1e-6 relative of a float64 computation), found without sorting the vocabulary, and drawn over them
        in id order, so a seed's random numbers pick the tokens they picked when the whole row was sorted. A
        request's sampling runs on the worker's host for every step (hundreds of microseconds a row at 32k tokens
        in plain numpy, milliseconds with top-p's full sort)."""
        p = self.params
        ids, weights = filtered_weights(scaled, p.top_k, p.top_p, p.min_p)
        if ids is None:
            return _draw_blocked(weights, self.rng.random())
        cdf = np.cumsum(weights, dtype=np.float64)
        return int(ids[min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(cdf) - 1)])


# The candidate sets top-p tries before sorting the whole vocabulary: tokens within this many nats of the top one
NUCLEUS_SPANS = (4.0, 8.0, 16.0, 32.0)
DRAW_BLOCK = 1024  # the plain draw's two-level cumulative sum: block sums, then one block's entries


def filtered_weights(scaled: np.ndarray, top_k: int, top_p: float, min_p: float):
    """(ids, weights): the tokens filter_logits keeps of `scaled` [V] float32 (<= 0, 0 at the top token) and their
    unnormalised probabilities exp(scaled) in float32; ids None with weights [V] (zero where filtered) when no
    filter is on."""
    ids = None  # the candidates (None: every token), then the kept ones
    if 0 < top_k < scaled.size:  # exactly k survive, even with ties
        ids = np.sort(np.argpartition(-scaled, top_k - 1)[:top_k])  # the same tied tokens as filter_logits
    values = scaled if ids is None else scaled[ids]
    weights = np.exp(values)
    if top_p < 1.0:
        ids, weights = _nucleus(values, weights, ids, top_p)
        values = scaled[ids]
    if min_p > 0:  # p_i >= min_p * p_max  <=>  scaled_i >= log(min_p): the top token (0) stays
        keep = values >= np.float32(np.log(min_p))
        ids = np.flatnonzero(keep) if ids is None else ids[keep]
        weights = weights[keep]
    return ids, weights


def _nucleus(values: np.ndarray, weights: np.ndarray, ids: np.ndarray | None, top_p: float):
    """(ids, weights) of the top-p nucleus of the candidates (ids None: every token; values their scaled logits,
    weights their exp): the tokens in descending order (ties by id, as a stable sort) until the mass strictly before
    a token reaches top_p of the total. Sorts only the tokens within a span of the top one whose mass already
    reaches top_p: every nucleus token is among them, since each token outside weighs less than each inside."""
    total = weights.sum(dtype=np.float64)
    inside = None  # every candidate, unless a span's tokens hold top_p of the mass
    for span in NUCLEUS_SPANS:
        within = np.flatnonzero(values > -span)
        if weights[within].sum(dtype=np.float64) >= top_p * total:
            inside = within
            break
    order = np.argsort(-values, kind="stable") if inside is None else inside[np.argsort(-values[inside], kind="stable")]
    before = np.concatenate(([0.0], np.cumsum(weights[order], dtype=np.float64)[:-1]))  # mass ahead of each
    n = max(1, int(np.searchsorted(before, top_p * total, side="left")))
    kept = np.sort(order[:n])  # id order, as every other filter leaves its tokens
    return (kept if ids is None else ids[kept]), weights[kept]


def _draw_blocked(weights: np.ndarray, u: float) -> int:
    """The token whose cumulative weight first exceeds u x the total, summing block by block (one pass over the
    vocabulary, a cumulative sum over one block) instead of a cumulative sum over every token."""
    n = weights.size
    blocks = -(-n // DRAW_BLOCK)
    padded = np.zeros(blocks * DRAW_BLOCK, np.float32)
    padded[:n] = weights
    sums = np.cumsum(padded.reshape(blocks, DRAW_BLOCK).sum(axis=1, dtype=np.float64))
    target = u * sums[-1]
    b = min(int(np.searchsorted(sums, target, side="right")), blocks - 1)
    block = padded[b * DRAW_BLOCK : (b + 1) * DRAW_BLOCK]
    cdf = np.cumsum(block, dtype=np.float64)
    j = int(np.searchsorted(cdf, target - (sums[b - 1] if b else 0.0), side="right"))
    if j >= block.size or block[j] == 0:  # rounding past the block's end: its last token that can be drawn
        j = int(np.flatnonzero(block)[-1])
    return b * DRAW_BLOCK + j


def filter_logits(logits: np.ndarray, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """Masks (to -inf) every token outside the top-k, outside the top-p nucleus, and below min_p times the top
    token's probability."""
    out = logits.copy()
    if 0 < top_k < out.size:
        keep = np.argpartition(-out, top_k - 1)[:top_k]  # exactly k survive, even with ties
        mask = np.ones(out.size, dtype=bool)
        mask[keep] = False
        out[mask] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-out, kind="stable")
        probs = np.exp(out[order] - out[order[0]])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs  # mass strictly ahead of each token
        out[order[before >= top_p]] = -np.inf  # the top token (before = 0) always stays
    if min_p > 0:
        # p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p): no softmax needed; the top token stays.
        out[out - out.max() < np.log(min_p)] = -np.inf
    return out
