"""The scheduler's records: a request as it waits and runs (ScheduledRequest), the steps it builds (Chunk,
ScheduledStep), what a step returns per request (RequestOutput), the batch limits it works under, and a request's
status and finish reasons. router_service.scheduler holds the Scheduler that moves them and re-exports these names,
which most of the router imports from there."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.kv_blocks import blocks_needed
from router_service.logprobs import Scored
from router_service.prefix_cache import PrefixState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_SEQUENCE = "stop_sequence"
    CONSTRAINT = "constraint"  # the constrained output is complete: nothing may follow it
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # waited in the queue past its deadline
    ERROR = "error"


@dataclass
class ScheduledRequest:
    """The scheduler's view of one request."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    # Token ids that end the request (EOS unless ignore_eos, plus stop_token_ids), by reason.
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    # Opaque to the scheduler: the worker's sampling settings as the wire built them, carried into the first
    # prompt chunk.
    sampling: object = None
    sampling_bytes: int = 0  # its serialized size: the first chunk's share of the step message (step_size.py)
    # time.monotonic() after which a still-waiting request is dropped.
    queue_deadline: float = float("inf")
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sent to the worker (prompt chunks and decode inputs), ahead of num_computed_tokens while steps
    # are in flight, and tokens those steps will sample that have not come back yet.
    num_scheduled_tokens: int = 0
    num_pending_outputs: int = 0
    num_blocks: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    # True once a chunk was sent: the worker holds state for it and must be told to free it.
    is_on_worker: bool = False
    # prompt_logprobs: every prompt position is a logits row on the worker, at most max_batch_size a step.
    scores_prompt: bool = False
    # Repetition/presence/frequency penalties: the worker holds max_batch_size state slots for these.
    penalized: bool = False
    # The worker needs the tokens of its cached prefix (a repetition penalty counts them): they go once, with its
    # first chunk, and the worker keeps them in the sequence's penalty state.
    sends_prefix_tokens: bool = False
    # Constrained decoding: each decode's grammar mask needs the token before it, so no output may be pending
    # (the request runs at pipeline depth 1 while the others keep theirs) ...
    constrained: bool = False
    # ... unless its masks may come late: a plain greedy decode is sent with one output pending, its mask in the
    # next message (the worker applies it before that message's step, which is fed the masked argmax).
    late_masks: bool = False
    # prompt_logprobs chunk by chunk, delivered with the first token.
    prompt_scores: list[Scored] = field(default_factory=list)
    # Prefix caching: requests share cached blocks only under equal salts; `prefix` is set when caching is on.
    cache_salt: str = ""
    prefix: PrefixState | None = None
    prompt_bytes: bytes = b""  # prompt_ids as uint32 little-endian when the caller has them (b"": converted here)
    num_cached_tokens: int = 0  # prompt tokens it started on from the cache

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """Part of the prompt is still to be sent (chunks already in flight count as sent)."""
        return self.num_scheduled_tokens < self.num_prompt_tokens

    @property
    def may_decode(self) -> bool:
        """Another decode can be sent: the prompt is out and the tokens in flight leave room below
        max_new_tokens (so a length stop never costs a wasted step)."""
        return (
            not self.is_prefilling
            and len(self.output_ids) + self.num_pending_outputs < self.max_new_tokens
            and not (self.constrained and self.num_pending_outputs > self.late_masks)
        )


@dataclass(frozen=True)
class Chunk:
    """A slice of a prompt for one step."""

    request_id: int
    token_ids: tuple[int, ...]
    is_first: bool  # the worker learns the sequence (and its sampling) from this chunk
    is_last: bool  # the prompt ends here: the worker samples the first generated token
    sampling: object = None  # the request's, on its first chunk
    prefix_block_ids: tuple[int, ...] = ()  # on its first chunk: the cached blocks it starts on
    cache_block_ids: tuple[int, ...] = ()  # one per block the chunk completes: the id to cache it under (0: none)
    prefix_token_ids: tuple[int, ...] = ()  # on its first chunk (sends_prefix_tokens): its cached blocks' tokens
    # The request's tokens before this chunk (its cached prefix included): the worker fails a chunk alone when an
    # earlier one never ran (refused with a step sent before this one's), instead of refusing its step.
    start: int = 0


@dataclass(frozen=True)
class ScheduledStep:
    """One step as the scheduler decided it: what to run, plus what the worker must free first."""

    # request_id -> tokens this step runs for it (chunk length, or 1 for a decode)
    num_scheduled_tokens: dict[int, int]
    prefill_chunks: tuple[Chunk, ...]
    decode_ids: tuple[int, ...]
    # The input token of each decode, in decode_ids order: the token the request sampled last (the worker
    # feeds its own copy; routing lookups read this one).
    decode_token_ids: tuple[int, ...]
    # Requests the worker must free before the step ...
    free_ids: frozenset[int]
    # ... and waiting requests dropped because their queue deadline passed (never sent to the worker).
    expired_ids: tuple[int, ...] = ()
    # Cached prefix blocks the worker drops before the step (after the frees).
    evict_block_ids: tuple[int, ...] = ()
    # (request id, block index, block id): full blocks running requests' decodes wrote, cached once the step is launched.
    sequence_blocks: tuple[tuple[int, int, int], ...] = ()
    # What the step's byte budget counted for its message (the bytes reserved for late masks included): the
    # serialized message stays under it plus step_size.FRAMING_BYTES, which is what the margin keeps back.
    estimated_bytes: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def kind(self) -> str:
        """ "prefill" (prompt chunks, decodes riding along), "decode", or "free" (only frees to carry)."""
        return "prefill" if self.prefill_chunks else "decode" if self.decode_ids else "free"

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens - len(self.decode_ids)


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in a step."""

    request_id: int
    token_id: int | None  # None for a prompt chunk that did not end the prompt
    logprob: float | None = None
    finish_reason: FinishReason | None = None
    error: str = ""
    top: Scored | None = None  # top_logprobs: the sampled position's most likely tokens
    prompt: Scored | None = None  # prompt_logprobs: the step's chunk; on a first token, the whole prompt


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    max_batch_tokens: int
    kv_block_size: int
    num_kv_blocks: int

    def __post_init__(self):
        for name in ("max_batch_size", "max_batch_tokens", "kv_block_size", "num_kv_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler: {name} must be >= 1, got {getattr(self, name)}")

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.kv_block_size)
