"""What the two public fronts (the gRPC servicer and the OpenAI-compatible HTTP server) share: one code path from
a request to the batching loop and back.

Both turn their request into a GenerateRequest (a chat's messages are first rendered with the chat template),
which `Frontend.submit` admits (draining, worker readiness, room), validates (router_service.validation), annotates
on the current span and hands to `BatchingLoop.submit`; answers are read from the RequestHandle's Deltas, and
`collect` gathers a unary answer. Rejections before the batching loop are counted with `count_rejection`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from dataclasses import dataclass, field

from opentelemetry import trace

from common import tracing as semconv
from common.errors import InvalidRequestError
from common.pb import router_pb2
from router_service import errors
from router_service.batching_loop import BatchingLoop
from router_service.chat import ChatTemplate, message_dicts
from router_service.chat_render import TemplateRenderer
from router_service.constraints import FIELD as CONSTRAINT_FIELD
from router_service.logprobs import PromptLogprob, Top
from router_service.request_state import RequestHandle
from router_service.scheduler import FinishReason
from router_service.tool_calls import FORMATS, MISTRAL_MARKER, detect_format
from router_service.tool_constraint import attach_tool_constraint, schema_error, tool_call_constraint
from router_service.tool_request import ToolRequest, mistral_ids
from router_service.validation import (
    MAX_SEED,
    ModelLimits,
    PromptRequest,
    ValidatedRequest,
    check_fits_context,
    check_text_size,
    prompt_byte_limit,
    revalidate,
    validate_request_async,
)

OPERATION_CHAT = "chat"  # gen_ai.operation.name of chat requests
SEED_STRIDE = 0x9E3779B97F4A7C15  # odd, so the n seeds of one request are distinct modulo 2^64

STOP_REASONS = {
    FinishReason.LENGTH: router_pb2.STOP_REASON_LENGTH,
    FinishReason.EOS: router_pb2.STOP_REASON_EOS,
    FinishReason.STOP_TOKEN: router_pb2.STOP_REASON_STOP_TOKEN,
    FinishReason.STOP_SEQUENCE: router_pb2.STOP_REASON_STOP_SEQUENCE,
    # a complete constrained output ends as EOS would there (the grammar allowed only EOS next)
    FinishReason.CONSTRAINT: router_pb2.STOP_REASON_EOS,
}


def sample_of(req: ValidatedRequest, parameters: router_pb2.SamplingParameters, sample: int) -> ValidatedRequest:
    """Sample `sample` of a request: with a seed, the seed advanced by `sample` strides (sample 0 keeps it, so one
    sample answers as a single request; siblings differ yet every run repeats); without, a fresh random one."""
    if sample == 0:
        return req
    if parameters.HasField("seed"):
        return dataclasses.replace(req, seed=(parameters.seed + sample * SEED_STRIDE) % (1 << 64))
    return dataclasses.replace(req, seed=secrets.randbelow(MAX_SEED + 1))


@dataclass
class Completion:
    """A whole answer, gathered from a request's Deltas."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    top_logprobs: list[Top] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None
    tool_calls: list = field(default_factory=list)  # tool_calls.ToolCall: calls parsed from the reply
    ended_in_call: bool = False  # the reply was cut inside a call (ToolCallParser.ended_in_call)


@dataclass(frozen=True)
class ChatOptions:
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None  # None = not continue_final_message
    template_kwargs: dict | None = None
    tools: ToolRequest | None = None  # the chat's tools (None: it offers none)


