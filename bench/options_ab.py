"""CudaOptions against the defaults on one engine, interleaved (GPU): decode steps served as the worker serves a
router's stream (bench/engine.py's pipelined_decode: two steps in flight), for each expert dtype one engine whose
options `CudaDecoder.set_options` switches (the graphs re-captured each time), the variants alternating over
ROUNDS rounds so clock and temperature drift fall on every variant alike. Per (shape, dtype, batch): the median
ms a step of each variant, and each variant's speed-up over the first. Random weights (bench/engine.py's shapes,
written straight into the model format), no transformers model.

    python bench/options_ab.py --out out/ab.json --shapes qwen3moe-shape --expert-dtype bfloat16,int8+head+attn \\
        --variants '{"default": {}, "pdl": {"programmatic_launch": 2}}' [--batches 1,16] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine import (  # noqa: E402
    DECODE_CONTEXT,
    KV_BLOCK,
    RUN_DTYPES,
    SHAPES,
    pipelined_decode,
    random_model,
    start_decodes,
)

ROUNDS = 4


def measure(model_dir: Path, vocab: int, variants: dict, batches: list[int], rounds: int) -> dict:
    """{variant: {batch: [ms a step, one per round]}} on one engine."""
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.cuda_options import CudaOptions
    from expert_service.serving.lifecycle import ModelThread

    rng = np.random.default_rng(0)
    engine = build_engine(
        ModelDir.open(model_dir, verify=False),
        EngineConfig(
            backend="cuda",
            kv_block_size=KV_BLOCK,
            kv_cache_tokens=max(batches) * -(-(DECODE_CONTEXT + 400) // KV_BLOCK) * KV_BLOCK,
            max_batch_tokens=2048,
            max_batch_size=max(batches),
        ),
    )
    thread = ModelThread("bench-ab")
    times: dict = {name: {str(b): [] for b in batches} for name in variants}
    try:
        for _ in range(rounds):
            for name, options in variants.items():
                engine.decoder.set_options(CudaOptions(**options))
                for b in batches:
                    ids = list(range(b))
                    start_decodes(engine, ids, vocab, rng)
                    seconds, _ = pipelined_decode(engine, ids, thread, lambda result, context: 0)
                    times[name][str(b)].append(seconds * 1e3)
                    engine.clear()
    finally:
        thread.shutdown()
        engine.decoder.close()
    return times


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer")
    return int(text)


def batch_sizes(text: str) -> list[int]:
    try:
        return [positive(b) for b in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive integers") from e


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="options_ab.json")
    parser.add_argument("--shapes", default="qwen3moe-shape")
    parser.add_argument("--workdir", default="/dev/shm/colibri-ab")
    parser.add_argument("--expert-dtype", default="bfloat16", help=f"comma-separated of {', '.join(RUN_DTYPES)}")
    parser.add_argument("--variants", required=True, help='{"name": {CudaOptions fields}, ...}; the first is the base')
    parser.add_argument("--batches", type=batch_sizes, default="1,16", help="comma-separated decode batch sizes")
    parser.add_argument("--rounds", type=positive, default=ROUNDS)
    args = parser.parse_args(argv)
    try:
        variants = json.loads(args.variants)
        assert isinstance(variants, dict) and variants and all(isinstance(v, dict) for v in variants.values())
    except (ValueError, AssertionError):
        parser.error(f"--variants {args.variants!r}: a JSON object of names to CudaOptions objects")
    from expert_service.engine.cuda_options import CudaOptions

    for name, options in variants.items():
        try:
            CudaOptions(**options)
        except (TypeError, ValueError) as e:
            parser.error(f"--variants {name}: {e}")
    dtypes, shapes = args.expert_dtype.split(","), args.shapes.split(",")
    for value, known, flag in ((dtypes, RUN_DTYPES, "--expert-dtype"), (shapes, SHAPES, "--shapes")):
        if not set(value) <= set(known):
            parser.error(f"{flag} {','.join(value)}: each must be one of {', '.join(known)}")
    batches = args.batches
    import torch

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "variants": variants, "rounds": args.rounds, "runs": {}}
    base = next(iter(variants))
    for shape in shapes:
        family, params = SHAPES[shape]
        for dtype in dtypes:
            start = time.perf_counter()
            model = random_model(family, params, Path(args.workdir) / shape, dtype)
            times = measure(model, params["vocab_size"], variants, batches, args.rounds)
            median = {name: {b: float(np.median(v)) for b, v in per.items()} for name, per in times.items()}
            speedup = {name: {b: median[base][b] / ms for b, ms in per.items()} for name, per in median.items()}
            results["runs"][f"{shape}/{dtype}"] = {"ms": times, "median_ms": median, "speedup_over_" + base: speedup}
            for name in variants:
                row = "  ".join(f"b={b} {median[name][b]:.4f} ms ({speedup[name][b]:.3f}x)" for b in median[name])
                print(f"{shape} {dtype:16s} {name:12s} {row}", flush=True)
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))  # each finished run kept if a later one is cut off
    return 0


if __name__ == "__main__":
    sys.exit(main())
