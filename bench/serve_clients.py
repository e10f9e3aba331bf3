"""bench/serve.py's load side: GenerateStream clients in spawned processes, rounds started together on a
barrier, the router's metrics scraped around them, and the per-client-count summary (ITL, TTFT, throughput,
stalls)."""

from __future__ import annotations

import asyncio
import math
import re
import sys
import time
import urllib.request

import grpc
import numpy as np

from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc

MIN_REQUESTS = 8  # per client count: at least this many requests (more rounds for small N), for TTFT
BARRIER_TIMEOUT_S = 300.0
METRICS = ("batch_size", "batch_tokens", "step_duration_seconds", "step_transport_overhead_seconds")  # router's
STALL_FACTOR = 5.0  # a gap longer than this many ITL p50s counts as a stall
T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {message}", file=sys.stderr, flush=True)


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else math.nan


def scrape(metrics_port: int) -> dict[str, float]:
    """The router's step metrics, summed over label sets: {name_sum|name_count: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {
        f"{name}_{part}": sum(
            float(v) for v in re.findall(rf"^colibri_{name}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        )
        for name in METRICS
        for part in ("sum", "count")
    }


def router_steps(before: dict, after: dict) -> dict:
    """The router's steps between two scrapes: how many, their mean batch and (router-measured) time."""
    d = {k: after[k] - before[k] for k in after}
    mean = {name: d[f"{name}_sum"] / d[f"{name}_count"] if d[f"{name}_count"] else None for name in METRICS}
    return {
        "steps": int(d["step_duration_seconds_count"]),
        "mean_batch_size": mean["batch_size"],
        "mean_batch_tokens": mean["batch_tokens"],
        "mean_step_ms": (mean["step_duration_seconds"] or 0) * 1e3,
        "mean_transport_overhead_ms": (mean["step_transport_overhead_seconds"] or 0) * 1e3,
    }


# --- the clients -----------------------------------------------------------------------------------------
async def client(stub, prompt: list[int], new_tokens: int) -> dict:
    request = rpb.GenerateStreamRequest(
        token_ids=rpb.TokenIds(ids=prompt),
        parameters=rpb.SamplingParameters(max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True),
    )
    start, times, counts, error = time.perf_counter(), [], [], ""
    try:
        async for message in stub.GenerateStream(request, timeout=600):
            if message.token_ids:
                times.append(time.perf_counter())
                counts.append(len(message.token_ids))
    except grpc.aio.AioRpcError as e:
        error = f"{e.code().name}: {e.details()}"
    return {"start": start, "times": times, "counts": counts, "error": error}


async def run_round(stubs, prompts, new_tokens: int) -> dict:
    started, cpu = time.perf_counter(), time.process_time()
    clients = await asyncio.gather(*(client(s, p, new_tokens) for s, p in zip(stubs, prompts)))
    return {
        "started": started,
        "clients": clients,
        "cpu_s": time.process_time() - cpu,
        "wall_s": time.perf_counter() - started,
    }


async def client_rounds(
    target: str, prompts: list[list[int]], new_tokens: int, total_rounds: int, before_round
) -> list[dict]:
    """One process's clients (a channel each), every round; `before_round(r)` blocks until round r may start."""
    channels = [grpc.aio.insecure_channel(target) for _ in prompts]
    stubs = [router_pb2_grpc.GenerationServiceStub(c) for c in channels]
    try:
        rounds = []
        for r in range(total_rounds):
            before_round(r)
            rounds.append(await run_round(stubs, prompts, new_tokens))
        return rounds
    finally:
        for c in channels:
            await c.close()


def client_process(target: str, prompts: list[list[int]], new_tokens: int, total_rounds: int, barrier, conn):
    """A client process (spawned): its share of the clients; every round starts on the barrier."""

    def before_round(_):
        barrier.wait(BARRIER_TIMEOUT_S)  # A: every process finished the round before
        barrier.wait(BARRIER_TIMEOUT_S)  # B: go (the parent scraped the metrics in between)

    conn.send(asyncio.run(client_rounds(target, prompts, new_tokens, total_rounds, before_round)))
    conn.close()


def run_clients(
    target: str, metrics_port: int, prompts: list[list[int]], new_tokens: int, rounds: int, procs: int
) -> tuple[list[dict], dict, dict]:
    """len(prompts) concurrent clients in `procs` processes (1: this one), a warm-up round then `rounds`: the
    measured rounds (every process's clients merged) and the router's metrics before and after them."""
    total, scraped = rounds + 1, {}
    if procs <= 1:

        def before_round(r):
            if r == 1:
                scraped["before"] = scrape(metrics_port)

        per_process = [asyncio.run(client_rounds(target, prompts, new_tokens, total, before_round))]
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # grpc does not survive fork
        barrier = ctx.Barrier(procs + 1)
        children = []
        for i in range(procs):
            receive, send = ctx.Pipe(duplex=False)
            child = ctx.Process(
                target=client_process, daemon=True, args=(target, prompts[i::procs], new_tokens, total, barrier, send)
            )
            child.start()
            send.close()  # the child's end: recv() fails once the child is gone, instead of waiting
            children.append((child, receive))
        try:
            for r in range(total):
                barrier.wait(BARRIER_TIMEOUT_S)
                if r == 1:
                    scraped["before"] = scrape(metrics_port)
                barrier.wait(BARRIER_TIMEOUT_S)
            per_process = [receive.recv() for _, receive in children]
        except Exception as e:
            raise RuntimeError(f"a client process failed (exit codes {[c.exitcode for c, _ in children]})") from e
        finally:
            for child, _ in children:
                child.join(10)
                child.kill()  # a no-op once it has exited
    after = scrape(metrics_port)
    merged = []
    for r in range(1, total):
        parts = [p[r] for p in per_process]
        merged.append(
            {
                "started": min(p["started"] for p in parts),
                "clients": [c for p in parts for c in p["clients"]],
                "client_cpu_share": max(p["cpu_s"] / p["wall_s"] for p in parts),
            }
        )
    return merged, scraped["before"], after


