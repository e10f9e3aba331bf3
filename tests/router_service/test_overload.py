"""Requests that end before the batching loop has them. At max_concurrent_requests a request is refused before any
work is spent on it: no chat render (its child processes serve a few renders at a time, so a flood of chats would
queue there for its 429), no tokenizing, no grammar compile; the 429 / RESOURCE_EXHAUSTED comes at once, and the
router serves again once room frees. A request whose client leaves (or whose gRPC deadline passes) before admission
is counted in colibri_requests_total once, by the front."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import grpc
import pytest

from common.metrics import OUTCOMES
from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc
from tests.router_service.fake_worker import FakeWorker, harness, ids_request, wait_for
from tests.router_service.test_http_errors import AUTH, http_harness
from tests.router_service.test_servicer import details

BEARER = (("authorization", AUTH["Authorization"]),)


def test_at_capacity_a_request_is_refused_before_it_is_rendered_tokenized_or_compiled(tmp_path):
    async def body():
        async with http_harness(tmp_path, FakeWorker(step_delay=0.05), max_concurrent_requests=1) as (
            router,
            _,
            base,
            hooks,
        ):
            frontend, tokenizer = router.http.frontend, router.batching_loop.tokenizer
            work: list[str] = []
            render, encode, compile_ = (
                frontend.chat_renderer.render,
                tokenizer.encode_async,
                router.batching_loop.compile_constraint,
            )

            def counted(name, call):
                async def wrapper(*args, **kwargs):
                    work.append(name)
                    return await call(*args, **kwargs)

                return wrapper

            frontend.chat_renderer.render = counted("render", render)
            tokenizer.encode_async = counted("tokenize", encode)
            router.batching_loop.compile_constraint = counted("compile", compile_)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
                stub = router_pb2_grpc.GenerationServiceStub(channel)
                holder = stub.GenerateStream(ids_request([1], max_new_tokens=60), metadata=BEARER)
                await holder.read()
                work.clear()
                started = time.monotonic()
                async with aiohttp.ClientSession(headers=AUTH) as s:
                    for path, payload in (
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
                        ("/v1/completions", {"prompt": "hello", "max_tokens": 2, "guided_regex": "[a-z]+"}),
                    ):
                        async with s.post(base + path, json=payload) as r:
                            answer = await r.json()
                            assert r.status == 429, answer
                            assert "max_concurrent_requests" in answer["error"]["message"]
                            assert r.headers["Retry-After"] == "1"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Chat(
                        rpb.ChatRequest(messages=[rpb.ChatMessage(role="user", content="hi")]), metadata=BEARER
                    )
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert work == [], f"refused requests cost {work}"
                assert hooks.m.requests.labels(outcome="resource_exhausted")._value.get() == 4
                assert time.monotonic() - started < 2.0
                holder.cancel()
                await wait_for(lambda: router.batching_loop.num_active == 0)
                async with aiohttp.ClientSession(headers=AUTH) as s:
                    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                    async with s.post(base + "/v1/chat/completions", json=payload) as r:
                        assert r.status == 200, await r.text()
                        async with s.get(base + "/health") as h:
                            assert h.status == 200

    asyncio.run(body())


def test_a_request_that_ends_before_admission_is_counted_by_its_outcome(tmp_path):
    """A client that leaves, or whose gRPC deadline passes, while its chat renders (or its text is tokenized, its
    grammar compiled) never reached the batching loop, which counts the rest: the front counts it."""

    async def body():
        async with http_harness(tmp_path, FakeWorker(step_delay=0.05)) as (router, _, base, hooks):
            frontend, rendering = router.http.frontend, asyncio.Event()

            async def slow_render(*args, **kwargs):
                rendering.set()
                await asyncio.sleep(30)

            frontend.render_chat = slow_render

            def count(outcome):
                return hooks.m.requests.labels(outcome=outcome)._value.get()

            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
                stub = router_pb2_grpc.GenerationServiceStub(channel)
                chat = rpb.ChatRequest(messages=[rpb.ChatMessage(role="user", content="hi")])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Chat(chat, metadata=BEARER, timeout=0.3)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await wait_for(lambda: count("deadline_exceeded") == 1)
                rendering.clear()
                call = stub.ChatStream(rpb.ChatRequest(messages=chat.messages), metadata=BEARER)
                await rendering.wait()
                call.cancel()
                await wait_for(lambda: count("cancelled") == 1)
            rendering.clear()
            async with aiohttp.ClientSession(headers=AUTH) as s:
                payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                posted = asyncio.ensure_future(s.post(base + "/v1/chat/completions", json=payload))
                await rendering.wait()
                posted.cancel()  # the client hangs up
            await wait_for(lambda: count("cancelled") == 2)
            assert sum(count(o) for o in OUTCOMES) == 3
            # n = 2 samples, both running when the client hangs up: each counted once, the HTTP request not again
            async with aiohttp.ClientSession(headers=AUTH) as s:
                payload = {"prompt": [5, 6], "max_tokens": 60, "n": 2, "stream": True}
                async with s.post(base + "/v1/completions", json=payload) as r:
                    await r.content.readline()
                    await wait_for(lambda: router.batching_loop.num_active == 2)
            await wait_for(lambda: router.batching_loop.num_active == 0)
            await asyncio.sleep(0.05)
            assert count("cancelled") == 4 and sum(count(o) for o in OUTCOMES) == 5
            # n = 3 chat samples, the client gone while the first renders: none reached the loop, counted once here
            rendering.clear()
            async with aiohttp.ClientSession(headers=AUTH) as s:
                payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 3}
                posted = asyncio.ensure_future(s.post(base + "/v1/chat/completions", json=payload))
                await rendering.wait()
                posted.cancel()
            await wait_for(lambda: count("cancelled") == 5)
            await asyncio.sleep(0.05)
            assert sum(count(o) for o in OUTCOMES) == 6

    asyncio.run(body())


def test_a_burst_of_chats_is_held_to_the_cap_while_they_render(tmp_path):
    """Requests arriving together all passed the cap while none had reached the batching loop, and queued for the
    render processes however many they were: those being admitted count against max_concurrent_requests too."""
    limit, burst = 2, random.randint(6, 10)

    async def body():
        async with http_harness(tmp_path, FakeWorker(step_delay=0.01), max_concurrent_requests=limit) as (
            router,
            _,
            base,
            _,
        ):
            frontend, renders = router.http.frontend, []
            render = frontend.chat_renderer.render

            async def slow_render(*args, **kwargs):
                renders.append(1)
                await asyncio.sleep(0.3)  # a slow template: the whole burst arrives meanwhile
                return await render(*args, **kwargs)

            frontend.chat_renderer.render = slow_render
            payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with aiohttp.ClientSession(headers=AUTH) as s:

                async def post():
                    async with s.post(base + "/v1/chat/completions", json=payload) as r:
                        return r.status

                statuses = await asyncio.gather(*(post() for _ in range(burst)))
            assert sorted(statuses) == [200] * limit + [429] * (burst - limit), statuses
            assert len(renders) == limit, f"{len(renders)} renders for a cap of {limit}"
            assert frontend._num_admitting == 0
            await wait_for(lambda: router.batching_loop.num_active == 0)

    asyncio.run(body())


def test_every_unavailable_answer_says_when_to_retry(tmp_path):
    """A lost worker, a worker not ready and a draining router answer UNAVAILABLE with RetryInfo, and HTTP 503 with
    Retry-After (/health too), as a full router's RESOURCE_EXHAUSTED / 429 do: retry_after_s from the config."""

    async def refused(stub, base: str) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(ids_request([1], max_new_tokens=2), metadata=BEARER)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert details(err.value)["RetryInfo"].retry_delay.seconds == 3
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}) as r:
                assert (r.status, r.headers.get("Retry-After")) == (503, "3"), await r.text()
            async with s.get(base + "/health") as r:
                assert (r.status, r.headers.get("Retry-After")) == (503, "3"), await r.text()

    async def body():
        fake = FakeWorker(step_delay=0.02)
        async with http_harness(tmp_path, fake, retry_after_s=3.0) as (router, _, base, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
                stub = router_pb2_grpc.GenerationServiceStub(channel)
                holder = stub.GenerateStream(ids_request([1], max_new_tokens=60), metadata=BEARER)
                await holder.read()
                fake.ready, fake.fail_next = False, grpc.StatusCode.UNAVAILABLE  # lost, and not back yet
                with pytest.raises(grpc.aio.AioRpcError) as lost:
                    while True:
                        await holder.read()
                assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
                assert details(lost.value)["RetryInfo"].retry_delay.seconds == 3
                await refused(stub, base)  # the worker is not ready
                fake.ready = True
                await wait_for(lambda: router.batching_loop.is_worker_ready)
                await router.drain(timeout=1.0)
                await refused(stub, base)  # draining

    asyncio.run(body())


def test_model_info_before_the_worker_connects_says_when_to_retry():
    """ModelInfo answered its UNAVAILABLE with reason UNAVAILABLE and a 1 s RetryInfo whatever retry_after_s said,
    where Generate answers WORKER_UNAVAILABLE and retry_after_s."""

    async def body():
        fake = FakeWorker()
        fake.ready = False
        async with harness(fake, wait_ready=False, retry_after_s=3.0) as (router, _, stub, _):
            for call in (stub.ModelInfo(rpb.ModelInfoRequest()), stub.Generate(ids_request([1], max_new_tokens=2))):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                found = details(err.value)
                assert found["RetryInfo"].retry_delay.seconds == 3, err.value.details()
                assert found["ErrorInfo"].reason == "WORKER_UNAVAILABLE", err.value.details()

    asyncio.run(body())


def test_samples_of_a_request_cancelled_while_others_are_submitted_are_counted_once_each(tmp_path):
    """The samples of one prompt are submitted together (Frontend `samples`): a client gone between two of them
    had its submitted samples counted by the loop and the request again by the front, as if none had reached it."""

    async def body():
        async with http_harness(tmp_path, FakeWorker(step_delay=0.05)) as (router, _, base, hooks):
            loop, compiling = router.batching_loop, asyncio.Event()
            compile_, calls = loop.compile_constraint, []
            submitted = random.randint(1, 4)

            async def held_compile(req):
                calls.append(req)
                if len(calls) > submitted:  # the samples before it are in the loop
                    compiling.set()
                    await asyncio.sleep(30)
                return await compile_(req)

            loop.compile_constraint = held_compile

            def count(outcome):
                return hooks.m.requests.labels(outcome=outcome)._value.get()

            payload = {"prompt": "hello", "max_tokens": 60, "n": submitted + 2, "guided_regex": "[a-z]+"}
            async with aiohttp.ClientSession(headers=AUTH) as s:
                posted = asyncio.ensure_future(s.post(base + "/v1/completions", json=payload))
                await compiling.wait()
                assert loop.num_active == submitted
                posted.cancel()  # the client hangs up
            await wait_for(lambda: loop.num_active == 0 and count("cancelled") >= submitted)
            await asyncio.sleep(0.05)
            assert count("cancelled") == submitted and sum(count(o) for o in OUTCOMES) == submitted

    asyncio.run(body())