class Frontend:
    """The shared request path over one batching loop."""

    def __init__(self, batching_loop: BatchingLoop, model_name: str = "", chat_template: ChatTemplate | None = None):
        self.batching_loop = batching_loop
        self.config = batching_loop.config
        self.chat_template = chat_template
        self.chat_renderer = (
            TemplateRenderer(
                chat_template,
                self.config.chat_template_timeout_s,
                self.config.chat_template_processes,
                self.config.retry_after_s,
            )
            if chat_template
            else None
        )
        self._model_name = model_name
        self._num_admitting = 0  # requests past check_room the batching loop does not hold yet (render, tokenize)
        # The format the template teaches its model, unless the operator names one.
        configured = self.config.tool_call_format
        source = chat_template.source if chat_template is not None else None
        self.tool_format = configured if configured in FORMATS else detect_format(source)

    @property
    def model_name(self) -> str:
        info = self.batching_loop.info
        return self.config.model_name or self._model_name or (info.model_name if info else "") or "colibri"

    @property
    def routing(self) -> str:
        return self.batching_loop.info.routing if self.batching_loop.info is not None else ""

    def check_ready(self) -> ModelLimits:
        """The served model's limits, once the worker is connected and the router is not draining."""
        if self.batching_loop.is_draining:
            raise errors.Unavailable(
                "the router is shutting down; retry on another replica", "DRAINING", self.config.retry_after_s
            )
        limits = self.batching_loop.limits
        if limits is None:
            raise errors.Unavailable(
                "the worker is not ready; retry shortly", "WORKER_UNAVAILABLE", self.config.retry_after_s
            )
        if self.batching_loop.is_worker_draining:
            raise errors.Unavailable(
                "the worker is shutting down; retry shortly", "DRAINING", self.config.retry_after_s
            )
        return limits

    def check_room(self) -> None:
        """Refuses a request while max_concurrent_requests are in flight, before its render, tokenizing and grammar
        compile: a refused request costs nothing, and a flood is shed at once (BatchingLoop.submit checks again).
        In flight: the batching loop's requests and those being admitted, so a burst of chats arriving together
        does not queue for the render processes past the cap."""
        limit = self.config.max_concurrent_requests
        if self.batching_loop.num_active + self._num_admitting >= limit:
            raise errors.Overloaded.at_capacity(limit, self.config.retry_after_s)

    @contextlib.contextmanager
    def _admitting(self):
        """check_room, then this request counts as in flight until the batching loop holds it or it failed."""
        self.check_room()
        self._num_admitting += 1
        try:
            yield
        finally:
            self._num_admitting -= 1

    async def submit(
        self,
        request: PromptRequest,
        deadline: float | None,
        stream: bool,
        *,
        operation: str = semconv.OPERATION_TEXT_COMPLETION,
        samples: int = 1,
        into: list[RequestHandle] | None = None,
    ) -> list[RequestHandle]:
        """Admits, validates and submits `request` as `samples` requests (sample_of: each its own seed);
        `deadline` is a time.monotonic() (None = the router's request timeout alone). Raises InvalidRequestError
        or a RouterError. `into`: the list returned, each handle appended as its sample is submitted (a caller
        cancelled part-way sees which samples the loop had, and counts them)."""
        limits = self.check_ready()
        with self._admitting():
            return await self._submit(request, limits, deadline, stream, False, operation, samples, into)

    async def _submit(
        self,
        request: PromptRequest,
        limits: ModelLimits,
        deadline: float | None,
        stream: bool,
        chat: bool,
        operation: str,
        samples: int = 1,
        into: list[RequestHandle] | None = None,
    ) -> list[RequestHandle]:
        """The prompt is tokenized and validated once, whatever `samples` (each sample re-did it: ~3.5 ms);
        a sample whose submission fails cancels those submitted before it."""
        req = await validate_request_async(request, self.config, limits, self.batching_loop.tokenizer, chat=chat)
        span, handles = trace.get_current_span(), list[RequestHandle]() if into is None else into
        set_request_attributes(span, self.model_name, req, stream, operation)
        try:
            for sample in range(samples):
                own = sample_of(req, request.parameters, sample)
                matcher = await self.batching_loop.compile_constraint(own)  # the first compiles, the others copy
                current = self.check_ready()
                if current is not limits:  # the worker reconnected meanwhile: the request must fit the one it goes to
                    own = revalidate(request, self.config, current, self.batching_loop.tokenizer, own)
                    req, limits = own, current
                handles.append(self.batching_loop.submit(own, deadline, span.get_span_context(), matcher, chat))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    async def render_chat(self, messages, options: ChatOptions = ChatOptions(), field: str = "messages") -> str:
        """The prompt text of a conversation (ChatMessage protos or OpenAI message dicts), rendered in a child
        process within chat_template_timeout_s (router_service.chat_render): the event loop keeps serving, and a
        runaway template is stopped. Special tokens' texts in the caller's strings are placeholders in it
        (router_service.chat_tokens): tokenize it with Tokenizer.encode_chat_async."""
        if self.chat_template is None or self.chat_renderer is None:
            raise InvalidRequestError(
                field,
                "this model has no chat template (tokenizer_config.json); start the "
                "router with --chat-template FILE, or send a text prompt",
            )
        if self.batching_loop.tokenizer is None:
            raise InvalidRequestError(field, "chat needs the model's tokenizer (start the router with --model DIR)")
        # Bound what the template sees before rendering it (the rendered text is checked again): every message
        # takes at least one token of the context.
        limits = self.check_ready()
        check_fits_context(field, "messages", len(messages), limits)
        dicts = message_dicts(messages, field)
        check_text_size(
            field,
            "".join(m.get("content", "") for m in dicts),
            prompt_byte_limit(self.config, limits),
        )
        add = options.add_generation_prompt
        if self.tool_format == "mistral":
            dicts = mistral_ids(dicts)
        # The caller's strings carry no special token into the prompt: only the template's markup does.
        tools = options.tools.template_tools() if options.tools is not None else None
        escaped = await self.batching_loop.tokenizer.escape_chat_async([dicts, options.template_kwargs, tools])
        try:
            return await self.chat_renderer.render(
                escaped[0],
                add_generation_prompt=not options.continue_final_message if add is None else add,
                continue_final_message=options.continue_final_message,
                template_kwargs=escaped[1],
                tools=escaped[2],
            )
        except InvalidRequestError as e:
            if e.field.startswith("messages") and field != "messages":
                raise InvalidRequestError(field + e.field[len("messages") :], e.detail) from None
            raise

    async def submit_chat(
        self,
        messages,
        parameters: router_pb2.SamplingParameters,
        request_id: str,
        deadline: float | None,
        stream: bool,
        options: ChatOptions = ChatOptions(),
        field: str = "messages",
        cache_salt: str = "",
        samples: int = 1,
        into: list[RequestHandle] | None = None,
    ) -> list[RequestHandle]:
        """Renders the conversation once and submits it like a text prompt, tokenized without adding special tokens
        (the template wrote them), as `samples` requests (`into`: as `submit`'s). Errors about the prompt text name
        `field`."""
        self.check_ready()
        with self._admitting():
            return await self._submit_chat(
                messages, parameters, request_id, deadline, stream, options, field, cache_salt, samples, into
            )

    async def _submit_chat(
        self,
        messages,
        parameters,
        request_id: str,
        deadline,
        stream: bool,
        options: ChatOptions,
        field: str,
        cache_salt: str,
        samples: int,
        into: list[RequestHandle] | None,
    ) -> list[RequestHandle]:
        if options.tools is not None and options.tools.is_constrained:
            if parameters.min_new_tokens:  # refused as with a constraint of the client's own, naming the tools'
                raise InvalidRequestError(
                    "parameters.min_new_tokens",
                    'cannot be combined with a forced tool call (tool_choice "required" or a named function) or '
                    'strict tools under tool_choice "auto": the call grammar alone decides where the reply may end',
                )
            # on a copy: the caller's parameters may be shared by the n samples of one request
            own = router_pb2.SamplingParameters()
            own.CopyFrom(parameters)
            parameters = own
            try:
                self.force_tool_call(parameters, options.tools)
            except InvalidRequestError as e:
                raise self._tool_error(options, e) from None
        text = await self.render_chat(messages, options, field)
        if not text:
            raise InvalidRequestError(field, "the chat template rendered no text")
        request = router_pb2.GenerateRequest(
            text=text, parameters=parameters, request_id=request_id, cache_salt=cache_salt
        )
        try:
            # the worker may have gone while the chat rendered: its readiness is checked again
            ready = self.check_ready()
            return await self._submit(request, ready, deadline, stream, True, OPERATION_CHAT, samples, into)
        except InvalidRequestError as e:
            if e.field.startswith(("text", "prompt")):  # the rendered prompt: the caller knows it as the messages
                raise InvalidRequestError(field, e.detail) from None
            raise self._tool_error(options, e) from None

    @staticmethod
    def _tool_error(options: ChatOptions, error: InvalidRequestError) -> InvalidRequestError:
        """`error`, naming the tool whose schema it is about when it is the call grammar's (the only constraint of
        a chat whose tools constrain the reply: attach_tool_constraint refuses a second one)."""
        if options.tools is not None and options.tools.is_constrained and error.field.startswith(CONSTRAINT_FIELD):
            return schema_error(options.tools, error)
        return error

    def force_tool_call(self, parameters: router_pb2.SamplingParameters, tools: ToolRequest) -> None:
        """Constrains the reply to calls in the template's format (tool_choice required or named), or with "auto"
        and a strict tool to text or calls that match."""
        tokenizer = self.batching_loop.tokenizer
        marker = tokenizer.token_id(MISTRAL_MARKER) if tokenizer is not None else None
        constraint = tool_call_constraint(
            list(tools.tools), tools.choice, tools.parallel, self.tool_format, marker, tools.strict, tools.strict_field
        )
        if constraint is not None:
            attach_tool_constraint(parameters, constraint, "tool_choice" if tools.is_forced else tools.strict_field)

    def count_rejection(self, error: Exception) -> None:
        """Counts a request that failed before reaching the batching loop (as the loop counts the others)."""
        self.batching_loop.hooks.on_rejected(errors.to_status(error).code.name.lower())


