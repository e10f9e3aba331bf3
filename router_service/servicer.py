"""GenerationService: a thin grpc.aio servicer (protobuf <-> batching loop).

Each method converts, delegates to validation and the batching loop, and converts back; errors of every kind
become a status in `errors.to_status`, the one place that maps them. A request leaves the batching loop in a
`finally`, so a client that cancels or disconnects (the handler task is cancelled) frees its KV blocks at once.
GenerateStream writes with `context.write` from a coroutine rather than yielding: a cancelled call then unwinds
in its own task (a suspended generator would be closed later, in another task, where its trace context cannot
be detached). Text is tokenized off the event loop once every cheap check has passed (validation). Chat and
ChatStream render the messages with the chat template and then run exactly as Generate and GenerateStream do;
the request path itself (admission, validation, submit) is router_service.frontend's, shared with the HTTP front.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from pathlib import Path

import grpc
from google.protobuf import json_format, struct_pb2
from opentelemetry import trace

from common import tracing as semconv
from common.errors import InvalidRequestError
from common.pb import router_pb2, router_pb2_grpc
from common.tracing import request_span_name, set_request_status, start_server_span
from router_service import errors
from router_service.batching_loop import BatchingLoop
from router_service.call_deadline import CALL_DEADLINE, enter_call
from router_service.chat import ChatTemplate
from router_service.constraints import FIELD as CONSTRAINT_FIELD
from router_service.frontend import OPERATION_CHAT, STOP_REASONS, ChatOptions, Frontend, collect, set_usage
from router_service.logprobs import PromptLogprob, TokenTexts, Top
from router_service.protocol import is_metadata_safe
from router_service.request_state import RequestHandle
from router_service.tool_calls import ToolCall, ToolCallDelta
from router_service.tool_replies import ToolReply, collect_reply, split
from router_service.tool_request import check_tool_count
from router_service.tool_request import from_pb as tools_from_pb
from router_service.validation import (
    ModelLimits,
    PromptRequest,
    check_fits_context,
    check_ids,
    check_known_fields,
    check_text_size,
    prompt_byte_limit,
)

log = logging.getLogger("colibri.router")
# The router ends a request this much before the client's gRPC deadline (at most a quarter of the time left), so
# the client gets the router's DEADLINE_EXCEEDED (ErrorInfo, request id) rather than gRPC cutting the call first.
DEADLINE_HEADROOM_S = 0.05


class GenerationServicer(router_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        batching_loop: BatchingLoop,
        model_name: str = "",
        chat_template: ChatTemplate | None = None,
        frontend: Frontend | None = None,
    ):
        self.batching_loop = batching_loop
        self.config = batching_loop.config
        self.frontend = frontend or Frontend(batching_loop, model_name, chat_template)

    @property
    def model_name(self) -> str:
        return self.frontend.model_name

    async def _submit(self, request, context, stream: bool) -> tuple[RequestHandle, ToolReply | None]:
        """The request's handle, and for a chat offering tools the parser its reply goes through."""
        remaining = context.time_remaining()
        if remaining is None:
            return await self._prepare(request, None, stream)
        deadline = time.monotonic() + remaining - min(DEADLINE_HEADROOM_S, remaining / 4)
        CALL_DEADLINE.set(deadline)  # for the render and tokenizing it starts off the loop (this call's task only)
        # The batching loop ends a request at its deadline; before it gets there (a chat rendering behind a burst,
        # seconds of tokenizing, a grammar compiling) the same deadline applies, or gRPC would cut the call first
        # with a bare DEADLINE_EXCEEDED: no ErrorInfo, no x-request-id.
        timeout = asyncio.timeout(deadline - time.monotonic())
        try:
            async with timeout:
                return await self._prepare(request, deadline, stream)
        except TimeoutError:
            if not timeout.expired():
                raise
            raise errors.DeadlineExceeded(
                "the request's deadline passed before it reached the queue (while it was rendered, tokenized or "
                "its grammar compiled)",
                reason="QUEUE_TIMEOUT",
            ) from None

    async def _prepare(self, request, deadline: float | None, stream: bool) -> tuple[RequestHandle, ToolReply | None]:
        if isinstance(request, PromptRequest):
            return (await self.frontend.submit(request, deadline, stream))[0], None
        limits = self.frontend.check_ready()
        self.frontend.check_room()  # at capacity the chat is refused before any of it is read
        _check_chat_size(request, limits, prompt_byte_limit(self.config, limits))
        check_known_fields(request)  # the chat's own fields and its messages' (its parameters are checked again)
        kwargs = _template_kwargs(request.chat_template_kwargs) if request.HasField("chat_template_kwargs") else None
        tools = tools_from_pb(request)
        options = ChatOptions(
            continue_final_message=request.continue_final_message, template_kwargs=kwargs, tools=tools
        )
        (handle,) = await self.frontend.submit_chat(
            request.messages,
            request.parameters,
            request.request_id,
            deadline,
            stream,
            options,
            cache_salt=request.cache_salt,
        )
        return handle, ToolReply.for_request(self.frontend, tools)

    async def Generate(self, request, context):
        return await self._unary(request, context, router_pb2.GenerateResponse)

    async def GenerateStream(self, request, context):
        await self._stream(request, context, router_pb2.GenerateStreamResponse)

    async def Chat(self, request, context):
        return await self._unary(request, context, router_pb2.ChatResponse, OPERATION_CHAT)

    async def ChatStream(self, request, context):
        await self._stream(request, context, router_pb2.ChatStreamResponse, OPERATION_CHAT)

    async def _unary(self, request, context, response_type, operation: str = semconv.OPERATION_TEXT_COMPLETION):
        with start_server_span(
            request_span_name(self.model_name, operation), context.invocation_metadata(), status_from_exception=False
        ):
            handle = None
            try:
                handle, reply = await self._submit(request, context, stream=False)
                out = await (collect_reply(handle, reply) if reply is not None else collect(handle))
                set_usage(handle, len(out.token_ids), out.finish_reason)
                extra = (
                    {"tool_calls": [_call_pb(c, i) for i, c in enumerate(out.tool_calls)]} if reply is not None else {}
                )
                response = response_type(
                    **extra,
                    request_id=handle.request_id,
                    token_ids=out.token_ids,
                    text=out.text,
                    stop_reason=STOP_REASONS.get(out.finish_reason, router_pb2.STOP_REASON_UNSPECIFIED)
                    if out.finish_reason is not None
                    else router_pb2.STOP_REASON_UNSPECIFIED,
                    prompt_tokens=handle.num_prompt_tokens,
                    generated_tokens=len(out.token_ids),
                    logprobs=out.logprobs,
                    routing=self._routing(),
                    top_logprobs=[self._top_pb(top) for top in out.top_logprobs],
                    prompt_logprobs=self._prompt_pb(out.prompt_logprobs),
                    cached_prompt_tokens=handle.num_cached_tokens,
                )
                self._check_size(response)
                # as a stream's and an error's: a client reads the id from the metadata, whatever the call
                await context.send_initial_metadata((("x-request-id", handle.request_id),))
                return response
            except grpc.aio.InternalError:  # only the context's own sends raise it
                raise _call_ended(handle.request_id if handle is not None else "") from None
            except asyncio.CancelledError:
                self._count_departure(context, handle)
                raise
            except Exception as e:  # mapped to a status in errors.to_status (unexpected ones logged)
                await self._abort(context, e, request, handle, count=handle is None)
            finally:
                if handle is not None:
                    handle.cancel()

    async def _stream(self, request, context, message_type, operation: str = semconv.OPERATION_TEXT_COMPLETION):
        with start_server_span(
            request_span_name(self.model_name, operation), context.invocation_metadata(), status_from_exception=False
        ):
            handle = None
            try:
                handle, reply = await self._submit(request, context, stream=True)
                await context.send_initial_metadata((("x-request-id", handle.request_id),))
                generated = 0
                async for delta in handle:
                    generated += len(delta.token_ids)
                    text, calls = split(reply.feed(delta)) if reply is not None else (delta.text, [])
                    extra = {"tool_calls": [_call_pb(c) for c in calls]} if calls else {}
                    message = message_type(
                        **extra,
                        request_id=handle.request_id,
                        token_ids=delta.token_ids,
                        text=text,
                        logprobs=delta.logprobs,
                        top_logprobs=[self._top_pb(top) for top in delta.top_logprobs],
                        prompt_logprobs=self._prompt_pb(delta.prompt_logprobs),
                    )
                    if delta.finish_reason is not None:
                        message.stop_reason = STOP_REASONS.get(delta.finish_reason, router_pb2.STOP_REASON_UNSPECIFIED)
                        message.prompt_tokens = handle.num_prompt_tokens
                        message.generated_tokens = generated
                        message.routing = self._routing()
                        message.cached_prompt_tokens = handle.num_cached_tokens
                        set_usage(handle, generated, delta.finish_reason)
                    self._check_size(message)
                    await self._write(context, message)
            except grpc.aio.InternalError:  # only the context's own writes raise it
                raise _call_ended(handle.request_id if handle is not None else "") from None
            except asyncio.CancelledError:
                self._count_departure(context, handle)
                raise
            except Exception as e:  # mapped to a status in errors.to_status (unexpected ones logged)
                if handle is not None:  # the status may wait behind messages a slow client has not read
                    handle.cancel(e if isinstance(e, errors.RouterError) else None)
                await self._abort(context, e, request, handle, count=handle is None)
            finally:
                if handle is not None:
                    handle.cancel()

    def _check_size(
        self, message, advice: str = "ask for fewer prompt_logprobs or top_logprobs, or fewer tokens"
    ) -> None:
        """gRPC refuses to send a message over max_message_bytes (prompt_logprobs of a long prompt: ~300 bytes a
        token) with a bare RESOURCE_EXHAUSTED and a traceback logged at ERROR: refused here, in the router's terms."""
        size, limit = message.ByteSize(), self.config.max_message_bytes
        if size > limit:
            raise errors.AnswerTooLarge(f"the answer would be {size} bytes, over max_message_bytes ({limit}): {advice}")

    async def _write(self, context, message) -> None:
        """One message of a stream. gRPC waits without limit for a client that stops reading (HTTP/2 flow control),
        while its request would run on and queue every message; past grpc_write_timeout_s the request ends instead
        (its status reaches the client after the messages it has not read)."""
        timeout_s = self.config.grpc_write_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await context.write(message)
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"a message waited {timeout_s:g} s for the client to read it (grpc_write_timeout_s)",
                reason="CLIENT_TOO_SLOW",
            ) from None

    async def Tokenize(self, request, context):
        try:
            enter_call(context.time_remaining(), "tokenizing")
            if self.batching_loop.tokenizer is None:
                raise InvalidRequestError("text", "this model has no tokenizer (start the router with --model DIR)")
            check_text_size("text", request.text, prompt_byte_limit(self.config, self.batching_loop.limits))
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            if not (request.return_pieces or request.return_offsets):
                ids = await self.batching_loop.tokenizer.encode_async(request.text, add)
                return router_pb2.TokenizeResponse(token_ids=ids)
            ids, pieces, offsets = await self.batching_loop.tokenizer.encode_details_async(request.text, add)
            response = router_pb2.TokenizeResponse(
                token_ids=ids,
                pieces=pieces if request.return_pieces else [],
                offsets=[router_pb2.TokenOffset(start=a, end=b) for a, b in offsets] if request.return_offsets else [],
            )
            # a token's piece and offsets take ~10 bytes, more than its text's byte
            self._check_size(response, "ask without return_pieces or return_offsets, or for a shorter text")
            return response
        except Exception as e:  # mapped to a status in errors.to_status
            await self._abort(context, e, request, None)

    async def Detokenize(self, request, context):
        try:
            enter_call(context.time_remaining(), "detokenizing")
            tokenizer = self.batching_loop.tokenizer
            if tokenizer is None:
                raise InvalidRequestError(
                    "token_ids", "this model has no tokenizer (start the router with --model DIR)"
                )
            limit = prompt_byte_limit(self.config, self.batching_loop.limits)
            if len(request.token_ids) > limit:
                raise InvalidRequestError("token_ids", f"at most {limit} ids allowed, got {len(request.token_ids)}")
            limits = self.batching_loop.limits
            check_ids("token_ids", request.token_ids, limits.vocab_size if limits else tokenizer.vocab_size)
            text = await tokenizer.decode_async(request.token_ids, request.skip_special_tokens)
            response = router_pb2.DetokenizeResponse(text=text)
            self._check_size(response, "ask for fewer ids at a time")  # a token's text can be longer than its id
            return response
        except Exception as e:  # mapped to a status in errors.to_status
            await self._abort(context, e, request, None)

    async def ModelInfo(self, request, context):
        info, limits = self.batching_loop.info, self.batching_loop.limits
        if info is None or limits is None:
            error = errors.Unavailable(
                "the worker has not connected yet", "WORKER_UNAVAILABLE", self.config.retry_after_s
            )
            await self._abort(context, error, request, None)
        hf = _hf_config(info.hf_config_json)
        return router_pb2.ModelInfoResponse(
            model_name=self.model_name,
            family=info.family,
            dtype=info.dtype,
            vocab_size=limits.vocab_size,
            max_sequence_length=limits.room,
            eos_token_ids=limits.eos_token_ids,
            has_tokenizer=limits.has_tokenizer,
            backend=info.backend,
            routing=info.routing,
            num_experts=config_count(hf, "num_experts", "num_local_experts"),
            num_experts_per_tok=config_count(hf, "num_experts_per_tok"),
            server_version=_version(),
            generation_config=self._generation_config(),
            prefix_caching=self.batching_loop.prefix_caching,
            expert_dtypes=list(info.expert_dtypes),
            head_dtype=info.head_dtype,
            attention_dtype=info.attention_dtype,
        )

    def _generation_config(self) -> struct_pb2.Struct:
        """The model directory's generation_config.json (read once; empty when absent or not an object)."""
        if not hasattr(self, "_generation_config_pb"):
            self._generation_config_pb = struct_pb2.Struct()
            path = Path(self.config.model) / "generation_config.json" if self.config.model else None
            if path is not None and path.is_file():
                value = _hf_config(path.read_text(encoding="utf-8", errors="replace"))
                self._generation_config_pb.update({k: v for k, v in value.items() if not k.startswith("_")})
        return self._generation_config_pb

    def _routing(self) -> str:
        return self.frontend.routing

    def _texts(self) -> TokenTexts:
        tokenizer = self.batching_loop.tokenizer
        texts: TokenTexts | None = getattr(self, "_token_texts", None)
        if texts is None or texts.tokenizer is not tokenizer:
            texts = self._token_texts = TokenTexts(tokenizer)
        return texts

    def _top_pb(self, top: Top) -> router_pb2.TopLogprobs:
        texts = self._texts() if self.batching_loop.tokenizer is not None else None
        return router_pb2.TopLogprobs(
            token_ids=[i for i, _ in top],
            logprobs=[v for _, v in top],
            texts=[texts(i) for i, _ in top] if texts else [],
        )

    def _prompt_pb(self, entries: list[PromptLogprob] | None) -> list[router_pb2.PromptTokenLogprob]:
        texts = self._texts() if self.batching_loop.tokenizer is not None else None
        out = []
        for e in entries or ():
            message = router_pb2.PromptTokenLogprob(
                token_id=e.token_id, text=texts(e.token_id) if texts else "", top_logprobs=self._top_pb(e.top)
            )
            if e.logprob is not None:
                message.logprob = e.logprob
            out.append(message)
        return out

    def _count_departure(self, context, handle: RequestHandle | None) -> None:
        """The call ended (the client left, or gRPC cut it at its deadline) before its request reached the batching
        loop, which counts the others: counted here."""
        if handle is None:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            self.batching_loop.hooks.on_rejected("deadline_exceeded" if expired else "cancelled")

    async def _abort(self, context, error: Exception, request, handle, count: bool = False) -> None:
        """Ends the RPC with `error`'s status; `count`: it never reached the batching loop, so count it here."""
        error = _as_sent(error, request)
        request_id = handle.request_id if handle is not None else getattr(request, "request_id", "")
        if not is_metadata_safe(request_id) or len(request_id) > self.config.max_request_id_length:
            request_id = ""  # never echo what validation refused
        span = trace.get_current_span()
        span.set_attribute(semconv.ERROR_TYPE, getattr(error, "reason", "VALIDATION"))
        status = errors.to_status(error, request_id)
        set_request_status(span, status.code)
        if count:
            self.batching_loop.hooks.on_rejected(status.code.name.lower())
        metadata = tuple(status.trailing_metadata) + ((("x-request-id", request_id),) if request_id else ())
        try:
            await context.abort(status.code, status.details, metadata)
        except grpc.aio.InternalError:
            raise _call_ended(request_id) from None


