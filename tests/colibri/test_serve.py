"""Both services together: `colibri serve` as real processes, and in-process router + worker for
traces and cancel storms."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.model_format import ModelDir
from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc
from tests.helpers import BackgroundWorker, LoggedProcess, free_port, running_router, serve_command, serve_env

pytestmark = pytest.mark.slow

SECTION_9_METRICS = {
    "router": [
        "colibri_requests_total",
        "colibri_queue_size",
        "colibri_num_requests_running",
        "colibri_num_requests_waiting",
        "colibri_time_to_first_token_seconds",
        "colibri_time_per_output_token_seconds",
        "colibri_request_duration_seconds",
        "colibri_prompt_tokens_total",
        "colibri_generation_tokens_total",
        "colibri_batch_size",
        "colibri_step_duration_seconds",
    ],
    "worker": [
        "colibri_worker_step_duration_seconds",
        "colibri_kv_cache_usage_ratio",
        "colibri_expert_cache_hits_total",
        "colibri_expert_cache_misses_total",
        "colibri_expert_cache_copied_bytes_total",
        "colibri_expert_cache_stall_seconds_total",
        "colibri_routing_plan_recall",
        "colibri_expert_load_imbalance",
    ],
}


def offline_greedy(model, prompt, n):
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    return build_engine(ModelDir.open(model), EngineConfig(backend="cpu")).generate(prompt, n)[0]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def request(ids, n):
    return rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=ids), parameters=rpb.SamplingParameters(max_new_tokens=n, ignore_eos=True)
    )


def wait_serving(channel, timeout=90.0):
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (
                health.Check(health_pb2.HealthCheckRequest(service="colibri.readiness"), timeout=2).status
                == health_pb2.HealthCheckResponse.SERVING
            ):
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError("router never became SERVING")


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def worker_pid(serve_pid: int) -> int:
    for pid in child_pids(serve_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"worker" in f.read().split(b"\0"):
                return pid
    raise AssertionError("no worker process")


def test_serve_processes_end_to_end(tiny_model):
    port, metrics, worker_metrics = free_port(), free_port(), free_port()
    env = serve_env()
    serve = LoggedProcess(
        serve_command(
            str(tiny_model),
            str(port),
            "--max-batch-tokens",
            "16",
            "--worker-retry-s",
            "0.1",
            metrics_port=metrics,
            worker_metrics_port=worker_metrics,
        ),
        env,
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        wait_serving(channel)
        stub = router_pb2_grpc.GenerationServiceStub(channel)

        # Discovery through reflection.
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert "colibri.router.v1.GenerationService" in {s.name for s in answer.list_services_response.service}

        # 8 concurrent streams of different lengths, each equal to its solo offline run.
        prompts = [[(7 * i + j) % 250 + 3 for j in range(1 + 3 * i)] for i in range(8)]
        lengths = [4 + i for i in range(8)]
        expected = [offline_greedy(tiny_model, p, n) for p, n in zip(prompts, lengths)]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            got = list(
                pool.map(
                    lambda pn: [t for m in stub.GenerateStream(request(*pn)) for t in m.token_ids],
                    zip(prompts, lengths),
                )
            )
        assert got == expected

        # Both /metrics endpoints carry the documented names (docs/observability.md) with the model_name label.
        for service, scrape_port in (("router", metrics), ("worker", worker_metrics)):
            text = urllib.request.urlopen(f"http://127.0.0.1:{scrape_port}/metrics", timeout=5).read().decode()
            for name in SECTION_9_METRICS[service]:
                assert name in text, f"{service} /metrics lacks {name}"
            assert 'model_name="model"' in text

        # Kill the worker mid-stream: the stream ends UNAVAILABLE/INTERNAL, the router stays up, and once
        # `serve` has restarted the worker, requests succeed again.
        stream = stub.GenerateStream(request([5, 6, 7], 2000))
        next(stream)
        os.kill(worker_pid(serve.pid), signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
        deadline = time.monotonic() + 90
        while True:
            try:
                reply = stub.Generate(request(prompts[1], lengths[1]), timeout=10)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                assert time.monotonic() < deadline, "router did not recover after the worker restart"
                time.sleep(0.5)
        assert list(reply.token_ids) == expected[1]
        channel.close()
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(60)
    assert code == 0, serve.log()


def test_trace_links_router_request_to_worker_step(tiny_model):
    """Spans captured in memory: the worker's Prefill/Decode server spans are children of the router's
    step spans, in the same trace as the request span."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.util._once import Once

    from common.tracing import make_tracer_provider

    exporter = InMemorySpanExporter()
    provider = make_tracer_provider("test", SimpleSpanProcessor(exporter))
    # The router uses the global provider, which OpenTelemetry lets a process set once; reset it the way
    # OpenTelemetry's own test utilities do, since an earlier test in this process may have set it.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    trace.set_tracer_provider(provider)
    worker = BackgroundWorker(tiny_model, tracer_provider=provider).start()

    async def body():
        async with running_router(worker.address) as (_, stub):
            reply = await stub.Generate(request([9, 8, 7], 3))
            assert len(reply.token_ids) == 3

    try:
        asyncio.run(body())
    finally:
        worker.stop()
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    worker_steps = [s for s in spans if s.name in ("worker prefill", "worker decode")]
    assert worker_steps, [s.name for s in spans]
    for step in worker_steps:
        parent = by_id.get(step.parent.span_id) if step.parent else None
        assert parent is not None and parent.name in ("prefill", "decode"), (step.name, parent)
        assert parent.context.trace_id == step.context.trace_id
        assert any(link.context.trace_id for link in parent.links) or parent.parent is not None


