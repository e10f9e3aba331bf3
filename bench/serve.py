"""Serving benchmark: the served path against the engine alone, on the same model, in the same run.

Models: `--backend cpu` the tiny model (`colibri make-tiny`); `--backend cuda` mixtral-shape and qwen3moe-shape
(random bf16, built and converted by bench/engine.py's build_hf / write_colibri). For each:

1. Engine alone: `expert_service.engine.engine.Engine` in this process with the worker's settings. The prefill of
   one P-token prompt (median); per batch size B in --clients, B prompts prefilled (max_batch_tokens per
   step, as the router does) then G-1 decode steps of all B: the b=B step p50 and tok/s = B / step.
2. Served: the two processes `colibri serve --worker-port` runs (`colibri worker`, `colibri router`: TCP
   loopback, a per-run token), started here so that one worker (load, compiles, graph captures) serves a
   router at --pipeline-depth 2 and then one at depth 1 (the comparison row), and starts while the engine does.
   Per N in --clients: N concurrent GenerateStream clients (grpc.aio, a channel each, over --client-procs
   processes), P-token prompts, G new tokens, greedy, ignore_eos; a warm-up round, then --rounds (more for
   small N: MIN_REQUESTS). ITL: time between successive token messages of a client (p50 over all gaps);
   throughput: tokens arriving between the last client's first token and the first one's last / that time.
3. served / engine: ITL p50 at N / the b=N step, throughput at N / the b=N tok/s, TTFT p50 - prefill.
   The serving targets on an H200: 1 client ITL <= 1.15x and TTFT <= prefill + 2 ms; 16 and 64 tok/s >= 0.90x.

Writes <out>/<name>.json (machine, device, config, every number) and .png; prints the ratio table:
    python bench/serve.py --backend cpu | --backend cuda --out out/serve
`--workload prefix` runs bench/serve_prefix.py instead: shared-prefix, unshared and multi-turn traffic with
prefix caching on against off. `--workload constrained` runs bench/serve_constrained.py: JSON-schema-constrained
clients against the same clients unconstrained.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.plotting import plot_serve  # noqa: E402
from bench.serve_clients import log, measure_served, percentile  # noqa: E402
from bench.serve_services import (  # noqa: E402
    ROUTER_READY,
    WORKER_READY,
    Process,
    device_name,
    free_port,
    prepare_models,
    router_command,
    wait_serving,
    worker_command,
)

# per backend: P, G and the measured rounds per client count
DEFAULTS = {
    "cpu": dict(prompt_tokens=32, new_tokens=16, rounds=2),
    "cuda": dict(prompt_tokens=128, new_tokens=64, rounds=3),
}
CLIENTS = (1, 4, 16, 64)
DEPTHS = (3, 2, 1)  # the router's --pipeline-depth: the default first, then one step ahead, then none
KV_BLOCK = 16
MAX_BATCH_TOKENS = 2048  # the router's default step token budget; the worker gets the same
PREFILL_REPEATS = 5
MODEL_FIELDS = ("family", "num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok", "vocab_size")
TARGETS = {
    "itl_p50_1client_x_engine_b1_step": ("<=", 1.15),
    "throughput_16clients_x_engine_b16": (">=", 0.90),
    "throughput_64clients_x_engine_b64": (">=", 0.90),
    "ttft_p50_1client_minus_engine_prefill_ms": ("<=", 2.0),
}


# --- the models ------------------------------------------------------------------------------------------
def settings(args) -> dict:
    """The worker's (and the in-process engine's) settings: room for max(--clients) requests of P+G tokens."""
    per_request = -(-(args.prompt_tokens + args.new_tokens) // KV_BLOCK) * KV_BLOCK
    most = max(args.clients)
    return dict(
        backend=args.backend,
        kv_block_size=KV_BLOCK,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_batch_size=max(64, most),
        kv_cache_tokens=2 * most * per_request + MAX_BATCH_TOKENS,
        max_concurrent_requests=max(128, 2 * most),
    )


# --- the engine alone ------------------------------------------------------------------------------------
def make_engine(model_dir: Path, cfg: dict):
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    engine = build_engine(
        ModelDir.open(model_dir, verify=False),
        EngineConfig(
            backend=cfg["backend"],
            kv_block_size=cfg["kv_block_size"],
            kv_cache_tokens=cfg["kv_cache_tokens"],
            max_batch_tokens=cfg["max_batch_tokens"],
            max_batch_size=cfg["max_batch_size"],
        ),
    )
    engine.warmup()  # what the worker does before it serves (cuda: compile kernels, capture graphs)
    return engine


def prefill_steps(prompts: dict[int, np.ndarray], token_budget: int, max_seqs: int) -> list[list]:
    """The prompts, in order, as steps of <= token_budget tokens and <= max_seqs sequences (long ones split)."""
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    steps, current, used = [], [], 0
    for rid, ids in prompts.items():
        pos = 0
        while pos < len(ids):
            if used == token_budget or len(current) == max_seqs:
                steps.append(current)
                current, used = [], 0
            take = min(token_budget - used, len(ids) - pos)
            current.append(
                PrefillInput(rid, ids[pos : pos + take], SamplingParams() if pos == 0 else None, pos + take == len(ids))
            )
            pos, used = pos + take, used + take
    if current:
        steps.append(current)
    return steps


def measure_engine(engine, prompts: list[np.ndarray], batch_sizes: list[int], new_tokens: int, passes: int) -> dict:
    """`passes` interleaved passes over the batch sizes (a burst of load hits no one size alone)."""
    cfg = engine.config
    stream = getattr(engine.decoder, "stream", None)
    sync = stream.synchronize if stream is not None else (lambda: None)

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    one = prefill_steps({0: prompts[0]}, cfg.max_batch_tokens, cfg.max_batch_size)
    single = []
    for _ in range(PREFILL_REPEATS + 1):  # the first one is a warm-up
        single.append(timed(lambda: [engine.step(s) for s in one]))
        engine.clear()
    prefill, decode, generation, num_steps = ({b: [] for b in batch_sizes} for _ in range(4))
    for _ in range(passes):
        for b in batch_sizes:
            ids = list(range(b))
            steps = prefill_steps(dict(enumerate(prompts[:b])), cfg.max_batch_tokens, cfg.max_batch_size)
            p = timed(lambda: [engine.step(s) for s in steps])
            d = [timed(lambda: engine.step(decode_ids=ids)) for _ in range(new_tokens - 1)]
            engine.clear()
            prefill[b].append(p)
            decode[b] += d
            generation[b].append(p + sum(d))
            num_steps[b] = len(steps)
    out = {
        "prefill_ms": float(np.median(single[1:])) * 1e3,
        "prefill_ms_all": [t * 1e3 for t in single[1:]],
        "passes": passes,
        "batches": {},
    }
    for b in batch_sizes:
        step = float(np.median(decode[b]))
        out["batches"][str(b)] = {
            "prefill_all_ms": float(np.median(prefill[b])) * 1e3,
            "prefill_steps": num_steps[b],
            "decode_step_ms": {"p50": step * 1e3, "p90": percentile(decode[b], 90) * 1e3, "min": min(decode[b]) * 1e3},
            "decode_steps": len(decode[b]),
            "tok_s": b / step,
            "generation_ms": float(np.median(generation[b])) * 1e3,
            "generation_tok_s": b * new_tokens / float(np.median(generation[b])),
        }
        log(
            f"  engine b={b}: decode step p50 {step * 1e3:.2f} ms, {b / step:,.0f} tok/s; "
            f"prefill of {b} prompts {out['batches'][str(b)]['prefill_all_ms']:.1f} ms"
        )
    return out


# --- the services ----------------------------------------------------------------------------------------
def serve_model(model_dir: Path, cfg: dict, prompts: list[np.ndarray], args, logs: Path) -> tuple[dict, dict]:
    """The engine alone (in this process, while the worker starts), then the served path at each depth."""
    worker_port, token = free_port(), secrets.token_urlsafe(32)
    worker = Process("worker", worker_command(model_dir, cfg, worker_port), logs / "worker.log", token)
    served, engine = {}, None
    try:
        started = time.monotonic()
        engine = make_engine(model_dir, cfg)
        log(f"  engine ready in {time.monotonic() - started:.0f} s")
        waited = wait_serving(f"127.0.0.1:{worker_port}", worker, args.start_timeout, WORKER_READY)
        log(f"  worker SERVING after {time.monotonic() - started:.0f} s (waited {waited:.0f} s more)")
        engine_out = measure_engine(engine, prompts, args.clients, args.new_tokens, args.rounds)  # worker idle
        engine.close()
        engine = None
        gc.collect()
        for depth in args.depths:
            port, metrics_port = free_port(), free_port()
            router = Process(
                f"router (depth {depth})",
                router_command(model_dir, cfg, worker_port, port, metrics_port, depth),
                logs / f"router-depth{depth}.log",
                token,
            )
            try:
                wait_serving(f"127.0.0.1:{port}", router, 120, ROUTER_READY)  # the worker connected
                log(f"  router --pipeline-depth {depth} SERVING")
                served[str(depth)] = measure_served(
                    f"127.0.0.1:{port}", metrics_port, [p.tolist() for p in prompts], args
                )
                router.check()
            finally:
                router.stop()
        worker.check()
    finally:
        if engine is not None:
            engine.close()
        worker.stop()
    return engine_out, served


# --- ratios, output --------------------------------------------------------------------------------------
def ratios(engine: dict, served: dict) -> dict:
    out = {}
    for depth, by_n in served.items():
        rows = {}
        for n, s in by_n.items():
            e = engine["batches"][n]
            rows[n] = {
                "itl_p50_x_engine_step": s["itl_ms"]["p50"] / e["decode_step_ms"]["p50"],
                "throughput_x_engine": s["throughput_tok_s"] / e["tok_s"],
                "ttft_p50_x_engine_prefill": s["ttft_ms"]["p50"] / e["prefill_all_ms"],
                "ttft_p50_minus_engine_prefill_ms": s["ttft_ms"]["p50"] - e["prefill_all_ms"],
            }
        headline = {}
        if "1" in by_n:
            headline["itl_p50_1client_x_engine_b1_step"] = rows["1"]["itl_p50_x_engine_step"]
            headline["ttft_p50_1client_minus_engine_prefill_ms"] = by_n["1"]["ttft_ms"]["p50"] - engine["prefill_ms"]
        for n in ("16", "64"):
            if n in by_n:
                headline[f"throughput_{n}clients_x_engine_b{n}"] = rows[n]["throughput_x_engine"]
        out[depth] = {"headline": headline, "by_clients": rows}
    if "1" in served and "2" in served:
        out["pipelining"] = {
            n: {
                "itl_p50_depth1_over_depth2": served["1"][n]["itl_ms"]["p50"] / s["itl_ms"]["p50"],
                "throughput_depth2_over_depth1": s["throughput_tok_s"] / max(served["1"][n]["throughput_tok_s"], 1e-12),
            }
            for n, s in served["2"].items()
            if n in served["1"]
        }
    return out


def print_table(name: str, entry: dict) -> None:
    e, cfg = entry["engine"], entry["config"]
    print(f"\n{name}: P={cfg['prompt_tokens']} G={cfg['new_tokens']}, engine prefill of one {e['prefill_ms']:.2f} ms")
    print(
        f"{'depth':>5} {'N':>3} | {'ITL p50':>8} {'mean':>7} {'engine':>8} {'x':>6} | {'tok/s':>9} {'engine':>9} "
        f"{'x':>6} | {'TTFT p50':>9} {'prefill':>9} {'-':>8} | {'stalls':>6} {'seqs/step':>9}"
    )
    for depth, by_n in entry["served"].items():
        for n, s in by_n.items():
            b, r = e["batches"][n], entry["ratios"][depth]["by_clients"][n]
            print(
                f"{depth:>5} {n:>3} | {s['itl_ms']['p50']:8.2f} {s['itl_ms']['mean']:7.2f} "
                f"{b['decode_step_ms']['p50']:8.2f} {r['itl_p50_x_engine_step']:6.2f} | "
                f"{s['throughput_tok_s']:9,.0f} {b['tok_s']:9,.0f} "
                f"{r['throughput_x_engine']:6.2f} | {s['ttft_ms']['p50']:9.2f} {b['prefill_all_ms']:9.2f} "
                f"{r['ttft_p50_minus_engine_prefill_ms']:8.2f} | {s['stalls']['count']:6d} "
                f"{s['router']['mean_batch_size'] or 0:9.1f}"
            )
    for depth in entry["served"]:
        for key, value in entry["ratios"][depth]["headline"].items():
            op, target = TARGETS[key]
            print(f"  depth {depth} {key}: {value:.3f}   (target on the H200: {op} {target})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--workload" in argv:  # prefix: bench/serve_prefix.py; constrained: bench/serve_constrained.py
        at = argv.index("--workload")
        workload = argv[at + 1] if at + 1 < len(argv) else ""
        if workload == "prefix":
            from bench.serve_prefix import main as workload_main
        elif workload == "constrained":
            from bench.serve_constrained import main as workload_main
        else:
            raise SystemExit(
                "--workload: only 'prefix' or 'constrained' (leave it out for the served-vs-engine benchmark)"
            )
        return workload_main(argv[:at] + argv[at + 2 :])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", default="mixtral-shape,qwen3moe-shape", help="cuda: bench/engine.py's shapes")
    parser.add_argument("--model", help="a converted model directory instead of the built ones")
    parser.add_argument("--clients", default=",".join(map(str, CLIENTS)), help="client counts = engine batch sizes")
    parser.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="router --pipeline-depth values")
    parser.add_argument("--prompt-tokens", type=int, help="P (default: cpu 32, cuda 128)")
    parser.add_argument("--new-tokens", type=int, help="G (default: cpu 16, cuda 64)")
    parser.add_argument("--rounds", type=int, help="measured rounds per N after a warm-up (default: cpu 2, cuda 3)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="directory for the JSON and PNG")
    parser.add_argument("--name", help="file stem (default: cpu-serve-tiny, or <gpu>-serve, e.g. h200-serve)")
    parser.add_argument(
        "--client-procs",
        type=int,
        default=max(1, min(4, (os.cpu_count() or 1) // 4)),
        help="client processes, so reading the streams is no bottleneck (default: cpus / 4, <= 4)",
    )
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds the worker may take to start")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.backend].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.clients = [int(n) for n in args.clients.split(",")]
    args.depths = [int(d) for d in args.depths.split(",")]
    if args.new_tokens < 2 or args.prompt_tokens < 1 or args.rounds < 1:
        parser.error("need --new-tokens >= 2 (an inter-token gap), --prompt-tokens >= 1, --rounds >= 1")
    cfg = settings(args)
    device = device_name(args.backend)
    name = args.name or (
        "cpu-serve-" + (Path(args.model).name if args.model else "tiny")
        if args.backend == "cpu"
        else re.sub(r"[^a-z0-9]+", "-", device.lower().replace("nvidia", "")).strip("-") + "-serve"
    )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    workdir = Path(tempfile.mkdtemp(prefix="colibri-serve-bench-", dir=shm))  # models, service logs
    results = {
        "benchmark": "serve",
        "machine": platform.node(),
        "device": device,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_start": list(os.getloadavg()),
        "git": subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True
        ).stdout.strip()
        if shutil.which("git")
        else "",
        "config": {
            "backend": args.backend,
            "clients": args.clients,
            "pipeline_depths": args.depths,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "warmup_rounds": 1,
            "engine_prefill_repeats": PREFILL_REPEATS,
            **cfg,
            "thread_env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
            "client_processes": args.client_procs,
            "served_by": "colibri worker + router, one worker",
        },
        "models": {},
    }
    path = out_dir / f"{name}.json"
    try:
        for model_name, model_dir in prepare_models(args, workdir):
            from common.model_format import ModelDir

            mc = ModelDir.open(model_dir, verify=False).config
            rng = np.random.default_rng(0)
            prompts = [rng.integers(3, mc.vocab_size, args.prompt_tokens) for _ in range(max(args.clients))]
            logs = workdir / f"logs-{model_name}"
            logs.mkdir(parents=True, exist_ok=True)
            log(f"{model_name}: engine alone and served (logs in {logs})")
            engine, served = serve_model(model_dir, cfg, prompts, args, logs)
            entry = {
                "model": {k: getattr(mc, k) for k in MODEL_FIELDS},
                "engine": engine,
                "served": served,
                "config": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens},
                "ratios": ratios(engine, served),
            }
            results["models"][model_name] = entry
            results["load_average_end"] = list(os.getloadavg())
            path.write_text(json.dumps(results, indent=1))
            print_table(model_name, entry)
    except BaseException:
        log(f"failed: the service logs are in {workdir}")
        raise
    finally:
        shutil.rmtree(workdir / "models", ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)
    plot_serve(results, path.with_suffix(".png"))
    log(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
