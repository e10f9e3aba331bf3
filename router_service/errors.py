"""The router's error contract, in one place: exception classes and their gRPC status (docs/api.md, status codes).

INVALID_ARGUMENT carries google.rpc.BadRequest naming the field; RESOURCE_EXHAUSTED and UNAVAILABLE carry RetryInfo
(the HTTP front's Retry-After); every status carries google.rpc.ErrorInfo with an UPPER_SNAKE reason so clients can branch without parsing text.
"""

from __future__ import annotations

import logging
import re

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from common.errors import InvalidRequestError

log = logging.getLogger("colibri.router")
DOMAIN = "colibri.router"
# An error quotes the client's field names and values, which can be as long as its request: cut, so the answer stays
# small (on gRPC, a message past the peer's metadata limit turned an INVALID_ARGUMENT into RESOURCE_EXHAUSTED).
MAX_ECHO = 64  # a name or value quoted back (a model name, a huge integer's digits)
MAX_FIELD = 128  # a field path: `messages[12].tool_calls[3].function.arguments` is 45
MAX_MESSAGE = 1024


# Line breaks (every one str.splitlines knows) and other control characters, written out as escapes: an error
# quotes what the client sent (a chat template's own raise_exception quotes a role), and stays one line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def clipped(text: str, limit: int = MAX_ECHO) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def clipped_error(field: str | None, message: str) -> tuple[str | None, str]:
    """(field, message) of an error on one line, cut to MAX_FIELD / MAX_MESSAGE; a message that begins with its
    field begins with the cut field."""
    if field is not None:
        escaped = one_line(field)
        message = escaped + message[len(field) :] if message.startswith(field) else message
        field = escaped
    message = one_line(message)
    if field is not None and len(field) > MAX_FIELD:  # a client's own key in the path
        short = clipped(field, MAX_FIELD)
        message = short + message[len(field) :] if message.startswith(field) else message
        field = short
    return field, clipped(message, MAX_MESSAGE)


class RouterError(Exception):
    """A request failed with a known gRPC status."""

    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        if reason:
            self.reason = reason


class Overloaded(RouterError):
    code, reason = grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @classmethod
    def at_capacity(cls, limit: int, retry_after_s: float) -> Overloaded:
        """max_concurrent_requests (`limit`) requests are in flight."""
        return cls(f"model is overloaded: {limit} requests in flight (max_concurrent_requests)", retry_after_s)


class AnswerTooLarge(RouterError):
    """An answer over the port's max_message_bytes: asking again gets the same (no RetryInfo)."""

    code, reason = grpc.StatusCode.RESOURCE_EXHAUSTED, "ANSWER_TOO_LARGE"


class Unavailable(RouterError):
    """Retry later (`retry_after_s`), here or elsewhere: draining, or no worker to serve the request now."""

    code, reason = grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"

    def __init__(self, message: str, reason: str | None = None, retry_after_s: float = 1.0):
        super().__init__(message, reason)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(RouterError):
    code, reason = grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"


class GenerationFailed(RouterError):
    code, reason = grpc.StatusCode.INTERNAL, "GENERATION_FAILED"


class Unauthenticated(RouterError):
    code, reason = grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"


def log_text(error: BaseException) -> str:
    """What a request's log line says of the error it ended with: a client mistake's message can quote its input
    (a token id, a piece of its grammar), so it is named by its field alone; the server's own errors in full."""
    if isinstance(error, InvalidRequestError):
        return f"invalid {error.field}"
    return str(error)


def _pack(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def to_status(exc: BaseException, request_id: str = "") -> grpc.Status:
    """The gRPC status (code, one-line message, rich details) for any exception a handler raises.

    INTERNAL answers say only that the request failed and its id; what failed (worker messages, exceptions)
    goes to the log with the request id, never to the client.
    """
    details = []
    if isinstance(exc, InvalidRequestError):
        field, message = clipped_error(exc.field, str(exc))
        code, reason = grpc.StatusCode.INVALID_ARGUMENT, "VALIDATION"
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    elif isinstance(exc, RouterError):
        code, reason, message = exc.code, exc.reason, clipped(one_line(str(exc)), MAX_MESSAGE)
        if isinstance(exc, Overloaded | Unavailable):
            seconds = max(exc.retry_after_s, 0.0)
            delay = duration_pb2.Duration(seconds=int(seconds), nanos=int((seconds % 1) * 1e9))
            details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    else:
        log.exception("unexpected error in a request handler", extra={"request_id": request_id})
        code, reason, message = grpc.StatusCode.INTERNAL, "INTERNAL", str(exc)
    if code == grpc.StatusCode.INTERNAL:
        if isinstance(exc, RouterError):
            log.error("request failed: %s", message, extra={"request_id": request_id, "reason": reason})
        message = f"internal error{f' (request {request_id})' if request_id else ''}; the router's log has the details"
    metadata = {"request_id": request_id} if request_id else {}
    details.insert(0, _pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata)))
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=details)
    return rpc_status.to_status(status)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException, request_id: str = "") -> None:
    """Ends the RPC with exc's status (raises grpc's AbortError, as context.abort does)."""
    status = to_status(exc, request_id)
    await context.abort(status.code, status.details, status.trailing_metadata)
