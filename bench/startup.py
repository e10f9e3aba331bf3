"""Worker start-up: seconds from `colibri worker` starting to readiness SERVING, without a kernel cache and with
a cold and a warm one (COLIBRI_KERNEL_CACHE), on the same model in the same run.

A start is what a pod restart costs: process start and imports, loading (and checking) the weights, the
warm-up that compiles and loads every kernel and captures the decode CUDA graphs. Three starts per model:
  none  COLIBRI_KERNEL_CACHE unset          every kernel compiled in the process
  cold  an empty cache folder               compiled, and written to the folder
  warm  the same folder again               loaded from the folder (a restarted pod keeping its cache volume)
Each start reports the readiness wait and the worker's own warm-up time (its "warm-up N ms" log line); the
warm / none ratios are what the cache buys.

Models (--models): `--backend cpu` the tiny model (kernels are not compiled on cpu: the rows measure the
rest); `--backend cuda` the tiny model and mixtral-shape (bench/engine.py's random bf16 shapes) by default.
    python bench/startup.py --backend cuda --out out/startup
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.serve_services import Process, free_port, wait_serving, worker_command  # noqa: E402
from expert_service.kernels.jit_cache import CACHE_ENV  # noqa: E402
from expert_service.serving.lifecycle import READINESS  # noqa: E402

CACHE_STATES = ("none", "cold", "warm")
WARMUP_LINE = re.compile(r"warm-up (\d+) ms")
WORKER = dict(kv_block_size=16, kv_cache_tokens=8192, max_batch_tokens=2048, max_batch_size=64)


def prepare_models(names: list[str], workdir: Path):
    """(name, model directory) pairs, each built just before it is measured: "tiny" or a bench/engine.py shape."""
    for name in names:
        if name == "tiny":
            from expert_service.tools.tiny_model import make_tiny

            yield name, make_tiny(workdir / name, family="mixtral", seed=0, progress=False)
        else:
            from bench.engine import SHAPES, build_hf, write_colibri

            family, params = SHAPES[name]
            yield name, write_colibri(build_hf(family, params), workdir / name)


def start_once(model_dir: Path, backend: str, cache: Path | None, log_path: Path, timeout: float) -> dict:
    """One worker start: seconds to readiness, and the warm-up time the worker logged."""
    saved = os.environ.pop(CACHE_ENV, None)
    if cache is not None:
        os.environ[CACHE_ENV] = str(cache)
    port = free_port()
    started = time.monotonic()
    worker = Process(
        "worker", worker_command(model_dir, dict(WORKER, backend=backend), port), log_path, secrets.token_hex(16)
    )
    try:
        wait_serving(f"127.0.0.1:{port}", worker, timeout, READINESS)
        ready_s = time.monotonic() - started
    finally:
        worker.stop()
        os.environ.pop(CACHE_ENV, None)
        if saved is not None:
            os.environ[CACHE_ENV] = saved
    warmup = WARMUP_LINE.search(log_path.read_text(errors="replace"))
    return {
        "ready_s": ready_s,
        "warmup_s": int(warmup.group(1)) / 1e3 if warmup else None,
        "cache_files": sum(1 for _ in cache.rglob("*") if _.is_file()) if cache else 0,
    }


def measure(name: str, model_dir: Path, backend: str, workdir: Path, timeout: float, states: list[str]) -> dict:
    cache = workdir / f"kernel-cache-{name}"
    runs = {}
    for state in states:
        runs[state] = start_once(
            model_dir, backend, None if state == "none" else cache, workdir / f"{name}-{state}.log", timeout
        )
        r = runs[state]
        warmup = f"{r['warmup_s']:.1f} s" if r["warmup_s"] is not None else "?"
        print(
            f"{name:>14} {state:>5}: ready in {r['ready_s']:6.1f} s (warm-up {warmup}), {r['cache_files']} cache files",
            flush=True,
        )
    base = runs.get("none") or runs.get("cold")  # without a cache, or compiling into one
    ratios = {f"ready_{s}_x_{'none' if 'none' in runs else 'cold'}": runs[s]["ready_s"] / base["ready_s"] for s in runs}
    print(f"{name:>14} " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), flush=True)
    return {"runs": runs, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--models",
        help="comma-separated: tiny and (cuda) bench/engine.py's shapes (default: cpu tiny, cuda tiny,mixtral-shape)",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="directory for the JSON")
    parser.add_argument("--name", help="file stem (default: <backend>-startup)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    parser.add_argument(
        "--states",
        default=",".join(CACHE_STATES),
        help="which starts, in order: none,cold,warm (warm needs cold before it)",
    )
    args = parser.parse_args(argv)
    states = [s for s in args.states.split(",") if s]
    if set(states) - set(CACHE_STATES) or ("warm" in states and "cold" not in states[: states.index("warm")]):
        parser.error(f"--states: a subset of {','.join(CACHE_STATES)} with cold before warm")
    models = [m for m in (args.models or ("tiny" if args.backend == "cpu" else "tiny,mixtral-shape")).split(",") if m]
    if args.backend == "cpu" and models != ["tiny"]:
        parser.error("--models: the cpu backend measures the tiny model only")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "backend": args.backend,
        "worker": WORKER,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="colibri-startup-") as tmp:
        workdir = Path(tmp)
        for name, model_dir in prepare_models(models, workdir):
            results["models"][name] = measure(name, model_dir, args.backend, workdir, args.timeout, states)
    path = out / f"{args.name or args.backend + '-startup'}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
