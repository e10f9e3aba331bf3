"""Host microseconds one sampled token costs the worker (expert_service/engine/sampling.py) against the previous
implementation in the same run: float64 scaling, filter_logits' full stable sort for top-p, a cumulative sum over
every token for the draw. Sampled sequences are sampled on the host every step (greedy ones take the device's
argmax), so at b=16 this is paid 16 times a step.

    python bench/sampler_host.py --out bench/results/sampler-host.json [--vocab 32000,151936] [--draws 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expert_service.engine.sampling import Sampler, SamplingParams, filter_logits  # noqa: E402

SETTINGS = {
    "temperature 0.8": SamplingParams(temperature=0.8, seed=1),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    "temperature 0.7, top_k 50": SamplingParams(temperature=0.7, top_k=50, seed=1),
    "temperature 1.0, min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05, seed=1),
}


def previous(params: SamplingParams):
    """The sampler before this rewrite, as a function of the raw logits row."""
    rng = np.random.Generator(np.random.PCG64(params.seed))

    def sample(logits: np.ndarray) -> int:
        scaled = (logits.astype(np.float64) - logits.max()) / params.temperature
        kept = filter_logits(scaled, params.top_k, params.top_p, params.min_p)
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))

    return sample


def time_per_draw(sample, logits: np.ndarray, draws: int) -> float:
    for _ in range(3):
        sample(logits)
    start = time.perf_counter()
    for _ in range(draws):
        sample(logits)
    return (time.perf_counter() - start) / draws * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/sampler-host.json")
    parser.add_argument("--vocab", default="32000,151936", help="vocabulary sizes (mixtral, qwen3)")
    parser.add_argument("--draws", type=int, default=200)
    args = parser.parse_args(argv)
    if args.draws < 1:
        parser.error(f"--draws: must be >= 1, got {args.draws}")
    try:
        vocabs = [int(v) for v in args.vocab.split(",")]
    except ValueError:
        parser.error(f"--vocab: comma-separated integers, got {args.vocab!r}")
    if any(v < 2 for v in vocabs):
        parser.error(f"--vocab: sizes >= 2, got {args.vocab!r}")
    rng = np.random.default_rng(0)
    results = []
    for vocab in vocabs:
        # a language model's row: a few likely tokens over a long tail (logits spread ~ N(0, 2.5^2) + a head)
        logits = (rng.standard_normal(vocab) * 2.5).astype(np.float32)
        logits[rng.choice(vocab, min(20, vocab // 2), replace=False)] += 12.0
        for name, params in SETTINGS.items():
            sampler = Sampler(params)
            now = time_per_draw(sampler.sample, logits, args.draws)
            before = time_per_draw(previous(params), logits, max(1, args.draws // 4))
            results.append(
                {"vocab": vocab, "setting": name, "us": now, "previous_us": before, "x_faster": before / now}
            )
            print(
                f"V={vocab:>7} {name:<28} {now:9.1f} us (previous {before:9.1f} us): {before / now:5.1f}x", flush=True
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "sampler-host", "draws": args.draws, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
