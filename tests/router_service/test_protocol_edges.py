"""Protocol edges of the public port: request ids that cannot go into metadata, undecodable bytes, INTERNAL answers
without internals, temperatures the arithmetic cannot survive, cancelled streams logging nothing at ERROR, and
request-sized work (huge prompts, huge Tokenize texts) never holding the event loop."""

import asyncio
import gc
import logging
import time

import grpc
import pytest
from grpc_status import rpc_status

from common.pb import router_pb2 as rpb
from tests.helpers import worth_reporting
from tests.router_service.fake_worker import FakeWorker, harness, ids_request, wait_for


def run(coro):
    return asyncio.run(coro)


async def status_of(call):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def errors_logged(caplog):
    return [
        f"{r.name}: {r.getMessage()}" + (f" ({r.exc_info[0].__name__}: {r.exc_info[1]})" if r.exc_info else "")
        for r in caplog.records
        if worth_reporting(r)
    ]


@pytest.mark.parametrize("request_id", ["é", "a\nb", "\x00", "tab\there", "\x7f", "🙂", " lead", "trail "])
def test_request_id_must_be_metadata_safe(request_id, caplog):
    async def main():
        async with harness() as (_, _, stub, _):
            err = await status_of(stub.Generate(ids_request([5], request_id=request_id)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.details().startswith("request_id:") and "printable ASCII" in err.details()
            assert "x-request-id" not in dict(err.trailing_metadata() or ())
            stream = stub.GenerateStream(ids_request([5], request_id=request_id))
            assert (await status_of(stream.read())).code() == grpc.StatusCode.INVALID_ARGUMENT
            ok = await stub.Generate(ids_request([5], request_id="my id: 1/2", max_new_tokens=1))
            assert ok.request_id == "my id: 1/2"

    run(main())
    assert not errors_logged(caplog)


def test_undecodable_bytes_invalid_argument_without_traceback(caplog):
    async def main():
        async with harness() as (_, _, _, channel):
            for method, stream in (
                ("Generate", False),
                ("GenerateStream", True),
                ("Tokenize", False),
                ("ModelInfo", False),
            ):
                path = f"/colibri.router.v1.GenerationService/{method}"
                call = channel.unary_stream(path)(b"\x0a\xff") if stream else channel.unary_unary(path)(b"\x0a\xff")
                err = await status_of(call.read() if stream else call)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err)
                assert "\n" not in err.details() and "Error" not in err.details()
            err = await status_of(channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff"))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(main())
    assert not errors_logged(caplog)


def test_internal_errors_say_nothing_of_the_worker(caplog):
    async def main():
        async with harness(FakeWorker(step_delay=0.01)) as (router, fake, stub, _):
            call = stub.Generate(ids_request([5], request_id="req-7", max_new_tokens=50))
            await wait_for(lambda: router.batching_loop.num_active == 1 and fake.seqs)
            fake.fail_next = grpc.StatusCode.INTERNAL
            err = await status_of(call)
            assert err.code() == grpc.StatusCode.INTERNAL
            assert "req-7" in err.details() and "injected" not in err.details() and "worker" not in err.details()
            info = [d for d in rpc_status.from_call(err).details]
            assert info, "ErrorInfo expected"

    with caplog.at_level(logging.INFO):
        run(main())
    logged = [
        r
        for r in caplog.records
        if "injected failure" in r.getMessage() or "injected failure" in str(getattr(r, "error", ""))
    ]
    assert any(getattr(r, "request_id", "") == "req-7" for r in logged), "details must be logged with the id"


@pytest.mark.parametrize(
    "temperature,ok", [(1e-45, False), (1e-3, False), (1e-2, True), (100.0, True), (101.0, False), (0.0, True)]
)
def test_temperature_bounds(temperature, ok):
    async def main():
        async with harness() as (_, _, stub, _):
            call = stub.Generate(ids_request([5], temperature=temperature, max_new_tokens=1))
            if ok:
                assert (await call).generated_tokens == 1
            else:
                err = await status_of(call)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.details().startswith("parameters.temperature:")

    run(main())


def test_cancelled_streams_log_no_errors(caplog):
    gc.collect()  # what earlier tests left behind is not this test's
    caplog.clear()

    async def main():
        async with harness(FakeWorker(step_delay=0.005)) as (router, fake, stub, _):
            for _ in range(20):
                call = stub.GenerateStream(ids_request([5], max_new_tokens=200, ignore_eos=True))
                await call.read()
                await call.read()
                call.cancel()
            await wait_for(lambda: router.batching_loop.num_active == 0 and not fake.seqs)
            gc.collect()
            await asyncio.sleep(0.1)

    run(main())
    assert not errors_logged(caplog)


def test_huge_prompt_rejected_before_tokenizing(tokenizer):
    """8 MB of text: over the prompt byte limit (32 bytes per token of context), refused at once."""
    big = "ab" * (4 << 20)

    async def main():
        async with harness(tokenizer=tokenizer) as (_, _, stub, _):
            for call in (stub.Generate(rpb.GenerateRequest(text=big)), stub.Tokenize(rpb.TokenizeRequest(text=big))):
                started = time.monotonic()
                err = await status_of(call)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("text:")
                assert "max_prompt_bytes" in err.details()
                assert time.monotonic() - started < 2.0

    run(main())


def test_tokenizing_a_large_prompt_does_not_stall_other_streams(tokenizer):
    """The largest prompt allowed takes seconds to tokenize (on a thread); meanwhile another stream's tokens
    keep coming at step pace and ModelInfo answers at once."""
    size = 3 << 19  # 1.5 MiB: seconds of tokenizing

    async def main():
        async with harness(
            FakeWorker(step_delay=0.01, vocab_size=1 << 20, num_blocks=2048), tokenizer=tokenizer, max_prompt_bytes=size
        ) as (_, _, stub, _):
            stream = stub.GenerateStream(ids_request([5], max_new_tokens=4000, ignore_eos=True))
            await stream.read()
            stamps, info_latency = [], []

            async def follow():
                while await stream.read() is not grpc.aio.EOF:
                    stamps.append(time.monotonic())

            async def ask_info():
                while True:
                    started = time.monotonic()
                    await stub.ModelInfo(rpb.ModelInfoRequest())
                    info_latency.append(time.monotonic() - started)
                    await asyncio.sleep(0.05)

            tasks = [asyncio.create_task(follow()), asyncio.create_task(ask_info())]
            await asyncio.sleep(0.2)
            started = time.monotonic()
            big = await status_of(stub.Tokenize(rpb.TokenizeRequest(text="x" * (size + 1))))
            assert big.code() == grpc.StatusCode.INVALID_ARGUMENT  # one byte over: refused without tokenizing
            big_call = stub.Generate(rpb.GenerateRequest(text="hello " * (size // 6)))
            err = await status_of(big_call)  # tokenized, then too long for the context
            elapsed = time.monotonic() - started
            during = [b - a for a, b in zip(stamps, stamps[1:]) if a >= started]
            stream.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt:")
            # tokenizing on the event loop would stall the stream for about `elapsed`: the bound below is a third
            assert elapsed > 0.5, f"tokenizing took only {elapsed:.2f} s: the test proves nothing"
            assert len(during) > 20 and max(during) < min(1.0, elapsed / 3), (
                len(during),
                max(during, default=0),
                elapsed,
            )
            assert max(info_latency) < min(1.0, elapsed / 3), (max(info_latency), elapsed)

    run(main())


def test_token_id_prompt_length_checked_before_its_ids():
    """A million out-of-vocabulary ids: refused on the length (the prompt field), not by walking every id."""
    from router_service.config import RouterConfig
    from router_service.validation import ModelLimits, validate_request

    request = rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=[2**32 - 1] * 1_000_000))
    with pytest.raises(Exception) as err:
        validate_request(request, RouterConfig(), ModelLimits(258, 4096, 4096), None)
    assert err.value.field == "prompt" and "1000000 tokens" in str(err.value)
