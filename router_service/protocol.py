"""Protocol edges of the public port: request bytes that do not decode, and request ids safe to echo.

gRPC decodes a request before any handler (or interceptor behaviour) runs; a decoder that raises ends the call
UNKNOWN with the exception's class in the message and an ERROR traceback in the log. `DecodeGuardInterceptor`
wraps every method's decoder so that it never raises: the handler then answers INVALID_ARGUMENT. It sits inside
the auth interceptor, so an unauthenticated caller gets UNAUTHENTICATED whatever it sent.
"""
from __future__ import annotations

import inspect

import grpc

from common.errors import InvalidRequestError
from router_service import errors


class Undecodable:
    """What a guarded decoder returns for bytes that are not a valid message."""
    __slots__ = ()


UNDECODABLE = Undecodable()


def is_metadata_safe(value: str) -> bool:
    """Printable ASCII (0x20-0x7e): what a gRPC metadata value may hold."""
    return value.isascii() and value.isprintable()


def _guard(deserializer):
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception:  # DecodeError, and whatever else a decoder raises on hostile bytes
            return UNDECODABLE
    return deserialize


async def _reject(context) -> None:
    await errors.abort(context, InvalidRequestError("request", "the message could not be decoded "
                                                               "(not this method's protobuf request type)"))


def _wrap(handler):
    kwargs = dict(request_deserializer=_guard(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if request is UNDECODABLE:
                await _reject(context)
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result
        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)

    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        # A coroutine that writes, not an async generator: cancellation then ends it (and closes the inner
        # generator) in the handler's own task, so context-local state (trace spans) unwinds where it was set.
        async def unary_stream(request, context):
            if request is UNDECODABLE:
                await _reject(context)
            await _relay(inner_stream(request, context), context)
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)

    async def checked(requests, context):
        async for request in requests:
            if request is UNDECODABLE:
                await _reject(context)
            yield request

    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            result = inner_su(checked(requests, context), context)
            return await result if inspect.isawaitable(result) else result
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)

    inner_ss = handler.stream_stream

    async def stream_stream(requests, context):
        await _relay(inner_ss(checked(requests, context), context), context)
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


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


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """Undecodable request bytes -> INVALID_ARGUMENT, on every method of the server."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return None if handler is None else _wrap(handler)