async def collect(handle: RequestHandle) -> Completion:
    """The request's whole answer (waits for its last Delta)."""
    out, text = Completion(), []
    async for delta in handle:
        out.token_ids += delta.token_ids
        text.append(delta.text)
        out.logprobs += delta.logprobs
        out.top_logprobs += delta.top_logprobs
        out.prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None else out.prompt_logprobs
        out.finish_reason = delta.finish_reason or out.finish_reason
    out.text = "".join(text)
    return out


def set_request_attributes(
    span, model_name: str, req, stream: bool, operation: str = semconv.OPERATION_TEXT_COMPLETION
) -> None:
    # OTel GenAI semantic conventions (Development status as of semconv 1.37); prompts are never recorded.
    span.set_attributes(
        {
            semconv.GEN_AI_OPERATION_NAME: operation,
            semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_COLIBRI,
            semconv.GEN_AI_REQUEST_MODEL: model_name,
            semconv.GEN_AI_REQUEST_MAX_TOKENS: req.max_new_tokens,
            semconv.GEN_AI_REQUEST_TEMPERATURE: req.temperature,
            semconv.GEN_AI_REQUEST_TOP_P: req.top_p,
            semconv.GEN_AI_REQUEST_TOP_K: req.top_k,
            semconv.GEN_AI_REQUEST_SEED: req.seed,
            semconv.GEN_AI_REQUEST_STREAM: stream,
            semconv.GEN_AI_USAGE_INPUT_TOKENS: len(req.prompt_ids),
        }
    )


def set_usage(handle: RequestHandle, generated: int, reason) -> None:
    span = trace.get_current_span()
    span.set_attributes(
        {
            semconv.GEN_AI_RESPONSE_ID: handle.request_id,
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS: generated,
            semconv.GEN_AI_RESPONSE_FINISH_REASONS: [reason.value if reason else "unknown"],
        }
    )
