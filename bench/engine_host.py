"""Engine.step's host time around the decoder: batch building, validation, block tables, sampling and outputs,
per decode step at b = 1 / 16 / 64, with the decoder's forward replaced by a stub that returns fixed greedy
logits (no GPU, no model arithmetic). On the GPU every decode step pays this on top of the graph replay (the
engine synchronises at the end of a step), so it is part of the measured decode step in bench/engine.py.

`--contexts` sets the sequences' cached lengths (block tables grow with them). Times: median of --steps steps after
--warmup; JSON to --out. To compare two commits, run it in a checkout of each (`git worktree add`) on one
machine: the figures depend on the host CPU.

    python bench/engine_host.py --out out/engine_host.json [--contexts 128,1536]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 16, 64)


class GreedyRows:
    """A step's logits as the cuda decoder hands them over for greedy sequences: argmax already known."""

    def __init__(self, ids: np.ndarray):
        self.ids = ids

    def greedy(self, row: int) -> tuple[int, bool]:
        return int(self.ids[row]), True

    def __len__(self) -> int:
        return len(self.ids)


def measure(contexts: list[int], steps: int, warmup: int) -> dict:
    sys.path.insert(0, str(REPO))
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams
    from expert_service.tools.tiny_model import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = ModelDir.open(make_tiny(Path(tmp) / "m", family="mixtral", seed=1))
        results = {}
        for context in contexts:
            engine = build_engine(
                model,
                EngineConfig(
                    backend="cpu",
                    kv_block_size=16,
                    max_batch_size=64,
                    kv_cache_tokens=64 * (context + steps + warmup + 16),
                    max_batch_tokens=max(512, context),
                ),
            )
            real = engine.decoder.forward
            rng = np.random.default_rng(0)
            for b in BATCHES:
                ids = list(range(b))
                for rid in ids:  # each prompt alone: the step budget holds one context-long chunk
                    engine.step([PrefillInput(rid, rng.integers(3, 200, context), SamplingParams(), True)])
                greedy = rng.integers(3, 200, b)
                engine.decoder.forward = lambda batch, trace=None: GreedyRows(greedy[: len(batch.logits_rows)])
                times = []
                for n in range(warmup + steps):
                    start = time.perf_counter()
                    engine.step(decode_ids=ids)
                    if n >= warmup:
                        times.append(time.perf_counter() - start)
                engine.decoder.forward = real
                engine.clear()
                results[f"context{context}_b{b}"] = float(np.median(times)) * 1e6
        return results


def write_results(out: Path, steps: int, results: dict) -> None:
    """The JSON both host benchmarks write: microseconds per decode step, and the CPU they ran on."""
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "unit": "us per decode step (host, stub decoder)",
        "cpu": platform.processor() or platform.machine(),
        "steps": steps,
        "results": results,
    }
    out.write_text(json.dumps(record, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/engine_host.json")
    parser.add_argument("--contexts", default="128,1536")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    results = measure(contexts, args.steps, args.warmup)
    for key, value in results.items():
        print(f"{key:18s} {value:8.1f} us")
    write_results(Path(args.out), args.steps, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
