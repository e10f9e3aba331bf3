"""Prefix-caching benchmark: the served path with --prefix-caching true against false, same worker, same run.

Workloads (token ids, greedy, ignore_eos; every prompt and turn drawn fresh per round, so only the intended
prefix repeats):
1. shared: N concurrent clients (16), every prompt = one S-token system prompt shared by all (2,048 on cuda) +
   a U-token user turn of its own (64), G new tokens (64). Targets on an H200 (mixtral-shape): TTFT p50 with
   caching <= 0.2x without, throughput >= 2x.
2. unshared: the same shapes with nothing shared (each prompt S + U fresh tokens): throughput >= 0.97x, TTFT
   within noise: what the cache costs when it never hits.
3. multiturn: C conversations (8) of T turns (4) replayed concurrently; turn t's prompt is turn t-1's prompt, its
   answer and a new U-token user turn, so each turn's prefix is the conversation so far.
Throughput: tokens generated in a round / (its last token - its start); TTFT: request start to first token.
Cached share: prompt tokens served from the cache / prompt tokens; in the shared workload at most
(N-1)/N x S/(S+U) (0.909 on cuda, 0.882 on cpu), since the first request of a round computes its new system prompt.
After a discarded warm-up pass, each setting is measured twice, in the order on, off, off, on; the numbers are medians over the rounds of both
passes (on a loaded machine a round can take several times the others).

Writes <out>/<name>.json (and .png, with matplotlib) and prints the on/off ratios:
    python bench/serve.py --workload prefix --backend cpu | --backend cuda --out out/serve
`--cuda-options '{"field": value}'` starts the worker with those CudaOptions (a --config file), e.g. to compare a
kernel path's effect on the served figures; `--expert-dtype int8|fp8` converts the built models' experts to 8 bits
(the decode steps both sides share read half the expert bytes); the JSON records both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import secrets
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from bench.plotting import plot_serve_prefix
from bench.serve_clients import log, percentile
from bench.serve_services import (
    REPO,
    ROUTER_READY,
    WORKER_READY,
    Process,
    cuda_options_file,
    device_name,
    free_port,
    prepare_models,
    router_command,
    wait_serving,
    worker_command,
)
from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc

DEFAULTS = {  # system tokens S, user turn U, new tokens G, clients N, rounds
    "cpu": dict(system_tokens=256, user_tokens=16, new_tokens=8, clients=16, rounds=4),
    "cuda": dict(system_tokens=2048, user_tokens=64, new_tokens=64, clients=16, rounds=3),
}
CONVERSATIONS, TURNS = 8, 4
KV_BLOCK, MAX_BATCH_TOKENS = 16, 2048
TARGETS = {  # on an H200, mixtral-shape
    "shared_ttft_p50_on_x_off": ("<=", 0.2),
    "shared_throughput_on_x_off": (">=", 2.0),
    "unshared_throughput_on_x_off": (">=", 0.97),
}


async def _request(stub, prompt: list[int], new_tokens: int) -> dict:
    request = rpb.GenerateStreamRequest(
        token_ids=rpb.TokenIds(ids=prompt),
        parameters=rpb.SamplingParameters(max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True),
    )
    start, first, last, tokens, cached = time.perf_counter(), None, None, [], 0
    async for message in stub.GenerateStream(request, timeout=600):
        now = time.perf_counter()
        first = first or now
        last = now
        tokens += message.token_ids
        cached = message.cached_prompt_tokens or cached
    return {"ttft_ms": ((first or start) - start) * 1e3, "start": start, "end": last or start, "tokens": tokens,
            "cached": cached}  # fmt: skip


def _summary(results: list[dict], started: float, prompt_tokens: int) -> dict:
    generated = sum(len(r["tokens"]) for r in results)
    return {
        "requests": len(results),
        "ttft_p50_ms": percentile([r["ttft_ms"] for r in results], 50),
        "ttft_p90_ms": percentile([r["ttft_ms"] for r in results], 90),
        "throughput_tok_s": generated / max(max(r["end"] for r in results) - started, 1e-9),
        "cached_prompt_share": sum(r["cached"] for r in results) / max(prompt_tokens, 1),
    }


def _prefill_steps(metrics_port: int) -> float:
    """Steps with prompt chunks the router has sent so far (its step-duration histogram's count)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    pattern = r'^colibri_step_duration_seconds_count\{[^}]*kind="prefill"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


async def _workloads(target: str, args, vocab: int, seed: int, metrics_port: int) -> dict[str, list]:
    rng = np.random.default_rng(seed)

    def fresh(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    channels = [grpc.aio.insecure_channel(target) for _ in range(max(args.clients, CONVERSATIONS))]
    stubs = [router_pb2_grpc.GenerationServiceStub(c) for c in channels]
    out: dict[str, list] = {"shared": [], "unshared": [], "multiturn": []}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up (compiles, first-use costs); not recorded
            system = fresh(args.system_tokens)
            for name in ("shared", "unshared"):
                prompts = [
                    (system if name == "shared" else fresh(args.system_tokens)) + fresh(args.user_tokens)
                    for _ in range(args.clients)
                ]
                steps, started = _prefill_steps(metrics_port), time.perf_counter()
                results = await asyncio.gather(*(_request(s, p, args.new_tokens) for s, p in zip(stubs, prompts)))
                if r:  # prefill steps: with a shared system prompt, ideally its own step and one for every turn
                    summary = _summary(results, started, sum(map(len, prompts)))
                    out[name].append(summary | {"prefill_steps": _prefill_steps(metrics_port) - steps})

            async def conversation(stub) -> list[dict]:
                prompt, turns = fresh(args.system_tokens // 2) + fresh(args.user_tokens), []
                for _ in range(TURNS):
                    turns.append(await _request(stub, prompt, args.new_tokens))
                    turns[-1]["prompt_tokens"] = len(prompt)
                    prompt = prompt + turns[-1]["tokens"] + fresh(args.user_tokens)
                return turns

            started = time.perf_counter()
            chats = await asyncio.gather(*(conversation(s) for s in stubs[:CONVERSATIONS]))
            if r:
                flat = [t for c in chats for t in c]
                out["multiturn"].append(_summary(flat, started, sum(t["prompt_tokens"] for t in flat)))
    finally:
        for c in channels:
            await c.close()
    return out


def _median(rounds: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]} | {"rounds": rounds}


def measure(model_dir: Path, args, logs: Path, vocab: int) -> dict:
    per_request = args.system_tokens + args.user_tokens + args.new_tokens
    most = max(args.clients, CONVERSATIONS * TURNS)
    cfg = dict(
        backend=args.backend,
        kv_block_size=KV_BLOCK,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_batch_size=max(64, args.clients),
        kv_cache_tokens=3 * most * per_request + MAX_BATCH_TOKENS,
        max_concurrent_requests=128,
        config_file=cuda_options_file(args.cuda_options, logs),
    )
    worker_port, token = free_port(), secrets.token_urlsafe(32)
    worker = Process("worker", worker_command(model_dir, cfg, worker_port), logs / "worker.log", token)
    out = {}
    try:
        wait_serving(f"127.0.0.1:{worker_port}", worker, args.start_timeout, WORKER_READY)
        passes: dict[str, list] = {"on": [], "off": []}
        # a discarded pass first (the worker's first minutes run slower: lazy compiles, allocator growth), then
        # ABBA: a drift in the machine's load cancels out
        for index, caching in enumerate(("false", "true", "false", "false", "true")):
            port, metrics_port = free_port(), free_port()
            cmd = router_command(model_dir, cfg, worker_port, port, metrics_port, 2) + ["--prefix-caching", caching]
            router = Process(f"router (prefix caching {caching})", cmd, logs / f"router-{caching}.log", token)
            try:
                wait_serving(f"127.0.0.1:{port}", router, 120, ROUTER_READY)
                log(f"  prefix caching {caching}: measuring")
                measured = asyncio.run(
                    _workloads(f"127.0.0.1:{port}", args, vocab, seed=1, metrics_port=metrics_port)
                )  # the same prompts each time
                if index:
                    passes["on" if caching == "true" else "off"].append(measured)
                router.check()
            finally:
                router.stop()
        worker.check()
    finally:
        worker.stop()
    for key, runs in passes.items():  # every measured round of both passes: one slow round moves no median
        out[key] = {name: _median([r for run in runs for r in run[name]]) for name in runs[0]}
    out["config"] = cfg
    return out


def shared_share_bound(args) -> float:
    """The most of the shared workload's prompt tokens the cache can serve: each round's system prompt is new,
    so one request per round computes it and the others start on its full blocks (not on their own turns)."""
    shared = args.system_tokens // KV_BLOCK * KV_BLOCK
    return (args.clients - 1) * shared / (args.clients * (args.system_tokens + args.user_tokens))


def ratios(entry: dict) -> dict:
    on, off = entry["on"], entry["off"]
    out = {}
    for name in ("shared", "unshared", "multiturn"):
        out[f"{name}_ttft_p50_on_x_off"] = on[name]["ttft_p50_ms"] / off[name]["ttft_p50_ms"]
        out[f"{name}_throughput_on_x_off"] = on[name]["throughput_tok_s"] / off[name]["throughput_tok_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", default="mixtral-shape", help="cuda: bench/engine.py's shapes")
    parser.add_argument("--model", help="a converted model directory instead of the built ones")
    for name in DEFAULTS["cpu"]:
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=f"default: cpu/cuda {name} above")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--name", help="file stem (default: cpu-serve-prefix or gpu-serve-prefix, by --backend)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--cuda-options", default="{}", help="the worker's CudaOptions fields as a JSON object")
    parser.add_argument(
        "--expert-dtype",
        choices=("int8", "fp8"),
        help="cuda: convert the built models' experts to 8 bits (default bf16; ignored with --model or on cpu)",
    )
    args = parser.parse_args(argv)
    from bench.engine import cuda_options_arg

    args.cuda_options = cuda_options_arg(parser, args.cuda_options)
    for key, value in DEFAULTS[args.backend].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = device_name(args.backend)
    name = args.name or ("cpu" if args.backend == "cpu" else "gpu") + "-serve-prefix"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="colibri-prefix-bench-"))
    results = {"benchmark": "serve-prefix", "machine": platform.node(), "device": device, "cpu_count": os.cpu_count()}
    results |= {"config": {k: getattr(args, k) for k in DEFAULTS["cpu"]}, "targets": TARGETS, "models": {}}
    results["cuda_options"] = args.cuda_options
    results["expert_dtype"] = "bfloat16" if args.model or args.backend == "cpu" else args.expert_dtype or "bfloat16"
    path = out_dir / f"{name}.json"
    try:
        for model_name, model_dir in prepare_models(args, workdir):
            from common.model_format import ModelDir

            vocab = ModelDir.open(model_dir, verify=False).config.vocab_size
            logs = workdir / f"logs-{model_name}"
            logs.mkdir(parents=True, exist_ok=True)
            log(f"{model_name}: prefix caching on and off (logs in {logs})")
            entry = measure(model_dir, args, logs, vocab)
            entry["ratios"] = ratios(entry)
            entry["shared_cached_share_bound"] = shared_share_bound(args)
            results["models"][model_name] = entry
            path.write_text(json.dumps(results, indent=1))
            print(f"\n{model_name} ({device})")
            for key, value in entry["ratios"].items():
                target = TARGETS.get(key)
                print(f"  {key:34s} {value:7.3f}" + (f"   target {target[0]} {target[1]}" if target else ""))
            for name_ in ("shared", "unshared", "multiturn"):
                on, off = entry["on"][name_], entry["off"][name_]
                print(
                    f"  {name_:10s} TTFT p50 {on['ttft_p50_ms']:8.1f} / {off['ttft_p50_ms']:8.1f} ms, "
                    f"tok/s {on['throughput_tok_s']:8.1f} / {off['throughput_tok_s']:8.1f}, "
                    f"cached share {on['cached_prompt_share']:.2f} (on / off)"
                )
            steps = (entry["on"]["shared"]["prefill_steps"], entry["off"]["shared"]["prefill_steps"])
            print(f"  shared: prefill steps a round {steps[0]:.0f} / {steps[1]:.0f} (on / off)")
            print(
                f"  shared: a cached share of at most {entry['shared_cached_share_bound']:.3f} (see shared_share_bound)"
            )
    except BaseException:
        log(f"failed: the service logs are in {workdir}")
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    png = path.with_suffix(".png")
    log(f"wrote {path}" + (f" and {png.name}" if plot_serve_prefix(results, png) else ""))
    return 0
