"""Serving benchmark: N concurrent streaming clients against `colibri serve`.

Starts `colibri serve` on a model (default: the embedded tiny model) unless --target names a running
router, runs N clients that each send --requests-per-client greedy streaming requests back to back, and
writes JSON (+ a PNG when matplotlib is installed) with throughput, TTFT and inter-token latency p50/p99,
and the share of the router's step time spent in router<->worker transport (from the router's /metrics:
step_transport_overhead_seconds_sum / step_duration_seconds_sum).

    python bench/serve.py --clients 16 --prompt-tokens 64 --max-new-tokens 64 --out out/serve.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.plotting import pyplot  # noqa: E402
from common.pb import router_pb2 as rpb  # noqa: E402
from common.pb import router_pb2_grpc  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args) -> tuple[subprocess.Popen, str, int]:
    port, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "colibri.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--metrics-port", str(metrics), "--worker-metrics-port", "0",
           "--backend", args.backend, "--max-concurrent-requests", str(max(args.clients * 2, 8))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"127.0.0.1:{port}", metrics


def wait_ready(stub, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stub.Generate(rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=[3, 4]),
                                              parameters=rpb.SamplingParameters(max_new_tokens=1)), timeout=30)
            return
        except grpc.RpcError:
            time.sleep(0.5)
    raise SystemExit("the router did not become ready")


def run_client(stub, prompts, max_new_tokens, records, lock):
    for prompt in prompts:
        request = rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=prompt), parameters=rpb.SamplingParameters(
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, ignore_eos=True))
        start, arrivals = time.perf_counter(), []
        for message in stub.GenerateStream(request):
            now = time.perf_counter()
            arrivals.extend([now] * len(message.token_ids))
        with lock:
            records.append((start, arrivals))


def scrape_transport_share(metrics_port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()

    def total(name):
        return sum(float(v) for v in re.findall(rf"^colibri_{name}_sum{{[^}}]*}} (\S+)$", text, re.M))
    step, overhead = total("step_duration_seconds"), total("step_transport_overhead_seconds")
    return {"router_step_seconds": step, "transport_seconds": overhead,
            "transport_share_of_step_time": overhead / step if step else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".colibri/tiny-mixtral", help="model directory for `colibri serve`")
    parser.add_argument("--target", help="a running router instead of starting `colibri serve`")
    parser.add_argument("--metrics-port", type=int, help="the running router's /metrics port (with --target)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn from [3, vocab)")
    parser.add_argument("--out", default="out/serve.json")
    args = parser.parse_args()

    proc = None
    if args.target:
        target, metrics_port = args.target, args.metrics_port
    else:
        proc, target, metrics_port = start_serve(args)
    try:
        channel = grpc.insecure_channel(target)
        stub = router_pb2_grpc.GenerationServiceStub(channel)
        wait_ready(stub)
        rng = np.random.default_rng(0)
        prompts = [[rng.integers(3, args.vocab, args.prompt_tokens).tolist() for _ in range(args.requests_per_client)]
                   for _ in range(args.clients)]
        records, lock = [], threading.Lock()
        threads = [threading.Thread(target=run_client, args=(stub, p, args.max_new_tokens, records, lock))
                   for p in prompts]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        transport = scrape_transport_share(metrics_port) if metrics_port else {}
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    ttft = np.array([arrivals[0] - start for start, arrivals in records]) * 1e3
    itl = np.concatenate([np.diff(arrivals) for _, arrivals in records]) * 1e3
    generated = sum(len(a) for _, a in records)
    result = {
        "benchmark": "serve", "target": target, "backend": args.backend, "model": args.model,
        "clients": args.clients, "requests": len(records), "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens, "wall_seconds": wall,
        "throughput_tokens_per_s": generated / wall, "requests_per_s": len(records) / wall,
        "ttft_ms": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99))},
        "inter_token_ms": {"p50": float(np.percentile(itl, 50)), "p99": float(np.percentile(itl, 99))},
        **transport, "machine": platform.node(), "cpu_count": os.cpu_count(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    plt = pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG (pip install -e '.[bench]')", file=sys.stderr)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        axes[0].hist(ttft, bins=30)
        axes[0].set(title="time to first token", xlabel="ms")
        axes[1].hist(itl, bins=50)
        axes[1].set(title="inter-token latency", xlabel="ms")
        fig.suptitle(f"{args.clients} streaming clients: {result['throughput_tokens_per_s']:.0f} tok/s")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
