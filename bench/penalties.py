"""What penalties and log-probabilities cost a decode step: ms/step of greedy decoding at batch 1, 16 and 64
with every sequence plain, half and all penalised (repetition, presence and frequency: the device tail after
the graph), all asking for logprobs with top 5 (rows copied to the host and scored there), and the prefill of
one prompt scored with prompt_logprobs against the same prefill unscored.

Weights are random bf16 in a Colibri model directory (bench/profile_step.py's writer, bench/engine.py's shapes;
qwen3moe-shape has a 152k vocabulary). `--shape tiny --backend cpu` runs the same on the tiny test model.

    python bench/penalties.py --out out/ [--shape qwen3moe-shape] [--backend cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCHES = (1, 16, 64)
CONTEXT = 128
STEPS = 24
PENALTIES = dict(repetition=1.1, presence=0.5, frequency=0.5)


def scenarios():
    """name -> (sampling of sequence i of a batch of n)."""
    from expert_service.engine.penalties import PenaltyParams
    from expert_service.engine.sampling import SamplingParams

    penalised = SamplingParams(penalties=PenaltyParams(**PENALTIES))
    return {
        "plain": lambda i, n: SamplingParams(),
        "half_penalised": lambda i, n: penalised if i % 2 == 0 else SamplingParams(),
        "all_penalised": lambda i, n: penalised,
        "logprobs_top5": lambda i, n: SamplingParams(logprobs=True, top_logprobs=5),
    }


def decode_ms(engine, batch: int, sampling, rng) -> float:
    """Median ms of a decode step of `batch` sequences with CONTEXT tokens of prompt each."""
    from expert_service.engine.engine import PrefillInput

    ids = list(range(batch))
    for start in range(0, batch, max(1, engine.config.max_batch_tokens // CONTEXT)):
        chunk = ids[start : start + max(1, engine.config.max_batch_tokens // CONTEXT)]
        engine.step([PrefillInput(i, rng.integers(3, 250, CONTEXT), sampling(i, batch), True) for i in chunk])
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        engine.step(decode_ids=ids)
        times.append(time.perf_counter() - t0)
    engine.clear()
    return float(np.median(times[STEPS // 4 :]) * 1e3)


def prefill_ms(engine, tokens: int, prompt_logprobs: int | None, rng) -> float:
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine.step(
            [PrefillInput(0, rng.integers(3, 250, tokens), SamplingParams(prompt_logprobs=prompt_logprobs), True)]
        )
        times.append(time.perf_counter() - t0)
        engine.clear()
    return float(np.median(times[1:]) * 1e3)


def run(shape: str, backend: str, workdir: Path) -> dict:
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    if shape == "tiny":
        from expert_service.tools.tiny_model import make_tiny

        model_dir = make_tiny(workdir / "tiny", family="qwen3_moe", seed=0)
    else:
        from bench.engine import SHAPES
        from bench.profile_step import write_random_model

        family, params = SHAPES[shape]
        model_dir = write_random_model(family, params, workdir / shape)
    engine = build_engine(
        ModelDir.open(model_dir),
        EngineConfig(backend=backend, max_batch_size=max(BATCHES), max_batch_tokens=2048, kv_cache_tokens=65536),
    )
    engine.warmup()
    rng = np.random.default_rng(0)
    result = {
        "shape": shape,
        "backend": backend,
        "vocab_size": engine.model_config.vocab_size,
        "memory_plan": dict(engine.decoder.memory_plan()),
        "decode_ms": {},
    }
    for name, sampling in scenarios().items():
        result["decode_ms"][name] = {str(b): decode_ms(engine, b, sampling, rng) for b in BATCHES}
        print(name, result["decode_ms"][name], flush=True)
    scored = max(BATCHES)  # the most prompt tokens one step scores (max_batch_size)
    result["prefill_ms"] = {
        "tokens": scored,
        "plain": prefill_ms(engine, scored, None, rng),
        "prompt_logprobs_5": prefill_ms(engine, scored, 5, rng),
    }
    print("prefill", result["prefill_ms"], flush=True)
    engine.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="qwen3moe-shape", help="a bench/engine.py shape, or tiny")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--workdir", type=Path, default=Path("/dev/shm/colibri-bench-penalties"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args.shape, args.backend, args.workdir)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    (args.out / f"penalties-{args.shape}-{args.backend}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
