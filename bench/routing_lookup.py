"""Cost of the router's routing-plan lookups (the lookup must stay a small fraction of a step).

Builds a random table of a real model's size (default: Qwen3-30B-A3B, 48 MoE layers x 151936 tokens x top-8
of 128 experts, 117 MB) and times `RoutingPlanner.routing_plan(step)` and its message (router_service/wire.py
`routing_plan`) -- lookup, CSR build and protobuf encoding, what the router does per step -- for decode steps
of 1/16/64 tokens and prefill steps of 512/2048 tokens. Writes JSON.

    python bench/routing_lookup.py --out out/routing_lookup.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.routing_table import RoutingTable  # noqa: E402
from router_service.routing import RoutingPlanner  # noqa: E402
from router_service.scheduler import Chunk, ScheduledStep  # noqa: E402
from router_service.wire import routing_plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="out/routing_lookup.json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    table = rng.integers(0, args.experts, (args.layers, args.vocab, args.top_k), dtype=np.uint16)
    planner = RoutingPlanner(RoutingTable(table, args.experts, list(range(args.layers))))
    results = {
        "table_bytes": table.nbytes,
        "layers": args.layers,
        "vocab": args.vocab,
        "experts": args.experts,
        "top_k": args.top_k,
        "steps": {},
    }
    for kind, tokens in (("decode", 1), ("decode", 16), ("decode", 64), ("prefill", 512), ("prefill", 2048)):
        if kind == "decode":
            ids = {i: int(rng.integers(0, args.vocab)) for i in range(tokens)}
            step = ScheduledStep({i: 1 for i in ids}, (), tuple(ids), tuple(ids.values()), frozenset(), ())
        else:
            chunk = Chunk(1, tuple(int(t) for t in rng.integers(0, args.vocab, tokens)), True, True)
            step = ScheduledStep({1: tokens}, (chunk,), (), (), frozenset(), ())
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            message = routing_plan(planner.routing_plan(step))
            times.append(time.perf_counter() - start)
        results["steps"][f"{kind}_{tokens}"] = {
            "tokens": tokens,
            "median_us": float(np.median(times) * 1e6),
            "p99_us": float(np.percentile(times, 99) * 1e6),
            "message_bytes": message.ByteSize(),
        }
        print(
            f"{kind:8s} {tokens:5d} tokens: {np.median(times) * 1e6:8.0f} us median, "
            f"{message.ByteSize() / 1024:8.1f} KiB on the wire",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
