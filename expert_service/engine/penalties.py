"""Repetition, presence and frequency penalties: the parameters, each penalised sequence's state slot, and
the work one step hands the backend (expert_service/cpu/penalties.py, expert_service/cuda/penalties.py).

What they do to a sequence's logits before temperature, top-k/top-p and the greedy argmax (vLLM's order):
- repetition r (> 0, 1 = off), transformers' RepetitionPenaltyLogitsProcessor: every distinct token seen in
  the prompt or the output so far, once: logit * r where logit < 0, else logit / r;
- then frequency f and presence p (each in [-2, 2], 0 = off), OpenAI's definition over the output tokens:
  logit -= f * count, then logit -= p * (count > 0).
A penalised logit that leaves the float32 range is clamped to it (a tiny r must not turn a logit into inf).

State: a penalised sequence holds one slot: a row of uint16 words over the vocabulary, bit 0 = the token is
in the prompt, bits 1-15 = how often it was generated (saturating at 32767, far past where a penalty still
changes anything). Two bytes per token instead of an int32 count plus a mask: 64 slots of a 152k vocabulary
take 19 MiB. A step updates the state before it applies it: each prompt chunk of a sequence with a repetition
penalty marks its tokens (its cached prefix's too, sent once with its first chunk; no other penalty reads the
marks), and each decode counts its input token -- the token the sequence sampled in the step before, which the worker feeds
itself (the router only sends a placeholder while that step is in flight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from common.errors import CapacityError, InvalidRequestError

MAX_PRESENCE_FREQUENCY = 2.0
PROMPT_BIT = 1
COUNT_ONE = 2  # an output occurrence adds this to the word
SATURATED = 0xFFFE  # a word at or above this no longer counts up
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True, slots=True)
class PenaltyParams:
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0

    def __post_init__(self):
        if not math.isfinite(self.repetition) or self.repetition <= 0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be a finite number > 0 (1 = off), got {self.repetition:g}"
            )
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not math.isfinite(value) or abs(value) > MAX_PRESENCE_FREQUENCY:
                raise InvalidRequestError(
                    name,
                    f"must be in [-{MAX_PRESENCE_FREQUENCY:g}, {MAX_PRESENCE_FREQUENCY:g}] (0 = off), got {value:g}",
                )

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0

    @property
    def counts_prompt(self) -> bool:
        """Only the repetition penalty reads the prompt marks (presence and frequency count output tokens)."""
        return self.repetition != 1.0


@dataclass(frozen=True, slots=True)
class PenaltyBatch:
    """One step's penalty work. Rows are the step's first logits rows (the sampling rows), in order."""

    reset_slots: np.ndarray  # [n] int32: slots taken by a new sequence, zeroed before the updates
    update_slots: np.ndarray  # [U] int32
    update_tokens: np.ndarray  # [U] int32
    update_output: np.ndarray  # [U] int32: 1 = an output token (count + 1), 0 = a prompt token (mark)
    row_slots: np.ndarray  # [R] int32: each sampling row's slot, -1 = not penalised
    repetition: np.ndarray  # [R] float32
    presence: np.ndarray  # [R] float32
    frequency: np.ndarray  # [R] float32

    @property
    def num_rows(self) -> int:
        return len(self.row_slots)

    @property
    def has_rows(self) -> bool:
        """Some sampling row is penalised (else the step only updates state)."""
        return bool(len(self.row_slots)) and bool((self.row_slots >= 0).any())


class PenaltySlots:
    """Which sequence holds which state slot; a step's PenaltyBatch is built through `builder`."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.slots: dict[int, int] = {}

    def acquire(self, request_id: int) -> int:
        """A slot for a new penalised sequence (zeroed by the step that starts it)."""
        if not self._free:
            raise CapacityError(
                f"penalties: all {self.num_slots} penalty slots are held (at most max_batch_size "
                f"sequences with repetition/presence/frequency penalties at once)"
            )
        slot = self.slots[request_id] = self._free.pop()
        return slot

    def release(self, request_id: int) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def builder(self) -> PenaltyBatchBuilder:
        return PenaltyBatchBuilder(self)


