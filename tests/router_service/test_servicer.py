"""The router over real gRPC on loopback, against the fake worker: streaming, cancel, overload, errors."""

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import NUM_SPECIAL, VOCAB_SIZE
from tests.helpers import byte_ids
from tests.router_service.fake_worker import EOS, FakeWorker, harness, ids_request, wait_for


def details(error: grpc.aio.AioRpcError):
    status = rpc_status.from_call(error)
    found = {}
    for d in status.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.RetryInfo, error_details_pb2.ErrorInfo):
            if d.Is(cls.DESCRIPTOR):
                msg = cls()
                d.Unpack(msg)
                found[cls.__name__] = msg
    return found


def run(coro):
    return asyncio.run(coro)


def test_generate_unary_token_ids():
    async def main():
        async with harness() as (router, fake, stub, _):
            r = await stub.Generate(ids_request([10, 11], request_id="abc", max_new_tokens=5, logprobs=True))
            assert r.request_id == "abc" and list(r.token_ids) == [12, 13, 14, 15, 16]
            assert r.stop_reason == rpb.STOP_REASON_LENGTH and r.prompt_tokens == 2 and r.generated_tokens == 5
            assert list(r.logprobs) == [-0.5, -0.25, -0.25, -0.25, -0.25] and r.routing == "exact"
            s = fake.sampling[1]
            assert s.seed != 0 and list(s.stop_token_ids) == [EOS]  # a seed is always assigned
            await wait_for(lambda: not fake.seqs)  # finished -> FilterBatch freed it
            assert router.batching_loop.scheduler.num_used_blocks == 0
            r2 = await stub.Generate(ids_request([1], max_new_tokens=1))
            assert r2.request_id.startswith("cmpl-")

    run(main())


def test_eos_min_new_tokens_and_ignore_eos():
    async def main():
        async with harness() as (_, fake, stub, _):
            last = VOCAB_SIZE - 1  # the fake worker answers EOS after the vocabulary's last id
            r = await stub.Generate(ids_request([last - 1], max_new_tokens=10))
            assert list(r.token_ids) == [last, EOS] and r.stop_reason == rpb.STOP_REASON_EOS
            r = await stub.Generate(ids_request([last - 1], max_new_tokens=3, min_new_tokens=3))
            assert list(r.token_ids) == [last, 0, NUM_SPECIAL] and r.stop_reason == rpb.STOP_REASON_LENGTH
            r = await stub.Generate(ids_request([last - 1], max_new_tokens=3, ignore_eos=True))
            assert list(r.token_ids) == [last, EOS, NUM_SPECIAL] and r.stop_reason == rpb.STOP_REASON_LENGTH
            r = await stub.Generate(ids_request([5], max_new_tokens=9, stop_token_ids=[8]))
            assert list(r.token_ids) == [6, 7, 8] and r.stop_reason == rpb.STOP_REASON_STOP_TOKEN

    run(main())


def test_stream_text_with_stop_sequence(tokenizer):
    async def main():
        async with harness(tokenizer=tokenizer) as (_, fake, stub, _):
            request = rpb.GenerateRequest(
                text="ab", request_id="s1", parameters=rpb.SamplingParameters(max_new_tokens=10, stop_sequences=["ef"])
            )
            messages = [m async for m in stub.GenerateStream(request)]
            assert all(m.request_id == "s1" for m in messages)
            assert "".join(m.text for m in messages) == "cd"
            finals = [m for m in messages if m.stop_reason != rpb.STOP_REASON_UNSPECIFIED]
            assert finals == [messages[-1]] and messages[-1].stop_reason == rpb.STOP_REASON_STOP_SEQUENCE
            assert messages[-1].generated_tokens == 4 and messages[-1].prompt_tokens == 2
            assert [t for m in messages for t in m.token_ids] == byte_ids("cdef")
            unary = await stub.Generate(request)
            assert unary.text == "cd" and unary.stop_reason == rpb.STOP_REASON_STOP_SEQUENCE
            assert list((await stub.Tokenize(rpb.TokenizeRequest(text="hé"))).token_ids) == byte_ids("hé")
            info = await stub.ModelInfo(rpb.ModelInfoRequest())
            assert info.vocab_size == VOCAB_SIZE and info.has_tokenizer and info.num_experts == 8
            assert list(info.eos_token_ids) == [EOS] and info.max_sequence_length == 1024
            assert info.dtype == "float32" and list(info.expert_dtypes) == ["float8_e4m3fn/block128", "int8"]
            assert info.head_dtype == "int8" and info.attention_dtype == "float8_e4m3fn"

    run(main())


