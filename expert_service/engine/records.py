"""The engine's records of its sequences and steps (expert_service/engine/engine.py holds the logic): what a step
answers per sequence (SequenceOutput) and in all (StepResult), what the worker keeps of a sequence between steps
(SequenceState), and a step launched on the decoder and not yet collected (InFlightStep)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from expert_service.engine.logprobs import TokenLogprobs
from expert_service.engine.sampling import Sampler
from expert_service.engine.step import Logits, StepTrace
from expert_service.experts.cache import CacheStats


@dataclass(frozen=True, slots=True)
class SequenceOutput:
    request_id: int
    token_id: int | None = None  # None: a non-final prompt chunk, or an error
    logprob: float = 0.0
    error: str = ""
    top: TokenLogprobs | None = None  # top_logprobs: the sampled position's most likely tokens
    prompt: TokenLogprobs | None = None  # prompt_logprobs: this step's prompt chunk scored


@dataclass
class StepResult:
    outputs: list[SequenceOutput]
    forward_ms: float
    sample_ms: float
    trace: StepTrace
    routing_plan_recall: float | None  # routing=exact with a routing plan: share of the exact routing predicted
    logits: Logits  # rows [sampling sequences] of [V], in output order
    expert_cache: CacheStats | None = None  # the step's expert-cache counts (None: all experts resident)


@dataclass
class SequenceState:
    """What the worker keeps of one sequence between steps (its KV blocks live in the allocator)."""

    sampler: Sampler
    num_cached: int = 0  # tokens whose K/V are in the cache
    last_token: int | None = None  # the latest sampled token, fed by the next decode
    prompt_row: np.ndarray | None = None  # prompt_logprobs: raw logits of the last chunk's last position
    block_array: np.ndarray | None = None  # its block table as int64, rebuilt when the table grows (append-only)
    pending: tuple[int, int] | None = None  # (step serial, logits row): a launched step not yet collected
    # samples its next token there
    missed_chunk: bool = False  # a chunk of it was refused with its step and none ran since: the router's later
    # chunks start past num_cached, and fail alone


@dataclass
class InFlightStep:
    """A step launched on the decoder (Engine.launch) and not yet collected."""

    serial: int
    work: list[tuple[int, np.ndarray, bool]]  # (sequence, its tokens this step, samples a token)
    states: list[SequenceState]  # the work's sequences at launch (one freed meanwhile is skipped)
    unknown: list[SequenceOutput]  # decodes of sequences the engine does not hold
    decode_ids: tuple[int, ...]  # as asked for: the order of UNKNOWN_SEQUENCE answers
    scored: set[int]  # sequences whose prompt chunk is scored (prompt_logprobs)
    planned_ids: dict[int, np.ndarray] | None  # the router's routing plan as expert ids
    trace: StepTrace
    started: float  # perf_counter at launch
    launched: object | None  # the decoder's handle (None: nothing ran)
    overlappable: bool  # the next step may launch before this one is collected
    late: dict[int, int] = field(default_factory=dict)  # greedy constrained rows whose masks come later:
    # sequence -> logits row; while any wait, the step cannot be collected nor another launched
    token_masks: np.ndarray | None = None  # the masks given at launch (late rows all ones)
    failed: frozenset[int] = frozenset()  # late rows whose masks never came: answered MISSING_TOKEN_MASK
    fed: frozenset[int] = frozenset()  # work indices of decodes fed the step before's argmax on the device

    @property
    def sequences(self) -> frozenset[int]:
        return frozenset(rid for rid, _, _ in self.work)

    @property
    def sampling(self) -> frozenset[int]:
        """The sequences this step samples a token for (one may be released when the step is collected)."""
        return frozenset(rid for rid, _, wants_token in self.work if wants_token)

    def input_tokens(self) -> np.ndarray:
        """The step's input tokens in the decoder's order, once the step before is collected: a fed decode's is the
        token that step sampled (its sequence's last_token by then)."""
        return np.concatenate(
            [
                np.array([seq.last_token or 0], np.int64) if index in self.fed else ids
                for index, ((_, ids, _), seq) in enumerate(zip(self.work, self.states))
            ]
        )
