"""The shared auth rule on both services' interceptor chains: an unauthenticated caller's bytes are never
parsed (a deserializer that counts its calls stays at zero) on every RPC shape; with the token they are. And
the shared guard: bytes that do not parse are INVALID_ARGUMENT, and end a request stream after what came
before it was answered."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import pytest

from common import auth
from common.auth import TokenSet
from expert_service.serving.main import worker_interceptors
from router_service.security import public_interceptors
from tests.grpc_teardown import served

SERVICE = "test.Probe"
TOKEN = "probe-token"
SHAPES = ("Unary", "ServerStream", "ClientStream", "BidiStream")


class CountingParser:
    """A request deserializer whose every call is observable; it refuses bytes starting with b"bad"."""

    def __init__(self):
        self.calls = 0

    def __call__(self, data: bytes) -> bytes:
        self.calls += 1
        if data.startswith(b"bad"):
            raise ValueError("not a probe message")
        return data


def probe_handlers(parser: CountingParser) -> dict:
    """One method of each shape; each answers the request bytes it was given (joined, for request streams)."""

    async def unary(request, context):
        return request

    async def server_stream(request, context):
        yield request

    async def client_stream(requests, context):
        return b"".join([r async for r in requests])

    async def bidi(requests, context):
        async for request in requests:
            yield request

    kinds = (
        grpc.unary_unary_rpc_method_handler,
        grpc.unary_stream_rpc_method_handler,
        grpc.stream_unary_rpc_method_handler,
        grpc.stream_stream_rpc_method_handler,
    )
    behaviours = (unary, server_stream, client_stream, bidi)
    return {
        name: make(behaviour, request_deserializer=parser, response_serializer=bytes)
        for name, make, behaviour in zip(SHAPES, kinds, behaviours)
    }


def call(channel: grpc.Channel, shape: str, payloads: list[bytes], metadata=None) -> list[bytes]:
    """Calls `shape` with `payloads` (the first alone for unary requests); the answers, or raises RpcError.
    A blocking channel: the asyncio client can report INTERNAL ("Failed execute_batch") instead of the server's
    status when one of its writes races the server ending a request stream early, which is what a refusal does."""
    path, kwargs = f"/{SERVICE}/{shape}", {"metadata": metadata, "timeout": 10}
    if shape == "Unary":
        return [channel.unary_unary(path)(payloads[0], **kwargs)]
    if shape == "ServerStream":
        return list(channel.unary_stream(path)(payloads[0], **kwargs))
    if shape == "ClientStream":
        return [channel.stream_unary(path)(iter(payloads), **kwargs)]
    return list(channel.stream_stream(path)(iter(payloads), **kwargs))


def serve(interceptors, parser: CountingParser, check, service: str = SERVICE, names: dict | None = None):
    """Serves the probe methods behind `interceptors` on a grpc.aio server (as `service`, each shape under its
    name in `names` where given); runs `check(channel)` on a thread."""

    async def main():
        handlers = {(names or {}).get(shape, shape): h for shape, h in probe_handlers(parser).items()}
        server = grpc.aio.server(interceptors=interceptors)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        async with served(server) as port:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                await asyncio.to_thread(check, channel)

    asyncio.run(main())


CHAINS = {"router": lambda tokens: public_interceptors(tokens), "worker": lambda tokens: worker_interceptors(tokens)}


@pytest.mark.parametrize("service", sorted(CHAINS))
def test_unauthenticated_bytes_are_never_parsed(service):
    parser = CountingParser()
    hostile = [b"\xff" * 4096, b"bad" + b"\x0a\xff" * 1000]

    def check(channel):
        for shape in SHAPES:
            for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                with pytest.raises(grpc.RpcError) as err:
                    call(channel, shape, hostile, metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (service, shape, err.value)
        assert parser.calls == 0, f"{service}: an unauthenticated caller's bytes reached the deserializer"
        # The same chain with the token parses: the counter would have seen the calls above.
        for shape in SHAPES:
            answers = call(channel, shape, [b"hello"], (("authorization", f"Bearer {TOKEN}"),))
            assert answers == [b"hello"], (service, shape)
        assert parser.calls == len(SHAPES)

    serve(CHAINS[service](TokenSet(token=TOKEN)), parser, check)


@pytest.mark.parametrize("service", sorted(CHAINS))
def test_malformed_request_is_invalid_argument_and_ends_a_stream(service):
    parser = CountingParser()
    token = (("authorization", f"Bearer {TOKEN}"),)

    def check(channel):
        for shape in SHAPES:
            with pytest.raises(grpc.RpcError) as err:
                call(channel, shape, [b"bad bytes"], token)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (service, shape, err.value)
            assert err.value.details().startswith("request: not a "), err.value.details()
        # On a stream, the messages before the malformed one are answered, then the stream ends at it.
        stream = channel.stream_stream(f"/{SERVICE}/BidiStream")(
            iter([b"one", b"two", b"bad", b"three"]), metadata=token, timeout=10
        )
        answers = []
        with pytest.raises(grpc.RpcError) as err:
            answers.extend(stream)
        assert answers == [b"one", b"two"] and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    serve(CHAINS[service](TokenSet(token=TOKEN)), parser, check)


def held_back(release: threading.Event):
    """A request stream that sends nothing until `release` is set: the headers go out, no message follows."""
    release.wait(30)
    yield from ()


def elapsed_error(call_held_back) -> tuple[grpc.StatusCode, float]:
    release, start = threading.Event(), time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as err:
            result = call_held_back(held_back(release))
            list(result) if not isinstance(result, bytes) else None
        return err.value.code(), time.monotonic() - start
    finally:
        release.set()


@pytest.mark.parametrize("service", sorted(CHAINS))
def test_a_caller_without_the_token_is_refused_before_its_request_arrives(service):
    """A unary-request method's handler runs only once its request has arrived: a caller sending headers and no
    message would hold a place of the server's concurrent-call limit until the deadline. The refusal must not
    wait for the request."""
    parser = CountingParser()

    def check(channel):
        for shape in ("Unary", "ServerStream"):
            path = f"/{SERVICE}/{shape}"
            opener = channel.stream_unary if shape == "Unary" else channel.stream_stream
            code, seconds = elapsed_error(lambda requests, o=opener, p=path: o(p)(requests, timeout=20))
            assert code == grpc.StatusCode.UNAUTHENTICATED and seconds < 5, (service, shape, code, seconds)

    serve(CHAINS[service](TokenSet(token=TOKEN)), parser, check)


def test_an_exempt_methods_request_must_arrive_in_time(monkeypatch):
    """Health needs no token; its request must still arrive within EXEMPT_REQUEST_TIMEOUT_S, and a request that
    does is answered as before (unary and server-streaming shapes)."""
    monkeypatch.setattr(auth, "EXEMPT_REQUEST_TIMEOUT_S", 0.5)
    parser = CountingParser()
    health = "grpc.health.v1.Health"

    def check(channel):
        assert channel.unary_unary(f"/{health}/Check")(b"ping", timeout=10) == b"ping"
        assert list(channel.unary_stream(f"/{health}/Watch")(b"ping", timeout=10)) == [b"ping"]
        for method, opener in (("Check", channel.stream_unary), ("Watch", channel.stream_stream)):
            code, seconds = elapsed_error(
                lambda requests, o=opener, m=method: o(f"/{health}/{m}")(requests, timeout=20)
            )
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and seconds < 5, (method, code, seconds)

    names = {"Unary": "Check", "ServerStream": "Watch"}
    serve(worker_interceptors(TokenSet(token=TOKEN)), parser, check, health, names)


@contextlib.asynccontextmanager
async def health_server():
    """grpc_health's servicer behind the worker's chain with a token: (its servicer, a channel to it)."""
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.aio.server(interceptors=worker_interceptors(TokenSet(token=TOKEN)))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    async with served(server) as port, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield servicer, channel


def test_the_health_service_answers_through_the_exempt_wrapper():
    """grpc_health's servicer (Check returns, Watch writes with context.write) behind a chain with tokens: no token
    needed, Check answers and Watch streams each change."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def main():
        async with health_server() as (servicer, channel):
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == 1
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()

    asyncio.run(main())