class PenaltyBatchBuilder:
    """Collects one step's resets, state updates and sampling rows, then `build`s its PenaltyBatch."""

    def __init__(self, slots: PenaltySlots):
        self._slots = slots.slots
        self.resets: list[int] = []
        self.prompt_slots: list[np.ndarray] = []
        self.prompt_tokens: list[np.ndarray] = []
        self.output_slots: list[int] = []  # plain ints: a decode step adds one per sequence
        self.output_tokens: list[int] = []
        self.rows: list[tuple[int, PenaltyParams | None]] = []

    def reset(self, slot: int) -> None:
        self.resets.append(slot)

    def prompt(self, request_id: int, tokens: np.ndarray) -> None:
        """A prompt chunk of the sequence: its tokens are marked (a no-op for an unpenalised sequence; the caller
        skips a sequence without a repetition penalty, whose marks nothing reads)."""
        slot = self._slots.get(request_id)
        if slot is not None and len(tokens):
            self.prompt_slots.append(np.full(len(tokens), slot, np.int32))
            self.prompt_tokens.append(np.asarray(tokens, np.int32))

    def output(self, request_id: int, token: int) -> None:
        """A decode of the sequence: `token`, which it sampled in the step before, is counted."""
        slot = self._slots.get(request_id)
        if slot is not None:
            self.output_slots.append(slot)
            self.output_tokens.append(token)

    def row(self, request_id: int, params: PenaltyParams) -> None:
        """The next sampling row belongs to this sequence."""
        slot = self._slots.get(request_id)
        self.rows.append((slot, params) if slot is not None else (-1, None))

    def build(self) -> PenaltyBatch | None:
        """The step's work; None when no penalised sequence takes part (the common path does nothing)."""
        if not (self.resets or self.prompt_slots or self.output_slots) and all(slot < 0 for slot, _ in self.rows):
            return None
        params = [p or PenaltyParams() for _, p in self.rows]
        n_prompt = sum(len(t) for t in self.prompt_tokens)
        output = np.zeros(n_prompt + len(self.output_slots), np.int32)
        output[n_prompt:] = 1
        return PenaltyBatch(
            reset_slots=np.asarray(self.resets, np.int32),
            update_slots=np.concatenate([*self.prompt_slots, np.asarray(self.output_slots, np.int32)]),
            update_tokens=np.concatenate([*self.prompt_tokens, np.asarray(self.output_tokens, np.int32)]),
            update_output=output,
            row_slots=np.asarray([slot for slot, _ in self.rows], np.int32),
            repetition=np.asarray([p.repetition for p in params], np.float32),
            presence=np.asarray([p.presence for p in params], np.float32),
            frequency=np.asarray([p.frequency for p in params], np.float32),
        )


def update_state(words: np.ndarray, batch: PenaltyBatch) -> None:
    """Applies the batch's resets and updates to the state words [slots, V] uint16 (the numpy reference of
    the penalty_update kernel). Prompt marks may repeat a token; each slot counts at most one output token
    per step (a sequence decodes once per step)."""
    words[batch.reset_slots] = 0
    prompt = batch.update_output == 0
    words[batch.update_slots[prompt], batch.update_tokens[prompt]] |= PROMPT_BIT
    slots, tokens = batch.update_slots[~prompt], batch.update_tokens[~prompt]
    current = words[slots, tokens]
    words[slots, tokens] = np.where(current < SATURATED, current + COUNT_ONE, current)


def apply_penalties(
    logits: np.ndarray, words: np.ndarray, repetition: np.ndarray, presence: np.ndarray, frequency: np.ndarray
) -> np.ndarray:
    """Penalised copy of `logits` [R, V] float32, row r under state words [R, V] uint16 and its parameters
    [R] (the numpy reference of the apply_penalties kernel; float32 arithmetic, in the module's order)."""
    x = logits.astype(np.float32, copy=True)
    rep = repetition.astype(np.float32)[:, None]
    seen = words != 0
    with np.errstate(over="ignore"):  # clamped below
        x = np.where(seen, np.where(x < 0, x * rep, x / rep), x)
    counts = (words >> 1).astype(np.float32)
    x = x - frequency.astype(np.float32)[:, None] * counts
    x = x - presence.astype(np.float32)[:, None] * (counts > 0)
    finite = np.isfinite(logits)
    return np.where(finite, np.clip(x, -FLOAT32_MAX, FLOAT32_MAX), x).astype(np.float32)
