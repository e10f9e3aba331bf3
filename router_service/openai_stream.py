"""A streamed OpenAI answer as server-sent events, one choice or several: the status line, one `data: {chunk}` per
event, then `data: [DONE]`. Each step of sending is bounded by `http_write_timeout_s` (router_service.http_guard)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry import trace

from common.tracing import set_request_status
from router_service.http_guard import abort, bounded
from router_service.openai_errors import api_error, grpc_code
from router_service.openai_request import ParsedRequest

# Sends one event: its payload as compact JSON (non-ASCII text as UTF-8, not escaped).
Send = Callable[[dict], Awaitable[None]]


async def stream_events(
    request: web.Request,
    parsed: ParsedRequest,
    request_id: str,
    timeout_s: float,
    write_chunks: Callable[[Send], Awaitable[None]],
) -> web.StreamResponse:
    """Sends the status line, then the chunks `write_chunks` sends through the function it is given, then [DONE].
    An error raised once the status line is sent can only travel as an event, the last before [DONE]. A client
    that goes away or stops reading has its connection aborted; the caller cancels the requests."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": request_id}
    )

    async def event(payload: dict) -> None:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        await bounded(request, resp.write(b"data: " + data + b"\n\n"), timeout_s)

    try:
        await bounded(request, resp.prepare(request), timeout_s)
        try:
            await write_chunks(event)
        except ConnectionError:
            raise
        except Exception as e:
            error = api_error(e, parsed.kind, request_id, parsed)
            set_request_status(trace.get_current_span(), grpc_code(error.status))
            await event(error.body())
        await bounded(request, resp.write(b"data: [DONE]\n\n"), timeout_s)
        await bounded(request, resp.write_eof(), timeout_s)
    except ConnectionError:
        abort(request)
    return resp