def test_cancel_storm_returns_every_worker_kv_block(tiny_model):
    worker = BackgroundWorker(tiny_model).start()

    async def body():
        async with running_router(worker.address, max_batch_tokens=32) as (router, stub):

            async def start_and_cancel(i):
                call = stub.GenerateStream(request([3 + i % 200] * (1 + i % 17), 500))
                if i % 2:
                    await call.read()
                await asyncio.sleep(0.001 * (i % 5))
                call.cancel()

            await asyncio.gather(*(start_and_cancel(i) for i in range(40)))
            for _ in range(500):
                if router.batching_loop.num_active == 0:
                    break
                await asyncio.sleep(0.02)
            for _ in range(500):  # the frees ride the router's next steps: a loaded box takes a while
                if worker.engine.allocator.num_used_blocks == 0 and not worker.engine.sequences:
                    break
                await asyncio.sleep(0.02)

    try:
        asyncio.run(body())
        allocator = worker.engine.allocator  # half the calls read a token first: blocks were allocated
        assert allocator.num_used_blocks == 0 and not allocator.tables
        assert not worker.engine.sequences
    finally:
        worker.stop()


EXPERT_CACHE_VARIANTS = {
    "expert-cache-1-slot": ["--expert-cache-slots", "1", "--prefetch", "lookahead"],
    "expert-cache-1-slot-no-prefix-caching": [
        *("--expert-cache-slots", "1", "--prefetch", "lookahead", "--prefix-caching", "false")
    ],
    "expert-cache-1-slot-no-prefetch": ["--expert-cache-slots", "1", "--prefetch", "none"],
}


def served_equals_offline(tiny_model, backend: str, extra: list[str]) -> None:
    """`colibri serve` on `backend` with `extra` flags: six concurrent greedy streams equal the fp32 cpu
    engine's, each mismatch named by prompt and first differing token; the services stop cleanly."""
    port = free_port()
    serve = LoggedProcess(
        serve_command(
            str(tiny_model), str(port), "--max-batch-size", "16", "--max-batch-tokens", "256", *extra, backend=backend
        ),
        serve_env(),
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        wait_serving(channel, timeout=240)
        stub = router_pb2_grpc.GenerationServiceStub(channel)
        assert stub.ModelInfo(rpb.ModelInfoRequest()).backend == backend
        prompts = [[(5 * i + j) % 250 + 3 for j in range(2 + 7 * i)] for i in range(6)]
        expected = [offline_greedy(tiny_model, p, 12) for p in prompts]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(6) as pool:
            got = list(
                pool.map(lambda p: [t for m in stub.GenerateStream(request(p, 12)) for t in m.token_ids], prompts)
            )
        wrong = [
            f"prompt {i} ({len(p)} tokens): first differs at token {first_difference(g, e)}: got {g}, cpu {e}"
            for i, (p, g, e) in enumerate(zip(prompts, got, expected))
            if g != e
        ]
        assert not wrong, "\n".join(wrong)
        channel.close()
    except BaseException as e:  # the services' own account of what went wrong goes with the failure
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
        e.add_note("colibri serve stderr, last 3000 characters:\n" + serve.log())
        raise
    serve.send_signal(signal.SIGTERM)
    code = serve.wait(60)
    assert code == 0, serve.log()


@pytest.mark.parametrize("extra", EXPERT_CACHE_VARIANTS.values(), ids=EXPERT_CACHE_VARIANTS.keys())
def test_serve_through_the_expert_cache_equals_offline(tiny_model, extra):
    """The cpu backend through the expert cache (one slot a layer), with and without prefix caching and
    prefetch: the served streams equal the offline engine's."""
    served_equals_offline(tiny_model, "cpu", extra)


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], *EXPERT_CACHE_VARIANTS.values()], ids=["resident", *EXPERT_CACHE_VARIANTS])
def test_serve_on_the_gpu_equals_cpu_reference(tiny_model, extra):
    """Both services with the cuda backend (all experts resident, and through the expert cache with one slot
    per layer, with and without prefix caching and prefetch, so a failure names the part at fault): streamed
    greedy output equals the fp32 CPU engine's."""
    served_equals_offline(tiny_model, "cuda", extra)
