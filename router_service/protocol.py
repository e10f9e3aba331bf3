"""Protocol edges of the public port: request bytes that do not decode, and request ids safe to echo.

Undecodable bytes are caught by the guard both services share (common/grpc_guard.py); on the router its
INVALID_ARGUMENT goes through the router's error contract (errors.py: BadRequest naming `request`). The guard
sits inside the auth interceptor, so an unauthenticated caller gets UNAUTHENTICATED whatever it sent.
"""

from __future__ import annotations

from common.errors import InvalidRequestError
from common.grpc_guard import Malformed, MalformedRequestGuard
from router_service import errors


def is_metadata_safe(value: str) -> bool:
    """Printable ASCII (0x20-0x7e), neither beginning nor ending with a space: what a gRPC metadata value may hold
    (HTTP/2 takes a value with a space at either end as malformed, so a strict proxy resets the stream)."""
    return value.isascii() and value.isprintable() and value == value.strip(" ")


async def _reject(context, malformed: Malformed) -> None:
    await errors.abort(context, InvalidRequestError("request", malformed.description))


def decode_guard() -> MalformedRequestGuard:
    """Undecodable request bytes -> INVALID_ARGUMENT in the router's error contract, on every method."""
    return MalformedRequestGuard(_reject)
