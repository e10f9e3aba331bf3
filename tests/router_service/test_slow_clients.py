"""Clients that stop reading their stream, or read it slower than it comes: the router does not run their request on
and queue its whole output for them. A gRPC stream whose next message waits grpc_write_timeout_s for the client
(HTTP/2 flow control) ends its request; the client, if it reads on, gets what was sent and then DEADLINE_EXCEEDED
(CLIENT_TOO_SLOW). A request read behind its tokens still ends at its deadline."""

from __future__ import annotations

import asyncio
import random

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from common.pb import router_pb2, router_pb2_grpc
from router_service.observability import router_metrics
from tests.router_service.fake_worker import FakeWorker, harness, wait_for


def _long_stream(max_new_tokens: int) -> router_pb2.GenerateStreamRequest:
    prompt = [random.randrange(1, 200) for _ in range(random.randint(1, 12))]
    params = router_pb2.SamplingParameters(
        max_new_tokens=max_new_tokens, ignore_eos=True, logprobs=True, top_logprobs=20
    )
    return router_pb2.GenerateStreamRequest(token_ids=router_pb2.TokenIds(ids=prompt), parameters=params)


def test_a_grpc_stream_the_client_stops_reading_ends_its_request():
    roomy = FakeWorker(num_blocks=50_000, max_position_embeddings=200_000)

    async def body():
        settings = dict(max_new_tokens=150_000, request_timeout_s=600, grpc_write_timeout_s=0.3)
        hooks, _ = router_metrics("fake", -1)
        async with harness(roomy, hooks=hooks, max_concurrent_requests=2, **settings) as (router, fake, stub, _):
            # no BDP probing: the client's receive window stays at its initial 64 KiB
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{router.port}", options=[("grpc.http2.bdp_probe", 0)]
            ) as channel:
                stalled = router_pb2_grpc.GenerationServiceStub(channel)
                calls = [stalled.GenerateStream(_long_stream(100_000)) for _ in range(2)]
                for call in calls:
                    await call.read()
                # 100,000 tokens take the fake worker far longer: the requests end once the windows are full
                await wait_for(lambda: router.batching_loop.num_active == 0 and not fake.seqs, timeout=8)
                # counted as what ended them (they were counted as client cancels)
                assert hooks.m.requests.labels(outcome="deadline_exceeded")._value.get() == 2
                # both slots are free again: the router fills to its limit
                answers = await asyncio.gather(
                    *(
                        stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2])))
                        for _ in range(2)
                    )
                )
                assert all(a.generated_tokens > 0 for a in answers)
                read = 0
                try:
                    while await asyncio.wait_for(calls[0].read(), 5) is not grpc.aio.EOF:
                        read += 1
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
                    assert "grpc_write_timeout_s" in e.details(), e.details()
                    info = error_details_pb2.ErrorInfo()
                    status = rpc_status.from_call(e)
                    assert any(d.Unpack(info) for d in status.details) and info.reason == "CLIENT_TOO_SLOW"
                else:
                    raise AssertionError("the stalled stream ended without an error")
                assert 0 < read < 100_000
                calls[1].cancel()

    asyncio.run(body())


def test_a_stream_read_behind_its_request_still_ends_at_the_request_timeout():
    """The client reads on, slower than its tokens come: the router always has a token queued for it, so it never
    waits for the next one, and the request must still end at request_timeout_s rather than run to max_tokens."""
    roomy = FakeWorker(num_blocks=50_000, max_position_embeddings=200_000)

    async def body():
        settings = dict(max_new_tokens=150_000, request_timeout_s=1.0)
        async with harness(roomy, **settings) as (router, fake, stub, _):
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{router.port}", options=[("grpc.http2.bdp_probe", 0)]
            ) as channel:
                call = router_pb2_grpc.GenerationServiceStub(channel).GenerateStream(_long_stream(100_000))
                await call.read()
                loop = asyncio.get_running_loop()
                started, read, checked = loop.time(), 1, False
                try:  # what it generated within its time, then the status
                    while True:
                        message = await asyncio.wait_for(call.read(), 5)
                        assert message is not grpc.aio.EOF, f"the stream ended without an error after {read}"
                        read += 1
                        if loop.time() - started < 2.5:
                            await asyncio.sleep(0.002)  # a few hundred messages a second: thousands of tokens come
                        elif not checked:  # still reading what came before the deadline, which has passed
                            # 1.5 s past it, with 3 s more for a loaded machine's loop: far before max_tokens
                            await wait_for(lambda: router.batching_loop.num_active == 0, timeout=3)
                            checked = True  # the rest is read at once
                except grpc.aio.AioRpcError as e:  # on a loaded machine the reader may catch up first
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
                    assert "request_timeout_s" in e.details(), e.details()
                assert read < 100_000
                await wait_for(lambda: router.batching_loop.num_active == 0 and not fake.seqs)

    asyncio.run(body())