def test_streams_without_the_token_are_bounded_in_number(monkeypatch):
    """Health Watch needs no token, and each open Watch holds a place of the server's concurrent-call limit: callers
    without the token get EXEMPT_STREAMS_MAX of them at once, then RESOURCE_EXHAUSTED; with the token, as any
    call. A Watch that ends gives its place back; a call that ends without its request is INVALID_ARGUMENT."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    monkeypatch.setattr(auth, "EXEMPT_STREAMS_MAX", 2)
    token = (("authorization", f"Bearer {TOKEN}"),)

    async def main():
        async with health_server() as (_, channel):
            stub, request = health_pb2_grpc.HealthStub(channel), health_pb2.HealthCheckRequest()
            watches = [stub.Watch(request, timeout=20) for _ in range(2)]
            for watch in watches:
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            extra = stub.Watch(request, timeout=20)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await extra.read()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            trusted = stub.Watch(request, metadata=token, timeout=20)
            assert (await trusted.read()).status == health_pb2.HealthCheckResponse.SERVING
            assert (await stub.Check(request, timeout=10)).status == health_pb2.HealthCheckResponse.SERVING
            watches[0].cancel()
            for _ in range(100):  # the server sees the cancel a moment later
                again = stub.Watch(request, timeout=20)
                try:
                    assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("an ended Watch never gave its place back")
            empty = channel.stream_unary("/grpc.health.v1.Health/Check")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await empty(iter(()), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            for call in (watches[1], trusted, again):
                call.cancel()

    asyncio.run(main())
