"""Continuous-batching scheduler: pure Python, no grpc, no asyncio; the engine loop drives it.

Design note. There is one token-accounting model and no prefill/decode "phases": every sequence has
``num_tokens`` (prompt + generated) and ``num_computed_tokens`` (tokens whose KV the worker holds), and a
step is ``{request_id: tokens to run}``. A sequence still inside its prompt runs a chunk of it (chunked
prefill falls out of the token budget); a sequence past its prompt runs exactly one token, its last sampled
one. Running sequences are served first, oldest first, so decodes never starve behind a long prompt; the
rest of the budget admits waiting requests in FIFO order, between steps.

KV admission reserves blocks for prompt + max_new_tokens when a request is admitted. The worker protocol has
no swap or preemption, so reserving the worst case is what lets an admitted request always finish; the cost
is a lower batch occupancy when max_new_tokens is generous. Admission stops at the first waiting request that
does not fit (head-of-line, as TGI), so a large request is not overtaken forever by small ones.

A sequence that leaves (finished or cancelled) returns its blocks at once; when the worker had already seen
it, the next plan carries a FilterBatch so the worker frees its KV before (or instead of) the next step. A
request cancelled while waiting is dropped from the queue and never reaches the worker.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # waited in the queue past its deadline
    ERROR = "error"


@dataclass
class Sequence:
    """The scheduler's view of one request."""
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    # Token ids that end the sequence (EOS unless ignore_eos, plus stop_token_ids), by reason.
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    # Opaque to the scheduler: carried into the first prefill chunk (worker SamplingParams).
    sampling: Any = None
    # time.monotonic() after which a still-waiting request is dropped.
    queue_deadline: float = float("inf")
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_blocks: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    # True once a chunk was sent: the worker holds state for it and must be told to free it.
    is_on_worker: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens


@dataclass(frozen=True)
class Chunk:
    """A slice of a prompt for one step (maps onto worker PrefillChunk)."""
    request_id: int
    token_ids: tuple[int, ...]
    is_first: bool  # the worker learns the sequence (and its sampling) from this chunk
    is_last: bool  # the prompt ends here: the worker samples the first generated token


