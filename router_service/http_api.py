"""The OpenAI-compatible HTTP front (`--http-port`): aiohttp on the router's own event loop.

POST /v1/completions and /v1/chat/completions (streamed as server-sent events when `stream` is true: one
`data: {chunk}` per piece, with `stream_options.include_usage` a last chunk with `choices: []` and the usage,
then `data: [DONE]`), GET /v1/models (and /v1/models/{id}), GET /health (no auth: 200 while the worker is ready
and the router is not draining, else 503). Requests take the gRPC front's path (router_service.frontend):
the same validation, admission, deadlines, metrics and spans (the caller's `traceparent` header is honoured).
Bearer tokens are checked as on the gRPC port (router_service.security), and the port serves TLS with the
gRPC port's certificate files when they are configured. A client that disconnects cancels its request: the
handler task is cancelled (aiohttp's handler_cancellation), which frees the request's KV blocks within a step.
Connections are bounded in time (headers, body, each write) and in number (router_service.http_connections),
the bytes of bodies read at once by a budget (router_service.http_bodies), bodies checked before parsing them
further and 100 Continue sent only once a request is accepted (router_service.http_guard); every error answer
has OpenAI's shape, and only the router's own faults are 500s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time

from aiohttp import web

from common import metrics
from common import tracing as semconv
from common.listen_address import bind_failure
from common.tracing import request_span_name, set_request_status, start_server_span
from router_service import errors, http_bodies, http_guard, http_json, openai_choices
from router_service.errors import clipped
from router_service.frontend import OPERATION_CHAT, Frontend, collect, set_usage
from router_service.http_connections import ConnectionGate, body_unread, close_unread, framing_faulty, listen
from router_service.http_hosts import HostCheck
from router_service.logprobs import TokenTexts
from router_service.openai_errors import HTTP_STATUS, ApiError, api_error, grpc_code
from router_service.openai_request import ParsedRequest, parse_request
from router_service.openai_response import envelope, logprobs_field, response, usage
from router_service.openai_stream import Send, stream_events
from router_service.protocol import is_metadata_safe
from router_service.request_state import new_request_id
from router_service.tool_replies import ToolReply, collect_reply, split

log = logging.getLogger("colibri.router.http")
STATUS_OUTCOMES = {status: code.name.lower() for code, status in HTTP_STATUS.items()}
UNAUTHENTICATED = "missing or wrong bearer token (Authorization: Bearer ...)"
INTERNAL = "internal error; the router's log has the details"
# Bodies up to this size are parsed on the event loop (at most ~15 ms even for a pathological one); larger on a thread.
INLINE_BODY_BYTES = 32 * 1024


def authorized(tokens, authorization: str) -> bool:
    """The router's bearer-token check (the one the gRPC interceptor uses); no tokens configured = open. aiohttp
    decodes header bytes that are not UTF-8 as surrogate escapes: encoding them back compares the bytes sent."""
    return tokens is None or not tokens.enabled or tokens.accepts(authorization.encode("utf-8", "surrogateescape"))


def rejection_outcome(status: int) -> str:
    """The requests metric's outcome for an HTTP rejection: its gRPC status where the metric has it, else
    invalid_argument for a client error (404 model_not_found, 408, 413) and internal for a server one."""
    outcome = STATUS_OUTCOMES.get(status)
    if outcome in metrics.OUTCOMES:
        return outcome
    return "invalid_argument" if status < 500 else "internal"


def error_response(error: ApiError, request_id: str = "") -> web.Response:
    headers = dict(error.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    answer = web.json_response(error.body(), status=error.status, headers=headers)
    # the rest of the body is not read: the connection cannot carry another request
    if error.status in (408, 413, 415) or error.code == http_bodies.CODE:
        answer.force_close()
    return answer


class HttpFront:
    """The aiohttp application and its server; `start` binds, `stop` closes."""

    def __init__(self, frontend: Frontend, tokens=None, ssl_context: ssl.SSLContext | None = None):
        self.frontend, self.tokens, self.ssl_context = frontend, tokens, ssl_context
        self.config = frontend.config
        self.created = int(time.time())
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._gate: ConnectionGate | None = None
        self._texts: TokenTexts | None = None
        self.hosts = HostCheck(enforced=True)  # the listener's own, once bound (start)
        self.bodies = http_bodies.BodyBudget(
            self.config.http_body_budget_bytes,
            self.config.retry_after_s,
            lambda: self.frontend.batching_loop.hooks.on_http_body_refused(),
        )

    def _request_id(self, request: web.Request) -> str:
        """The caller's X-Request-Id: printable ASCII, as the gRPC front's request_id (it is echoed in headers)."""
        request_id = request.headers.get("X-Request-Id", "")
        limit = self.config.max_request_id_length
        if not is_metadata_safe(request_id) or len(request_id) > limit:
            raise ApiError(400, f"X-Request-Id header: must be printable ASCII (0x20-0x7e), at most {limit} characters")
        return request_id

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_message_bytes, middlewares=[self._middleware])
        http_guard.add_routes(
            app,
            (
                ("GET", "/health", self.health),
                ("GET", "/v1/models", self.models),
                ("GET", "/v1/models/{model:.+}", self.model),
                ("POST", "/v1/completions", self.completions),
                ("POST", "/v1/chat/completions", self.chat_completions),
            ),
        )
        return app

    async def start(self, host: str, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, hence its request. aiohttp's
        # keep-alive timer runs from a connection's opening (or previous answer) until a request's headers are
        # complete: it is the header timeout, and the idle timeout too. `listen` binds the port behind the cap.
        # auto_decompress off: bodies are decoded by http_guard.read_body, after the middleware's checks.
        self._runner = web.AppRunner(
            self.app(),
            auto_decompress=False,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
            keepalive_timeout=self.config.http_header_timeout_s,
            logger=http_guard.ProtocolLog(logging.getLogger("colibri.router.http.protocol")),
        )
        await self._runner.setup()
        assert self._runner.server is not None
        try:
            self._server, self._gate = await listen(
                self._runner.server, self.config, self.frontend.batching_loop.hooks, host, port, self.ssl_context
            )
        except OSError:
            await self.stop()
            raise bind_failure("router HTTP", host, port) from None
        self.port = self._server.sockets[0].getsockname()[1]
        bound = [sock.getsockname()[0] for sock in self._server.sockets]
        self.hosts = HostCheck.for_listener(self.config.allowed_hosts, bound)
        self.frontend.batching_loop.hooks.on_http_body_bytes(lambda: self.bodies.held)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()  # no new connections; aiohttp's cleanup ends those it serves
            self._server = None
        if self._gate is not None:
            self._gate.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- middleware: auth, OpenAI-shaped errors for what never reached a handler, answers sent in bounded time ----
    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        answer: web.StreamResponse
        expectation = http_guard.expectation_problem(request)
        repeated = http_guard.repeated_header(request)
        if (wrong_host := self.hosts.refusal(request)) is not None:
            answer = error_response(wrong_host)
        elif repeated is not None:
            answer = error_response(ApiError(400, repeated))
        elif request.path != "/health" and not authorized(self.tokens, request.headers.get("Authorization", "")):
            answer = error_response(ApiError(401, UNAUTHENTICATED, code="invalid_api_key"))
        elif expectation is not None:
            answer = error_response(ApiError(417, expectation, code="expectation_failed"))
        else:
            answer = await self._answer(request, handler)
        # A client never asked for the body it announced may send it or not, one answered before its body arrived
        # sends the rest, and faulty framing leaves the rest unknown: the connection ends with this answer, the
        # rest read on only a little.
        unread = http_guard.refused_before_continue(request) or body_unread(request) or framing_faulty(request)
        if unread and not answer.prepared:
            answer.force_close()
        await http_guard.send(request, answer, self.config.http_write_timeout_s)
        if answer.status == 408 and request.transport is not None:
            request.transport.close()  # a client stalled mid-body has its answer: no linger for it
        elif unread:
            await close_unread(request)
        return answer

    async def _answer(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = f"{request.method} {request.path}: {e.reason}"
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return error_response(ApiError(e.status, message, kind, headers=allow))
        except ConnectionError:  # the client went away: nothing to answer (aiohttp finds the connection closed)
            return web.Response(status=499)
        except Exception:  # a fault of the router's own: logged here, the client learns nothing of it
            log.exception("unexpected error answering %s %s", request.method, request.path)
            return error_response(ApiError(500, INTERNAL, "server_error", code="internal"))

    # ---- routes ----
    async def health(self, request: web.Request) -> web.Response:
        try:
            self.frontend.check_ready()
            if not self.frontend.batching_loop.is_worker_ready:
                raise errors.Unavailable("the worker is not ready", "WORKER_UNAVAILABLE", self.config.retry_after_s)
        except Exception as e:
            return error_response(api_error(e))
        return web.json_response({"status": "ok"})

    def _model_card(self) -> dict:
        card = {"id": self.frontend.model_name, "object": "model", "created": self.created, "owned_by": "colibri"}
        limits = self.frontend.batching_loop.limits
        if limits is not None:
            card["max_model_len"] = limits.room
        return card

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.frontend.model_name:
            return error_response(
                ApiError(
                    404,
                    f"The model `{clipped(name)}` does not exist.",
                    param="model",
                    code="model_not_found",
                )
            )
        return web.json_response(self._model_card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    # ---- the request path ----
    def texts(self) -> TokenTexts:
        """Token texts of scored tokens, cached across requests (for the tokenizer the router has now)."""
        tokenizer = self.frontend.batching_loop.tokenizer
        if self._texts is None or self._texts.tokenizer is not tokenizer:
            self._texts = TokenTexts(tokenizer)
        return self._texts

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        request_id = ""
        operation = OPERATION_CHAT if kind == "chat" else semconv.OPERATION_TEXT_COMPLETION
        frontend = self.frontend
        name = request_span_name(frontend.model_name, operation)
        with start_server_span(name, request.headers.items(), status_from_exception=False) as span:
            handle, parsed, many = None, None, False
            try:
                request_id = self._request_id(request)
                # what the headers alone decide comes before the body is asked for (and read)
                frontend.check_ready()
                frontend.check_room()
                parsed = await self._read_request(request, kind)
                # best_of >= n; echo's choices are built there too, one or more
                many = parsed.best_of > 1 or len(parsed.prompts) > 1 or parsed.echo
                if many:
                    # one id for all its samples, known here: the one its answer, error and log lines name
                    request_id = request_id or new_request_id(kind == "chat")
                    return await openai_choices.serve(self, request, parsed, request_id)
                if kind == "chat":
                    (handle,) = await frontend.submit_chat(
                        parsed.messages,
                        parsed.parameters,
                        request_id,
                        None,
                        parsed.stream,
                        parsed.chat_options,
                        cache_salt=parsed.cache_salt,
                    )
                else:
                    (handle,) = await openai_choices.submit_prompt(frontend, parsed, request_id)
                reply = ToolReply.for_request(frontend, parsed.chat_options.tools) if kind == "chat" else None
                if parsed.stream:
                    return await self._stream(request, parsed, handle, reply)
                out = await (collect_reply(handle, reply) if reply is not None else collect(handle))
                set_usage(handle, len(out.token_ids), out.finish_reason)
                body = response(
                    parsed,
                    handle.request_id,
                    frontend.model_name,
                    out,
                    handle.num_prompt_tokens,
                    self.texts(),
                    handle.num_cached_tokens,
                )
                return web.json_response(body, headers={"X-Request-Id": handle.request_id})
            except ConnectionError:  # the client went away mid-answer: nothing to answer
                raise
            except asyncio.CancelledError:  # it hung up: counted here if the batching loop never had its request
                if handle is None and not many:  # (the samples of `many` it had are counted there)
                    frontend.batching_loop.hooks.on_rejected("cancelled")
                raise
            except Exception as e:
                error = api_error(
                    e,
                    kind,
                    handle.request_id if handle else request_id,
                    parsed,
                )
                reason = e.reason if isinstance(e, errors.RouterError) else None
                span.set_attribute(semconv.ERROR_TYPE, reason or error.code or error.type)
                set_request_status(span, grpc_code(error.status))
                if handle is None:
                    frontend.batching_loop.hooks.on_rejected(rejection_outcome(error.status))
                echo = handle.request_id if handle else request_id
                safe = is_metadata_safe(echo) and len(echo) <= self.config.max_request_id_length
                return error_response(error, echo if safe else "")
            finally:
                if handle is not None:
                    handle.cancel()

    async def _read_request(self, request: web.Request, kind: str) -> ParsedRequest:
        """The request's body read and parsed, its bytes held in the body budget until then (the raw bytes and
        the JSON tree are dropped on return, whatever happens). A body past INLINE_BODY_BYTES is parsed on a
        thread: an 8 MB body of millions of small values took ~4 s to parse and check, every stream stalled."""
        frontend = self.frontend
        limits = frontend.batching_loop.limits
        vocab_size = limits.vocab_size if limits is not None else 0
        defaults = frontend.batching_loop.generation_defaults

        def parse(raw: bytearray) -> ParsedRequest:
            return parse_request(http_json.parse_json(raw), kind, frontend.model_name, defaults, vocab_size)

        framing = self._gate.framing(request) if self._gate is not None else contextlib.nullcontext()
        with self.bodies.reservation() as reservation, framing:
            raw = await http_guard.read_body(
                request, self.config.max_message_bytes, self.config.http_body_timeout_s, reservation
            )
            if len(raw) <= INLINE_BODY_BYTES:
                return parse(raw)
            work = asyncio.get_running_loop().run_in_executor(None, parse, raw)
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                # the client left; the thread holds the body until it ends: so does the budget
                await asyncio.wait([work])
                raise

    async def _stream(self, request: web.Request, parsed, handle, reply: ToolReply | None) -> web.StreamResponse:
        kind, model, created = parsed.kind, self.frontend.model_name, int(time.time())
        texts = self.texts()

        async def chunks(event: Send) -> None:
            generated, first, offset = 0, kind == "chat", 0
            async for delta in handle:
                generated += len(delta.token_ids)
                text, calls = split(reply.feed(delta)) if reply is not None else (delta.text, [])
                if not openai_choices.makes_chunks(parsed, delta, text, calls, first):
                    continue
                lp = None
                if parsed.logprobs:
                    lp = logprobs_field(kind, texts, delta.token_ids, delta.logprobs, delta.top_logprobs, offset)
                # offsets count token texts, as the unary answer's do (held-back text would shift them)
                offset += sum(len(texts(i)) for i in delta.token_ids)
                finish = reply.finish_reason(delta.finish_reason) if reply is not None else None
                args = (delta, text, calls, finish, lp, first)
                for chunk in openai_choices.delta_chunks(parsed, texts, handle.request_id, model, created, *args):
                    await event(chunk)
                first = False
                if delta.finish_reason is not None:
                    set_usage(handle, generated, delta.finish_reason)
            if parsed.include_usage:
                chunk = envelope(kind, handle.request_id, model, created, [], True)
                chunk["usage"] = usage(handle.num_prompt_tokens, generated, handle.num_cached_tokens)
                await event(chunk)

        return await stream_events(request, parsed, handle.request_id, self.config.http_write_timeout_s, chunks)


def ssl_context(config) -> ssl.SSLContext | None:
    """TLS for the HTTP port from the gRPC port's files (mutual when a client CA is set), re-read when they
    change: each handshake takes the newest context."""
    if not config.tls_cert_file:
        return None
    from router_service.security import WatchedFiles

    paths = [config.tls_cert_file, config.tls_key_file] + (
        [config.tls_client_ca_file] if config.tls_client_ca_file else []
    )

    def build(_contents) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        if config.tls_client_ca_file:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(config.tls_client_ca_file)
        return context

    watched = WatchedFiles(paths, build, "http tls")
    base = watched.value

    def newest(connection, _server_name, _context) -> None:
        current = watched.current()
        if current is not base:
            connection.context = current

    base.sni_callback = newest
    return base
