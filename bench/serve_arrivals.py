"""The router's per-request host cost on a shared-prefix burst: N clients (16) send at once, each a prompt of one
S-token system prompt shared by the burst (2,048) and a U-token turn of its own (64), G new tokens (64), token ids,
through the router's gRPC front to the CPU worker on the tiny model (its context raised to fit). Per request, from
the router's stamps (bench/hops/sitecustomize.py, on one monotonic clock with the clients'):

  cost_us     GenerateStream's entry to BatchingLoop.submit's exit: the span, validation, the front's checks and
              the admission (prefix hashes, detokenizer, scheduler entry). No await lies between the two on a
              token-id request, so this is the event loop's own time for the request (hop stamps included).
  spread_ms   per burst: the first client's send to the last request in the batching loop, which is what the step
              carrying the burst's turns waits for.

`--reference REV` also measures the router of another revision of this repository (`git archive`, with this
checkout's generated protobuf), alternating with this checkout's (a discarded warm-up pass, then ABAB: the
machine's drift cancels), against one worker of this checkout; prints medians, p90 and the ratios this / reference.

    python bench/serve_arrivals.py --reference 5bc3f42 --out out/arrivals.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
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
from bench.serve_clients import log, percentile  # noqa: E402
from bench.serve_services import (  # noqa: E402
    ROUTER_READY,
    WORKER_READY,
    Process,
    device_name,
    free_port,
    wait_serving,
    worker_command,
)

KV_BLOCK, MAX_BATCH_TOKENS = 16, 2048
STAMPS = ("R_stream>", "R_admit<")


def tiny_model(root: Path, context: int) -> Path:
    """The tiny mixtral with max_position_embeddings raised to `context` (its 2,048 is one prompt's worth)."""
    from expert_service.tools.convert import convert
    from expert_service.tools.tiny_model import tiny_hf_config, write_tiny_checkpoint

    hf_dir = write_tiny_checkpoint(root / "hf", "mixtral", 0)
    (hf_dir / "config.json").write_text(json.dumps({**tiny_hf_config("mixtral"), "max_position_embeddings": context}))
    return convert(hf_dir, root / "model", progress=False)


def export_tree(rev: str, dest: Path) -> Path:
    """`rev` of this repository in `dest`, with this checkout's generated protobuf (git-ignored)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for path in (REPO / "common" / "pb").rglob("*_pb2*.py"):
        target = dest / path.relative_to(REPO)
        if not target.exists():
            shutil.copy2(path, target)
    return dest


async def _bursts(target: str, args, seed: int) -> list[list[int]]:
    """Each burst's send times (monotonic ns), one per client; every burst has a new system prompt."""
    import grpc

    from common.pb import router_pb2 as rpb
    from common.pb import router_pb2_grpc

    rng = np.random.default_rng(seed)
    channels = [grpc.aio.insecure_channel(target) for _ in range(args.clients)]
    stubs = [router_pb2_grpc.GenerationServiceStub(c) for c in channels]

    async def one(stub, prompt: list[int]) -> int:
        request = rpb.GenerateStreamRequest(
            token_ids=rpb.TokenIds(ids=prompt),
            parameters=rpb.SamplingParameters(
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, ignore_eos=True
            ),
        )
        sent = time.monotonic_ns()
        async for _ in stub.GenerateStream(request, timeout=600):
            pass
        return sent

    out = []
    try:
        for _ in range(args.bursts):
            system = rng.integers(3, 259, args.system_tokens).tolist()
            prompts = [system + rng.integers(3, 259, args.user_tokens).tolist() for _ in range(args.clients)]
            out.append(list(await asyncio.gather(*(one(s, p) for s, p in zip(stubs, prompts)))))
            await asyncio.sleep(args.pause_s)  # the burst's decodes are over: the next arrives on an idle router
    finally:
        for c in channels:
            await c.close()
    return out


def _client_process(target: str, args, seed: int, conn) -> None:
    conn.send(asyncio.run(_bursts(target, args, seed)))
    conn.close()


def read_stamps(prefix: Path) -> list[tuple[str, int]]:
    """The router's R_stream> and R_admit< stamps, in time order."""
    lines = [line.split() for path in prefix.parent.glob(prefix.name + ".*") for line in path.read_text().splitlines()]
    return sorted(((name, int(t)) for name, t, *_ in lines if name in STAMPS), key=lambda s: s[1])


def burst_figures(sends: list[list[int]], stamps: list[tuple[str, int]]) -> list[dict]:
    """Per burst: each request's cost (its entry to its admission: nothing else runs between the two) and the
    spread from the first send to the last admission."""
    costs, admitted, entry = [], [], None
    for name, t in stamps:
        if name == "R_stream>":
            entry = t
        elif entry is not None:
            costs.append((t - entry) / 1e3)
            admitted.append(t)
            entry = None
    n = len(sends[0])
    if len(costs) != n * len(sends):
        raise RuntimeError(f"{len(costs)} admissions stamped for {n * len(sends)} requests")
    return [
        {
            "cost_us": costs[b * n : (b + 1) * n],
            "spread_ms": (max(admitted[b * n : (b + 1) * n]) - min(burst)) / 1e6,
            "send_spread_ms": (max(burst) - min(burst)) / 1e6,
        }
        for b, burst in enumerate(sends)
    ]


class _TreeProcess(Process):
    """A service of `tree` (its packages first on the path), stamping its hops into `hops`.<pid>."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, token: str, tree: Path, hops: Path):
        self.name, self.log_path = name, log_path
        path = [str(REPO / "bench" / "hops"), str(tree), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONUNBUFFERED="1", COLIBRI_WORKER_TOKEN=token, COLIBRI_HOPS=str(hops))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)


def measure_router(tree: Path, model_dir: Path, worker_port: int, token: str, args, logs: Path, name: str) -> list:
    """One router of `tree` against the worker, its bursts (the first discarded: first-use costs)."""
    port = free_port()
    hops = Path(tempfile.mkdtemp(prefix="hops-", dir=logs)) / "hops"
    cmd = [
        sys.executable, "-m", "colibri.cli", "router", "--worker", f"127.0.0.1:{worker_port}", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--max-concurrent-requests", "128",
        "--max-batch-tokens", str(MAX_BATCH_TOKENS), "--max-batch-size", "64",
    ]  # fmt: skip
    router = _TreeProcess(name, cmd, logs / f"{name}.log", token, tree, hops)
    try:
        wait_serving(f"127.0.0.1:{port}", router, 120, ROUTER_READY)
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        clients = ctx.Process(target=_client_process, args=(f"127.0.0.1:{port}", args, 1, child))
        clients.start()
        sends = parent.recv()
        clients.join()
        router.check()
    finally:
        router.stop()
    return burst_figures(sends, read_stamps(hops))[1:]


def summary(bursts: list[dict]) -> dict:
    costs = [c for b in bursts for c in b["cost_us"]]
    spreads = [b["spread_ms"] for b in bursts]
    return {
        "bursts": len(bursts),
        "cost_p50_us": percentile(costs, 50),
        "cost_p90_us": percentile(costs, 90),
        "spread_p50_ms": percentile(spreads, 50),
        "spread_p90_ms": percentile(spreads, 90),
        "send_spread_p50_ms": percentile([b["send_spread_ms"] for b in bursts], 50),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="a revision of this repository whose router is measured alongside")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=9, help="per pass, the first discarded")
    parser.add_argument("--passes", type=int, default=2, help="measured passes of each router (after a warm-up)")
    parser.add_argument("--pause-s", type=float, default=0.3)
    parser.add_argument("--out", default="out/serve-arrivals.json")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="colibri-arrivals-"))
    context = args.system_tokens + args.user_tokens + args.new_tokens
    model_dir = tiny_model(workdir / "tiny", max(2048, context))
    trees = {"this": REPO} | (
        {"reference": export_tree(args.reference, workdir / "reference")} if args.reference else {}
    )
    cfg = dict(
        backend="cpu",
        kv_block_size=KV_BLOCK,
        kv_cache_tokens=3 * args.clients * context + MAX_BATCH_TOKENS,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_batch_size=64,
    )
    worker_port, token = free_port(), secrets.token_urlsafe(32)
    worker = Process("worker", worker_command(model_dir, cfg, worker_port), workdir / "worker.log", token)
    names = list(trees)
    order = names[::-1] + [name for p in range(args.passes) for name in (names[::-1] if p % 2 else names)]
    measured: dict[str, list] = {name: [] for name in trees}
    try:
        wait_serving(f"127.0.0.1:{worker_port}", worker, 300, WORKER_READY)
        for index, name in enumerate(order):
            log(f"router of {name}: {args.bursts} bursts")
            bursts = measure_router(trees[name], model_dir, worker_port, token, args, workdir, f"router-{index}-{name}")
            if index >= len(trees):  # the first of each is a warm-up pass
                measured[name] += bursts
        worker.check()
    except BaseException:
        log(f"failed: the service logs are in {workdir}")
        raise
    finally:
        worker.stop()
    results = {
        "benchmark": "serve-arrivals",
        "machine": platform.node(),
        "device": device_name("cpu"),
        "cpu_count": os.cpu_count(),
        "config": {k: getattr(args, k) for k in ("clients", "system_tokens", "user_tokens", "new_tokens", "bursts")},
        "reference": args.reference,
        "routers": {name: summary(bursts) | {"per_burst": bursts} for name, bursts in measured.items()},
    }
    if args.reference:
        this, ref = results["routers"]["this"], results["routers"]["reference"]
        results["ratios"] = {
            f"{key}_this_x_reference": this[key] / ref[key] for key in ("cost_p50_us", "cost_p90_us", "spread_p50_ms")
        }
    for name, row in results["routers"].items():
        print(
            f"{name:10s} per-request cost p50 {row['cost_p50_us']:6.1f} us, p90 {row['cost_p90_us']:6.1f} us; "
            f"burst spread p50 {row['spread_p50_ms']:6.2f} ms, p90 {row['spread_p90_ms']:6.2f} ms "
            f"({row['bursts']} bursts; clients' own send spread p50 {row['send_spread_p50_ms']:.2f} ms)"
        )
    for key, value in results.get("ratios", {}).items():
        print(f"  {key:36s} {value:6.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    shutil.rmtree(workdir, ignore_errors=True)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