def _check_chat_size(request, limits: ModelLimits, byte_limit: int) -> None:
    """Bounds a chat's repeated fields, and what the template would get parsed, before anything walks them: 16 MiB
    holds millions of empty messages or tools (seconds of Python on the event loop to check each) or megabytes of
    schema JSON. Every message and call takes a token of the context at least; the rendered prompt has to fit
    max_prompt_bytes anyway."""
    check_fits_context("messages", "messages", len(request.messages), limits)
    check_fits_context("messages", "tool calls", sum(len(m.tool_calls) for m in request.messages), limits)
    check_tool_count(len(request.tools))
    for field, what, size in (
        ("messages", "their tool calls", sum(c.ByteSize() for m in request.messages for c in m.tool_calls)),
        ("tools", "the tools", sum(t.ByteSize() for t in request.tools)),
        ("chat_template_kwargs", "the variables", request.chat_template_kwargs.ByteSize()),
    ):
        if size > byte_limit:
            raise InvalidRequestError(
                field, f"{what} must be at most {byte_limit} bytes (max_prompt_bytes), got {size}"
            )


def _as_sent(error: Exception, request) -> Exception:
    """`error` naming what the client sent: the constraint of a chat that set none is its tools' call grammar,
    built by the router, so its errors (at compile or mid-reply) are the tools' (as on the HTTP front)."""
    if (
        isinstance(error, InvalidRequestError)
        and error.field.startswith(CONSTRAINT_FIELD)
        and isinstance(request, router_pb2.ChatRequest | router_pb2.ChatStreamRequest)
        and request.tools
        and not request.parameters.HasField("constraint")
    ):
        return InvalidRequestError("tools", error.detail)
    return error


