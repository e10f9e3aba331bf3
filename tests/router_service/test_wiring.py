"""Purity (no numba), CLI wiring, metrics hooks, the Python client and `colibri generate`."""

import argparse
import asyncio
import subprocess
import sys

import grpc
import pytest
from prometheus_client import generate_latest

from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import VOCAB_SIZE
from router_service import generate_cmd, main
from router_service.client import ColibriClient, build_request, retry_delay
from router_service.config import RouterConfig
from router_service.observability import router_metrics
from tests.helpers import byte_ids
from tests.router_service.fake_worker import harness, ids_request

PURITY_SCRIPT = """
import sys
import router_service.main, router_service.client, router_service.generate_cmd
from router_service.scheduler import ScheduledRequest, Scheduler, SchedulerLimits, RequestOutput
from router_service.tokenizer import StopSequenceMatcher
from router_service.validation import ModelLimits, validate_request
from router_service.config import RouterConfig
from common.pb import router_pb2
s = Scheduler(SchedulerLimits(4, 16, 4, 16))
s.add(ScheduledRequest(1, [1, 2, 3], 2))
step = s.schedule()
s.update(step, [RequestOutput(1, 5)])
validate_request(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1])), RouterConfig(),
                 ModelLimits(10, 100, 100))
StopSequenceMatcher(["x"]).push("abc")
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "cuda", "cupy", "torch", "expert_service"))
assert not bad, bad
print("pure")
"""


def test_router_never_imports_numba():
    out = subprocess.run([sys.executable, "-c", PURITY_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "pure" in out.stdout, out.stderr


def test_cli_flags_env_and_defaults(monkeypatch):
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    monkeypatch.setenv("MAX_CONCURRENT_REQUESTS", "7")
    monkeypatch.setenv("COLIBRI_MAX_BATCH_TOKENS", "512")
    args = parser.parse_args(["--worker", "unix:/tmp/w.sock", "--port", "6000", "--max-batch-tokens", "256"])
    from common.config import flag_values, resolve

    config = resolve(RouterConfig, flags=flag_values(args, RouterConfig))
    assert config.worker == "unix:/tmp/w.sock" and config.port == 6000 and config.metrics_port == 9090
    assert config.max_concurrent_requests == 7 and config.max_batch_tokens == 256  # flag beats env
    from common.errors import ConfigError

    with pytest.raises(ConfigError, match="max_batch_size"):
        RouterConfig(max_batch_size=0)


def test_metrics_hooks_count_requests_and_steps():
    async def run():
        hooks, _ = router_metrics(
            "m",
            port=-1,
            registry=(registry := __import__("common.metrics").metrics.new_registry(process_metrics=False)),
        )
        async with harness(hooks=hooks, max_concurrent_requests=1) as (router, _, stub, _):
            await stub.Generate(ids_request([1], max_new_tokens=3))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Generate(ids_request([999]))
        return generate_latest(registry).decode()

    text = asyncio.run(run())
    assert 'colibri_requests_total{model_name="m",outcome="ok"} 1.0' in text
    assert 'colibri_requests_total{model_name="m",outcome="invalid_argument"} 1.0' in text
    assert 'colibri_generation_tokens_total{model_name="m"} 3.0' in text
    assert 'colibri_prompt_tokens_total{model_name="m"} 1.0' in text
    assert "colibri_time_to_first_token_seconds_count" in text and "colibri_step_duration_seconds_count" in text


def test_python_client_and_generate_command(tokenizer, capsys):
    async def run():
        async with harness(tokenizer=tokenizer, max_concurrent_requests=1) as (router, fake, stub, _):
            target = f"127.0.0.1:{router.port}"

            def blocking():
                with ColibriClient(target, timeout=10) as client:
                    r = client.generate("ab", max_new_tokens=3)
                    pieces = list(client.stream(token_ids=byte_ids("a"), max_new_tokens=2, stop_sequences=["c"]))
                    assert client.tokenize("a") == byte_ids("a") and client.model_info().vocab_size == VOCAB_SIZE
                    return r, pieces

            r, pieces = await asyncio.to_thread(blocking)
            assert r.text == "cde" and "".join(p.text for p in pieces) == "b"
            args = argparse.ArgumentParser()
            generate_cmd.add_arguments(args)
            code = await asyncio.to_thread(
                generate_cmd.run, args.parse_args(["--target", target, "--max-new-tokens", "4", "xy"])
            )
            assert code == 0
            code = await asyncio.to_thread(
                generate_cmd.run, args.parse_args(["--target", target, "--tokens", "1,2,999"])
            )
            assert code == 1

    asyncio.run(run())
    out = capsys.readouterr()
    assert "z{|}" in out.out and "STOP_REASON_LENGTH" in out.err and "INVALID_ARGUMENT" in out.err


def test_build_request_and_retry_delay_helpers():
    r = build_request(token_ids=[1, 2], max_new_tokens=4, seed=0, request_id="x")
    assert list(r.token_ids.ids) == [1, 2] and r.parameters.HasField("seed") and r.request_id == "x"
    with pytest.raises(ValueError):
        build_request("a", token_ids=[1])
    with pytest.raises(ValueError, match="unknown parameters"):
        build_request("a", max_tokens=3)
    assert isinstance(build_request("hi"), rpb.GenerateRequest)
    streamed = build_request(token_ids=[3], stream=True, max_new_tokens=2)
    assert isinstance(streamed, rpb.GenerateStreamRequest)
    assert list(streamed.token_ids.ids) == [3] and streamed.parameters.max_new_tokens == 2
    assert retry_delay(grpc.RpcError()) is None


@pytest.mark.parametrize("tty,raw", [(True, False), (True, True), (False, False)])
def test_generate_escapes_control_characters_on_a_terminal(tokenizer, capsys, monkeypatch, tty, raw):
    """The fake worker counts bytes up from the prompt: ESC and friends reach the terminal only as escapes
    (unless --raw), while a pipe gets the text as it is."""

    async def run():
        async with harness(tokenizer=tokenizer) as (router, _, _, _):
            args = argparse.ArgumentParser()
            generate_cmd.add_arguments(args)
            argv = ["--target", f"127.0.0.1:{router.port}", "--max-new-tokens", "3", "\x19"] + (
                ["--raw"] if raw else []
            )
            monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
            assert await asyncio.to_thread(generate_cmd.run, args.parse_args(argv)) == 0

    asyncio.run(run())
    out = capsys.readouterr().out
    if tty and not raw:
        assert "\\x1a\\x1b\\x1c" in out and "\x1b" not in out
    else:
        assert "\x1a\x1b\x1c" in out