def test_cancel_mid_stream_frees_worker_kv():
    async def main():
        async with harness(FakeWorker(step_delay=0.01)) as (router, fake, stub, _):
            call = stub.GenerateStream(ids_request([1], max_new_tokens=200))
            got = 0
            async for m in call:
                got += len(m.token_ids)
                if got >= 3:
                    break
            assert fake.seqs
            call.cancel()
            await wait_for(lambda: not fake.seqs and router.batching_loop.num_active == 0)
            assert fake.freed and router.batching_loop.scheduler.num_used_blocks == 0

    run(main())


def test_unary_client_cancel_frees_worker_kv():
    async def main():
        async with harness(FakeWorker(step_delay=0.01)) as (router, fake, stub, _):
            call = stub.Generate(ids_request([1], max_new_tokens=200))
            await wait_for(lambda: bool(fake.seqs))
            call.cancel()
            await wait_for(lambda: not fake.seqs and router.batching_loop.num_active == 0)

    run(main())


def test_cancel_while_queued_never_reaches_worker():
    async def main():
        # 8 blocks of 4 tokens: the first request reserves all of them, the second must wait.
        async with harness(FakeWorker(num_blocks=8, step_delay=0.01)) as (router, fake, stub, _):
            first = stub.GenerateStream(ids_request([1], max_new_tokens=31))
            await first.read()
            second = stub.GenerateStream(ids_request([2], max_new_tokens=31))
            await wait_for(lambda: router.batching_loop.scheduler.num_waiting == 1)
            second.cancel()
            await wait_for(lambda: router.batching_loop.num_active == 1)
            first.cancel()
            await wait_for(lambda: not fake.seqs and router.batching_loop.num_active == 0)
            assert fake.seen_ids == {1}

    run(main())


def test_overload_resource_exhausted_with_retry_info():
    async def main():
        async with harness(FakeWorker(step_delay=0.01), max_concurrent_requests=2, retry_after_s=2.5) as (
            router,
            fake,
            stub,
            _,
        ):
            calls = [stub.GenerateStream(ids_request([1], max_new_tokens=500)) for _ in range(2)]
            for c in calls:
                await c.read()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([1], max_new_tokens=1))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            found = details(err.value)
            assert found["RetryInfo"].retry_delay.seconds == 2 and found["RetryInfo"].retry_delay.nanos == 5e8
            assert found["ErrorInfo"].reason == "OVERLOADED"
            for c in calls:
                c.cancel()
            await wait_for(lambda: router.batching_loop.num_active == 0)
            assert (await stub.Generate(ids_request([1], max_new_tokens=2))).generated_tokens == 2

    run(main())


@pytest.mark.parametrize(
    "request_,field",
    [
        (ids_request([1, 300]), "token_ids.ids[1]"),
        (ids_request([1], stop_token_ids=[999]), "parameters.stop_token_ids[0]"),
        (ids_request([1], temperature=float("nan")), "parameters.temperature"),
        (ids_request([1], max_new_tokens=5000), "parameters.max_new_tokens"),
        (rpb.GenerateRequest(text="hi"), "text"),
    ],
)
def test_validation_errors_name_the_field(request_, field):
    async def main():
        async with harness() as (router, fake, stub, _):
            for rpc in (stub.Generate, stub.GenerateStream):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    call = rpc(request_)
                    if rpc is stub.GenerateStream:
                        [m async for m in call]
                    else:
                        await call
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(field + ":")
                assert details(err.value)["BadRequest"].field_violations[0].field == field
            assert not fake.seen_ids and router.batching_loop.is_worker_ready
            assert (await stub.Generate(ids_request([1], max_new_tokens=1))).generated_tokens == 1

    run(main())