def _template_kwargs(kwargs: struct_pb2.Struct) -> dict:
    """chat_template_kwargs as JSON would give them. A Struct's number may be NaN or infinite, which JSON has no
    way to write (json_format raises ValueError): the client's mistake, not the router's."""
    try:
        return json_format.MessageToDict(kwargs)
    except ValueError:
        raise InvalidRequestError(
            "chat_template_kwargs", "numbers must be finite (JSON has no NaN or Infinity)"
        ) from None


def _call_pb(call: ToolCall | ToolCallDelta, index: int = 0) -> router_pb2.ToolCall:
    index = call.index if isinstance(call, ToolCallDelta) else index
    return router_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments, index=index)


def _call_ended(request_id: str) -> asyncio.CancelledError:
    """gRPC fails a write or a status sent on a call it has just ended (its deadline passed, or the client left,
    an instant before): that is the call's end, not a fault. A handler that ends as cancelled tells gRPC so;
    the failed send itself would be logged at ERROR."""
    log.debug("the call ended before its answer was sent", extra={"request_id": request_id})
    return asyncio.CancelledError()


def _version() -> str:
    try:
        return importlib.metadata.version("colibri")
    except importlib.metadata.PackageNotFoundError:
        return ""


def config_count(hf: dict, *keys: str) -> int:
    """The first of `keys` config.json writes a value for, 0 when none: null is absent (Qwen3-MoE may write
    `"num_experts": null` beside `num_local_experts`), never the 0 it was read as; a non-integer is 0 too."""
    value = next((hf[key] for key in keys if hf.get(key) is not None), 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _hf_config(text: str) -> dict:
    import json

    try:
        value = json.loads(text) if text else {}
        return value if isinstance(value, dict) else {}
    except ValueError:
        return {}
