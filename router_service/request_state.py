"""What the batching loop keeps per request (`RequestState`), what it hands the caller (`RequestHandle`: an async
iterator of `Delta`s), and the `Delta` itself."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace

from router_service.config import RouterConfig
from router_service.constraints import GrammarMatcher
from router_service.errors import DeadlineExceeded, RouterError
from router_service.logprobs import PromptLogprob, Top
from router_service.scheduler import FinishReason
from router_service.tokenizer import IncrementalDetokenizer, StopSequenceMatcher
from router_service.validation import ValidatedRequest


class _Loop(Protocol):
    """What a handle asks of the batching loop that owns its request."""

    config: RouterConfig

    def fail(self, seq_id: int, error: RouterError) -> None: ...

    def cancel(self, seq_id: int) -> None: ...


@dataclass(frozen=True)
class Delta:
    """New output of one request since its previous Delta; the last one has finish_reason set."""

    token_ids: list[int]
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    top_logprobs: list[Top] = field(default_factory=list)  # with top_logprobs: one per token
    prompt_logprobs: list[PromptLogprob] | None = None  # with prompt_logprobs: on the first Delta


@dataclass
class RequestState:
    seq_id: int  # the worker's request id
    request_id: str  # the public one, echoed to the caller
    req: ValidatedRequest
    deadline: float  # time.monotonic() by which the request must be done
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    detokenizer: IncrementalDetokenizer | None = None
    stops: StopSequenceMatcher = field(default_factory=StopSequenceMatcher)
    # the request span, linked from the batch spans that carry it
    span_context: trace.Span | trace.SpanContext | otel_context.Context | None = None
    arrived_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first step that carried it
    num_cached_tokens: int = 0  # prompt tokens it started on from the prefix cache
    last_token_at: float | None = None
    num_generated: int = 0
    is_done: bool = False
    matcher: GrammarMatcher | None = None  # constrained decoding: the grammar's state after the tokens so far
    grammar_error: str = ""  # the matcher failed computing a mask: the request fails when that step answers


class RequestHandle:
    """What submit returns: iterate it for Deltas; errors surface as RouterError."""

    def __init__(self, batching_loop: _Loop, state: RequestState):
        self._batching_loop, self._state = batching_loop, state
        self.request_id = state.request_id
        self.prompt_ids = state.req.prompt_ids  # the prompt the model sees (after truncate_input_tokens)
        self.prompt_truncated = state.req.prompt_truncated
        self.num_prompt_tokens = len(state.req.prompt_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (known once the request was first scheduled)."""
        return self._state.num_cached_tokens

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        state = self._state
        if state.is_done and state.queue.empty():
            raise StopAsyncIteration
        timeout_s = self._batching_loop.config.request_timeout_s
        if not state.is_done and time.monotonic() >= state.deadline:
            # a caller reading behind its request (a slow client) never waits on the queue below
            self._batching_loop.fail(state.seq_id, deadline_error(state, timeout_s))
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that arrives as the
            # queue yields an item, and a cancelled (disconnected) request would then run to its end.
            async with asyncio.timeout(max(state.deadline - time.monotonic(), 0.0)):
                item = await state.queue.get()
        except TimeoutError:
            self._batching_loop.fail(state.seq_id, deadline_error(state, timeout_s))
            item = state.queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self, error: RouterError | None = None) -> None:
        """Ends the request now (client gone; or with `error`, counted as its outcome) and drops the Deltas it had
        not read: a handler still sending an error to a client that stopped reading keeps the handle. Ending is a
        no-op once the request finished."""
        if error is None:
            self._batching_loop.cancel(self._state.seq_id)
        else:
            self._batching_loop.fail(self._state.seq_id, error)
        queue = self._state.queue
        while not queue.empty():
            queue.get_nowait()


def new_request_id(chat: bool) -> str:
    """The id of a request that brought none, as OpenAI's of each kind of answer."""
    return f"{'chatcmpl-' if chat else 'cmpl-'}{uuid.uuid4().hex}"


def deadline_error(state: RequestState, request_timeout_s: float) -> DeadlineExceeded:
    """The error of a request whose deadline passed: where it was (QUEUE_TIMEOUT if no step carried it yet) and
    whose limit it was (the client's, or request_timeout_s when that was the earlier; the loop set the deadline to
    the smaller of the two, from the same arrival time)."""
    own = state.deadline < state.arrived_at + request_timeout_s
    if state.scheduled_at is None:
        queued = "the request's deadline passed while it waited in the queue"
        message = queued if own else f"waited in the queue longer than request_timeout_s={request_timeout_s:g}"
        return DeadlineExceeded(message, reason="QUEUE_TIMEOUT")
    running = "the request's deadline passed during generation"
    return DeadlineExceeded(running if own else f"the request ran longer than request_timeout_s={request_timeout_s:g}")


def in_request_span(state: RequestState) -> contextlib.AbstractContextManager:
    """Makes the request's span current (for the trace ids of a log line), whichever task runs this."""
    parent = state.span_context
    if isinstance(parent, otel_context.Context):
        parent = trace.get_current_span(parent)
    if isinstance(parent, trace.Span):
        parent = parent.get_span_context()
    if parent is None or not parent.is_valid:
        return contextlib.nullcontext()
    return trace.use_span(trace.NonRecordingSpan(parent), end_on_exit=False)