def measure_served(target: str, metrics_port: int, prompts: list[list[int]], args) -> dict:
    out = {}
    for n in args.clients:
        procs, count = min(n, args.client_procs), max(args.rounds, -(-MIN_REQUESTS // n))
        rounds, before, after = run_clients(target, metrics_port, prompts[:n], args.new_tokens, count, procs)
        s = out[str(n)] = summarize(rounds, n, args.new_tokens)
        if s["errors"]:
            log(f"  WARNING: {s['errors']} of {s['requests']} requests failed: {s['error_samples']}")
        s.update(
            client_processes=procs,
            client_cpu_share_max=max(r["client_cpu_share"] for r in rounds),
            router=router_steps(before, after),
        )
        itl, batch = s["itl_ms"], s["router"]["mean_batch_size"] or 0
        log(
            f"  {n} clients: ITL p50 {itl['p50']:.2f} ms (mean {itl['mean']:.2f}), TTFT p50 {s['ttft_ms']['p50']:.1f} "
            f"ms, {s['throughput_tok_s']:,.0f} tok/s ({s['throughput_window']}), {batch:.1f} seqs/step, "
            f"{s['stalls']['count']} stalls, clients {s['client_cpu_share_max']:.0%} CPU"
        )
    return out


def summarize(rounds: list[dict], n: int, new_tokens: int) -> dict:
    clients = [c for r in rounds for c in r["clients"]]
    errors = [c["error"] for c in clients if c["error"]]
    ok = [c for c in clients if c["times"]]
    ttft = [(c["times"][0] - c["start"]) * 1e3 for c in ok]
    gaps = np.concatenate([np.diff(c["times"]) for c in ok] or [np.zeros(0)]) * 1e3
    per_client_itl = [float(np.median(np.diff(c["times"]))) * 1e3 for c in ok if len(c["times"]) > 1]
    itl_p50 = percentile(gaps, 50)
    steady_tokens = steady_seconds = whole_tokens = whole_seconds = 0.0
    first_spread, last_spread = [], []
    for r in rounds:
        got = [c for c in r["clients"] if c["times"]]
        if not got:
            continue
        firsts, lasts = [c["times"][0] for c in got], [c["times"][-1] for c in got]
        first_spread.append((max(firsts) - min(firsts)) * 1e3)
        last_spread.append((max(lasts) - min(lasts)) * 1e3)
        begin, end = max(firsts), min(lasts)
        if end > begin:
            steady_tokens += sum(k for c in got for t, k in zip(c["times"], c["counts"]) if begin < t <= end)
            steady_seconds += end - begin
        whole_tokens += sum(sum(c["counts"]) for c in got)
        whole_seconds += max(lasts) - r["started"]
    steady = steady_seconds > 0 and steady_tokens >= n
    stalls = gaps[gaps > STALL_FACTOR * itl_p50] if len(gaps) else gaps
    return {
        "clients": n,
        "rounds": len(rounds),
        "requests": len(clients),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "incomplete_requests": sum(1 for c in clients if sum(c["counts"]) != new_tokens),
        "tokens": int(sum(sum(c["counts"]) for c in clients)),
        "tokens_per_message": float(np.mean([k for c in ok for k in c["counts"]])) if ok else math.nan,
        "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "max": max(ttft, default=math.nan)},
        "itl_ms": {
            "p50": itl_p50,
            "mean": float(gaps.mean()) if len(gaps) else math.nan,
            "p90": percentile(gaps, 90),
            "p99": percentile(gaps, 99),
            "max": float(gaps.max()) if len(gaps) else math.nan,
            "gaps": int(len(gaps)),
        },
        "per_client_itl_p50_ms": {"min": min(per_client_itl, default=0), "max": max(per_client_itl, default=0)},
        "stalls": {
            "threshold_ms": STALL_FACTOR * itl_p50,
            "count": int(len(stalls)),
            "seconds": float(stalls.sum()) / 1e3,
        },
        "first_token_spread_ms_max": max(first_spread, default=0),
        "finish_spread_ms_max": max(last_spread, default=0),
        "throughput_tok_s": steady_tokens / steady_seconds if steady else whole_tokens / max(whole_seconds, 1e-9),
        "throughput_window": "steady" if steady else "whole",
        "steady_seconds": steady_seconds,
        "steady_tokens": int(steady_tokens),
        "whole_round_tok_s": whole_tokens / whole_seconds if whole_seconds else math.nan,
    }
