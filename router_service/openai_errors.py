"""OpenAI's error shape: ``ApiError`` (an HTTP error answer, {"error": {"message", "type", "param", "code"}})
and the mapping of whatever a request raised onto it: the router's field names become the ones the client sent,
gRPC status codes become HTTP statuses (and back, for the gRPC front). No I/O here."""

from __future__ import annotations

import math
import re
from typing import Protocol

import grpc

from common.errors import InvalidRequestError
from router_service import errors

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_GRPC_CODES = {http: code for code, http in HTTP_STATUS.items()}


def grpc_code(http_status: int) -> grpc.StatusCode:
    """The gRPC front's code of an HTTP error status (another 5xx: INTERNAL; another 4xx: INVALID_ARGUMENT)."""
    fallback = grpc.StatusCode.INTERNAL if http_status >= 500 else grpc.StatusCode.INVALID_ARGUMENT
    return _GRPC_CODES.get(http_status, fallback)


# Router validation fields (after `parameters.`) -> OpenAI parameter names.
PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop_sequences": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "truncate_input_tokens": "truncate_prompt_tokens",
    "logprobs": "logprobs",
}
# Router field names a router message may mention besides its own field, as whole words.
INTERNAL_NAME = re.compile(r"\b(max_new_tokens|min_new_tokens|stop_sequences|truncate_input_tokens)\b")
PROMPT_FIELDS = ("text", "token_ids", "prompt")  # the router's names for a prompt's fields


class FieldNames(Protocol):
    """The names a request gave its fields (router_service.openai_request.ParsedRequest), for its errors."""

    max_tokens_name: str  # max_tokens or max_completion_tokens
    constraint_name: str  # the request field a constraint came from


class ApiError(Exception):
    """An HTTP error answer in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        param, message = errors.clipped_error(param, message)  # the client's own input, quoted: cut
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(
    exc: BaseException, kind: str = "completion", request_id: str = "", parsed: FieldNames | None = None
) -> ApiError:
    """The OpenAI error for anything a request raised (unexpected exceptions are logged, their text hidden);
    `parsed` names the request's own fields (max_tokens or max_completion_tokens, where a constraint came from)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        param = openai_param(exc.field, kind, parsed)
        message = f"{param}: {_client_names(exc, parsed)}" if param else str(exc)
        too_long = "max_sequence_length (" in message or "KV capacity (" in message
        code = "context_length_exceeded" if too_long else None
        return ApiError(400, message, "invalid_request_error", param, code)
    status = errors.to_status(exc, request_id)  # the gRPC front's mapping and message (INTERNAL is logged there)
    http = HTTP_STATUS.get(status.code, 500)
    # Only the router's own errors carry a reason for clients (UnicodeError's `reason` is its internal text).
    reason = exc.reason.lower() if isinstance(exc, errors.RouterError) else "internal"
    headers = {}
    if isinstance(exc, errors.Overloaded | errors.Unavailable):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    kind_name = {401: "invalid_request_error", 429: "rate_limit_error"}.get(http, "server_error")
    return ApiError(http, status.details, kind_name, None, "invalid_api_key" if http == 401 else reason, headers)


def _client_names(exc: InvalidRequestError, parsed: FieldNames | None) -> str:
    """The error's text with the router's field names (`min_tokens: must be <= max_new_tokens (2)`) as the client
    sent them; a constraint's is left as it is (the grammar engine's errors may quote the client's grammar)."""
    text = exc.detail
    if exc.field.startswith("parameters.constraint"):
        return text
    names = {**PARAM_NAMES, "max_new_tokens": parsed.max_tokens_name if parsed is not None else "max_tokens"}
    return INTERNAL_NAME.sub(lambda m: names[m.group()], text)


def openai_param(field_name: str, kind: str, parsed: FieldNames | None = None) -> str:
    """`parameters.top_p` -> `top_p`, `text` -> `prompt`, `token_ids.ids[5]` -> `prompt[5]`, `messages[2]` stays;
    `parameters.constraint...` -> the field the constraint came from (`response_format.json_schema.schema`,
    `guided_regex`, `tools`, ...)."""
    if field_name.startswith("parameters."):
        rest = field_name[len("parameters.") :]
        base, bracket, index = rest.partition("[")
        if base.split(".")[0] == "constraint" and parsed is not None:
            return parsed.constraint_name
        name = PARAM_NAMES.get(base, base)
        name = parsed.max_tokens_name if parsed is not None and name == "max_tokens" else name
        name = "logprobs" if name == "top_logprobs" and kind == "completion" else name
        return name + (bracket + index if bracket else "")
    if field_name.startswith(PROMPT_FIELDS):
        if kind != "completion":
            return "messages"
        if field_name.startswith(("prompt[", "token_ids.ids[")):  # a prompt of a list, a token of the prompt
            return "prompt" + "".join(field_name.partition("[")[1:])
        return "prompt"
    return field_name


def in_prompt_list(error: InvalidRequestError, index: int) -> InvalidRequestError:
    """A prompt's error as the error of prompt `index` of a list: `token_ids.ids[5]` -> `prompt[2][5]`."""
    if not error.field.startswith(PROMPT_FIELDS):
        return error
    token = "".join(error.field.partition("[")[1:]) if error.field.startswith("token_ids.ids[") else ""
    return InvalidRequestError(f"prompt[{index}]{token}", error.detail)