@pytest.mark.parametrize(
    "code,expected",
    [(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE), (grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL)],
)
def test_worker_failure_fails_in_flight_then_recovers(code, expected):
    async def main():
        async with harness(FakeWorker(step_delay=0.01)) as (router, fake, stub, _):
            call = stub.GenerateStream(ids_request([1], max_new_tokens=500))
            await call.read()
            fake.fail_next = code
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() != grpc.aio.EOF:
                    pass
            assert err.value.code() == expected
            clears = fake.calls.count("ClearCache")
            await wait_for(lambda: router.batching_loop.is_worker_ready)
            assert fake.calls.count("ClearCache") == clears + 1  # reconnect cleared the worker
            assert (await stub.Generate(ids_request([1], max_new_tokens=3))).generated_tokens == 3

    run(main())


def test_health_follows_worker_and_drain():
    async def main():
        fake = FakeWorker(step_delay=0.01)
        fake.ready = False
        async with harness(fake, wait_ready=False) as (router, _, stub, channel):
            health = health_pb2_grpc.HealthStub(channel)
            check = lambda: health.Check(health_pb2.HealthCheckRequest(service="colibri.readiness"))  # noqa: E731
            live = lambda: health.Check(health_pb2.HealthCheckRequest(service="colibri.liveness"))  # noqa: E731
            # "": what load balancers and meshes check by default; it must mean "will serve a request now".
            overall = lambda: health.Check(health_pb2.HealthCheckRequest(service=""))  # noqa: E731
            assert (await check()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await overall()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await live()).status == health_pb2.HealthCheckResponse.SERVING  # liveness: the process runs
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([1]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            fake.ready = True
            await wait_for(lambda: router.batching_loop.is_worker_ready)
            await asyncio.sleep(0.05)
            assert (await check()).status == health_pb2.HealthCheckResponse.SERVING
            assert (await overall()).status == health_pb2.HealthCheckResponse.SERVING
            in_flight = stub.Generate(ids_request([1], max_new_tokens=20))
            await wait_for(lambda: router.batching_loop.num_active == 1)
            drain = asyncio.create_task(router.drain(timeout=5))
            await wait_for(lambda: router.batching_loop.is_draining)
            assert (await check()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await overall()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await live()).status == health_pb2.HealthCheckResponse.SERVING  # draining is not dead
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([1]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (await in_flight).generated_tokens == 20
            assert await drain

    run(main())


def test_a_ready_worker_reported_as_the_drain_starts_leaves_readiness_not_serving():
    """The batching loop reports the worker ready (a reconnect) and SIGTERM's drain begins before that report's
    health update has run: the drain's NOT_SERVING is what stays, whichever update runs last."""

    async def main():
        async with harness() as (router, _, _, channel):
            health = health_pb2_grpc.HealthStub(channel)
            router.batching_loop.hooks.on_worker_state(True)
            assert await router.drain(timeout=5)
            await asyncio.sleep(0)
            for service in ("", "colibri.readiness"):
                status = (await health.Check(health_pb2.HealthCheckRequest(service=service))).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING, service

    run(main())


def test_deadline_exceeded_frees_request():
    async def main():
        async with harness(FakeWorker(step_delay=0.02)) as (router, fake, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([1], max_new_tokens=500), timeout=0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_for(lambda: not fake.seqs and router.batching_loop.num_active == 0)

    run(main())


def test_bearer_auth_health_exempt():
    async def main():
        async with harness(auth_token="s3cret") as (_, _, stub, channel):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(ids_request([1], max_new_tokens=1))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.GenerateStream(ids_request([1]), metadata=(("authorization", "Bearer x"),))]
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = await stub.Generate(ids_request([1], max_new_tokens=1), metadata=(("authorization", "Bearer s3cret"),))
            assert ok.generated_tokens == 1
            health = health_pb2_grpc.HealthStub(channel)
            assert (
                await health.Check(health_pb2.HealthCheckRequest())
            ).status == health_pb2.HealthCheckResponse.SERVING

    run(main())
