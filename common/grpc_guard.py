"""Request bytes that do not parse as the method's message: INVALID_ARGUMENT naming the message type.

gRPC decodes a request before any handler runs; a decoder that raises ends the call UNKNOWN with the
exception's class in the message and an ERROR traceback in the log. `MalformedRequestGuard` wraps every
method's decoder so that it never raises: it hands over a `Malformed` instead, and the handler answers
INVALID_ARGUMENT for that call alone. On a request stream a malformed message ends the stream (its framing
cannot be trusted after it): the handler sees the stream end and answers what came before, then the call
ends INVALID_ARGUMENT. Install it after the auth interceptor (common/auth.py): an unauthenticated caller's
bytes are not parsed at all.
"""

from __future__ import annotations

import inspect

import grpc


class Malformed:
    """What a guarded decoder hands over instead of a message it could not parse."""

    __slots__ = ("description",)

    def __init__(self, type_name: str):
        self.description = f"not a {type_name} (the bytes do not parse as this method's request)"


async def refuse_invalid_argument(context, malformed: Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {malformed.description}")


def _message_name(deserializer) -> str:
    """The protobuf type a generated `Message.FromString` decodes to."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "") or "message of this method's request type"


def tolerant(deserializer):
    """`deserializer`, returning a Malformed where it would raise."""
    if deserializer is None:
        return None
    name = _message_name(deserializer)

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception:  # DecodeError, and whatever else a decoder raises on hostile bytes
            return Malformed(name)

    return deserialize


def guarded(handler, reject=refuse_invalid_argument):
    """`handler` with a decoder that never raises; `reject(context, malformed)` ends a call whose request (or
    one of whose streamed requests) did not parse."""
    kwargs = {
        "request_deserializer": tolerant(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, Malformed):
                await reject(context, request)
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)

    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        # A coroutine that writes, not an async generator: cancellation then ends it (and closes the inner
        # generator) in the handler's own task, so context-local state (trace spans) unwinds where it was set.
        async def unary_stream(request, context):
            if isinstance(request, Malformed):
                await reject(context, request)
            await _relay(inner_stream(request, context), context)

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)

    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            seen: list[Malformed] = []
            result = inner_su(_until_malformed(requests, seen), context)
            response = await result if inspect.isawaitable(result) else result
            if seen:
                await reject(context, seen[0])
            return response

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)

    inner_ss = handler.stream_stream

    async def stream_stream(requests, context):
        seen: list[Malformed] = []
        await _relay(inner_ss(_until_malformed(requests, seen), context), context)
        if seen:
            await reject(context, seen[0])

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


async def _until_malformed(requests, seen: list):
    """The requests up to the first malformed one, which is put in `seen` and ends the stream."""
    async for request in requests:
        if isinstance(request, Malformed):
            seen.append(request)
            return
        yield request


async def _relay(result, context) -> None:
    """Writes what a streaming handler yields (or awaits a handler that writes for itself), and closes the
    generator in this task."""
    if not hasattr(result, "__aiter__"):
        await result
        return
    try:
        async for response in result:
            await context.write(response)
    finally:
        await result.aclose()


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    """Request bytes that do not parse -> `reject` (INVALID_ARGUMENT by default), on every method of the server."""

    def __init__(self, reject=refuse_invalid_argument):
        self.reject = reject

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return None if handler is None else guarded(handler, self.reject)