@dataclass(frozen=True)
class StepPlan:
    """One step: what to run, plus what the worker must free first."""
    # request_id -> tokens this step runs for it (chunk length, or 1 for a decode)
    num_scheduled_tokens: dict[int, int]
    prefill_chunks: tuple[Chunk, ...]
    decode_ids: tuple[int, ...]
    # Sequences the worker must free before the step (FilterBatch keeps keep_ids) ...
    free_ids: frozenset[int]
    keep_ids: tuple[int, ...]
    # ... and waiting requests dropped because their queue deadline passed (never sent to the worker).
    expired_ids: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def kind(self) -> str:
        """"prefill" (a Prefill RPC, decodes riding along) or "decode" (a Decode RPC)."""
        return "prefill" if self.prefill_chunks else "decode"

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class StepOutput:
    """What one sequence produced in a step."""
    request_id: int
    token_id: int | None  # None for a prompt chunk that did not end the prompt
    logprob: float | None = None
    finish_reason: FinishReason | None = None
    error: str = ""


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
        return -(-num_tokens // self.kv_block_size)


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.sequences: dict[int, Sequence] = {}
        self.num_free_blocks = limits.num_kv_blocks
        self._pending_free: set[int] = set()  # left while on the worker; next plan filters them out

    # ---- requests in and out ----
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.sequences:
            raise ValueError(f"scheduler: request {seq.request_id} is already scheduled")
        if not seq.prompt_ids or seq.max_new_tokens < 1:
            raise ValueError("scheduler: a sequence needs a prompt and max_new_tokens >= 1")
        if self._blocks_needed(seq) > self.limits.num_kv_blocks:
            raise ValueError(f"scheduler: request {seq.request_id} needs more KV blocks than exist")
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.sequences[seq.request_id] = seq

    def finish(self, request_id: int, reason: FinishReason) -> bool:
        """Removes a sequence (finished, cancelled, failed) and frees its blocks now; False if unknown."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        self.num_free_blocks += seq.num_blocks
        seq.num_blocks = 0
        seq.status, seq.finish_reason = Status.FINISHED, seq.finish_reason or reason
        if seq.is_on_worker:
            self._pending_free.add(request_id)
        return True

    def clear(self) -> list[int]:
        """Forgets every sequence (the worker was lost); returns their ids."""
        ids = list(self.sequences)
        self.waiting.clear()
        self.running.clear()
        self.sequences.clear()
        self._pending_free.clear()
        self.num_free_blocks = self.limits.num_kv_blocks
        return ids

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_used_blocks(self) -> int:
        return self.limits.num_kv_blocks - self.num_free_blocks

    def _blocks_needed(self, seq: Sequence) -> int:
        return self.limits.blocks_for(seq.num_prompt_tokens + seq.max_new_tokens)

    # ---- one step ----
    def schedule(self, now: float = 0.0) -> StepPlan:
        expired = [s.request_id for s in self.waiting if s.queue_deadline <= now]
        for request_id in expired:
            self.finish(request_id, FinishReason.EXPIRED)
        budget = self.limits.max_batch_tokens
        scheduled: dict[int, int] = {}
        chunks: list[Chunk] = []
        decodes: list[int] = []
        for seq in self.running:
            if budget == 0 or len(scheduled) == self.limits.max_batch_size:
                break
            if seq.is_prefilling:
                budget -= self._add_chunk(seq, budget, scheduled, chunks)
            else:
                scheduled[seq.request_id] = 1
                decodes.append(seq.request_id)
                budget -= 1
        while self.waiting and budget > 0 and len(scheduled) < self.limits.max_batch_size:
            seq = self.waiting[0]
            needed = self._blocks_needed(seq)
            if needed > self.num_free_blocks:
                break
            self.waiting.popleft()
            self.num_free_blocks -= needed
            seq.num_blocks, seq.status = needed, Status.RUNNING
            self.running.append(seq)
            budget -= self._add_chunk(seq, budget, scheduled, chunks)
        free_ids = frozenset(self._pending_free)
        self._pending_free.clear()
        keep = tuple(s.request_id for s in self.running if s.is_on_worker)
        return StepPlan(scheduled, tuple(chunks), tuple(decodes), free_ids, keep, tuple(expired))

    def _add_chunk(self, seq: Sequence, budget: int, scheduled: dict, chunks: list) -> int:
        start = seq.num_computed_tokens
        n = min(seq.num_prompt_tokens - start, budget)
        scheduled[seq.request_id] = n
        chunks.append(Chunk(seq.request_id, tuple(seq.prompt_ids[start:start + n]), is_first=start == 0,
                            is_last=start + n == seq.num_prompt_tokens))
        seq.is_on_worker = True
        return n

    def update(self, plan: StepPlan, generations: list[StepOutput]) -> list[StepOutput]:
        """Applies a step's results; returns one output per sequence still known, with finish reasons.

        Sequences that left while the step ran (cancelled) are skipped; their ids are already queued for
        FilterBatch by `finish`.
        """
        by_id = {g.request_id: g for g in generations}
        outputs = []
        for request_id, n in plan.num_scheduled_tokens.items():
            seq = self.sequences.get(request_id)
            if seq is None:
                continue
            seq.num_computed_tokens += n
            gen = by_id.get(request_id)
            if gen is None or gen.error:
                error = gen.error if gen is not None else "MISSING_GENERATION"
                self.finish(request_id, FinishReason.ERROR)
                outputs.append(StepOutput(request_id, None, error=error, finish_reason=FinishReason.ERROR))
                continue
            if gen.token_id is None:
                if not seq.is_prefilling:  # the prompt ended but the worker sampled nothing
                    self.finish(request_id, FinishReason.ERROR)
                    outputs.append(StepOutput(request_id, None, error="NO_TOKEN_AFTER_PROMPT",
                                              finish_reason=FinishReason.ERROR))
                continue
            seq.output_ids.append(gen.token_id)
            reason = self._stop_reason(seq, gen.token_id)
            if reason is not None:
                self.finish(request_id, reason)
            outputs.append(StepOutput(request_id, gen.token_id, gen.logprob, reason))
        return outputs

    @staticmethod
    def _stop_reason(seq: Sequence, token_id: int) -> FinishReason | None:
        # The worker suppresses these ids until min_new_tokens, so seeing one means it may stop here.
        if token_id in seq.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if token_id in seq.eos_token_ids:
            return FinishReason.EOS
        if len(seq.output_ids) >= seq.max_new_tokens:
            return FinishReason.LENGTH
        return None
