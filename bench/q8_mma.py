"""The 8-bit experts' MoE strategies on the GPU, and the thresholds between them: Q8_MMA (grouped tensor-core GEMM
on 8-bit tiles, moe_gemm_q8mma), moe_q8 (SIMT, dequantising in registers) and dequantise + per-expert cuBLAS, each
against the same shape with bf16 experts (GROUPED_MMA / cuBLAS paths), in one run.

Per shape (mixtral-shape: Mixtral-8x7B dimensions, 2 layers; qwen3moe-shape: Qwen3-30B-A3B dimensions, 4 layers;
random weights written straight into the model format, bench/random_model.py) and expert dtype (bfloat16, int8,
fp8 with 128x128 block scales) it builds one engine, then times with each variant's CudaOptions (set_options on
the same engine: same sequences, graphs re-captured):
  decode steps of b = 1, 2, 4, 8, 16, 32, 64 sequences at 128 tokens of context (one step at a time, graph
  replay, median of --steps), and prefills of 1 x 16, 1 x 64, 1 x 128, 1 x 512 and 16 x 128 tokens (best of 3,
  graph replay).
Variants of the 8-bit engines (all but the `w8a8` ones with CudaOptions.q8_activations off: the weights widened to
bf16): `q8_mma` (the shipped thresholds), `simt` (Q8_MMA off: moe_q8 up to 64 tokens,
dequantise + cuBLAS above), `mma_all` (Q8_MMA at every step of 2+ tokens, both expert counts), `in_order` (the
shipped thresholds, each group widened and its GEMMs run in turn on one stream: CudaOptions.overlap_dequant off),
`no_wgmma` / `mma_all_no_wgmma` (the same as `q8_mma` / `mma_all` with the sm_90 warpgroup-MMA kernel off),
`w8a8` / `w8a8_all` (as `q8_mma` / `mma_all` with 8-bit activations where W8A8 applies: `w8a8` is the defaults).
`--variants` picks some. The strategy each
step size takes is recorded. Prints each 8-bit variant's ratio to bf16 (decode: bf16 ms / ms, prefill: tok/s /
bf16 tok/s; > 1 is faster) and the thresholds the measurements suggest: the smallest decode batch from which
Q8_MMA beats moe_q8 (q8_mma_min_tokens) and, per expert count, the largest prefill where it beats dequantise +
cuBLAS (q8_mma_max_tokens / q8_mma_max_tokens_few_experts).

    python bench/q8_mma.py --out out/q8_mma.json [--shapes mixtral-shape,qwen3moe-shape] [--dtypes int8,fp8]
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

SHAPES = {"mixtral-shape": 2, "qwen3moe-shape": 4}  # layers: the MoE layers dominate a step either way
DECODE = (1, 2, 4, 8, 16, 32, 64)
PREFILL = ((1, 16), (1, 64), (1, 128), (1, 512), (16, 128))
CONTEXT = 128
BIG = 1 << 20
WIDEN = {"q8_activations": False}  # 8-bit weights widened to bf16 everywhere (no W8A8)
VARIANTS = {
    "q8_mma": {**WIDEN},
    "simt": {**WIDEN, "q8_mma_min_tokens": BIG},
    "mma_all": {**WIDEN, "q8_mma_max_tokens": BIG, "q8_mma_max_tokens_few_experts": BIG},
    "in_order": {**WIDEN, "overlap_dequant": False},  # per-expert cuBLAS steps widen and run their GEMMs in turn
    "no_wgmma": {**WIDEN, "wgmma_experts": False},  # Q8_MMA on the mma.sync kernel at every size (sm_90: wgmma off)
    "mma_all_no_wgmma": {
        **WIDEN,
        "q8_mma_max_tokens": BIG,
        "q8_mma_max_tokens_few_experts": BIG,
        "wgmma_experts": False,
    },
    # 8-bit activations on the 8-bit tensor cores where Q8_MMA takes the wgmma tile (moe_gemm_w8a8): the defaults
    "w8a8": {},
    "w8a8_all": {"q8_mma_max_tokens": BIG, "q8_mma_max_tokens_few_experts": BIG},
}
# the engine's own options: every strategy a variant takes is reachable, so its workspace holds their buffers
LAYOUT = {"q8_mma_max_tokens": 64, "q8_mma_max_tokens_few_experts": 64, "q8_activations": True}


def measure(engine, vocab: int, steps: int) -> dict:
    from bench.engine import start_decodes, strategies
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    rng = np.random.default_rng(0)
    sync = engine.decoder.stream.synchronize
    out: dict = {"prefill_tok_s": {}, "decode_ms": {}}
    for b, n in PREFILL:
        chunks = [PrefillInput(1000 + i, rng.integers(0, vocab, n), SamplingParams(), True) for i in range(b)]
        best = float("inf")
        for i in range(5):  # eager, captured, then three timed replays
            start = time.perf_counter()
            engine.step(chunks)
            engine.clear()
            sync()
            if i >= 2:
                best = min(best, time.perf_counter() - start)
        out["prefill_tok_s"][f"{b}x{n}"] = b * n / best
    for b in DECODE:
        ids = list(range(b))
        start_decodes(engine, ids, vocab, rng, CONTEXT)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step(decode_ids=ids)
            times.append(time.perf_counter() - start)
        engine.clear()
        out["decode_ms"][str(b)] = float(np.median(times)) * 1e3
    sizes = [*DECODE, *sorted({b * n for b, n in PREFILL})]
    out["strategy"] = strategies(engine, sizes)
    return out


def run_dtype(model_dir: Path, dtype: str, vocab: int, steps: int, variants: list[str]) -> dict:
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.cuda_options import CudaOptions

    kv_tokens = max(DECODE) * -(-(CONTEXT + steps + 8) // 16) * 16
    options = CudaOptions(**LAYOUT) if dtype != "bfloat16" else CudaOptions()
    engine = build_engine(
        ModelDir.open(model_dir, verify=False),
        EngineConfig(
            backend="cuda",
            kv_block_size=16,
            kv_cache_tokens=kv_tokens,
            max_batch_tokens=2048,
            max_batch_size=max(DECODE),
            cuda_options=options,
        ),
    )
    engine.warmup()
    runs = {}
    for name in variants if dtype != "bfloat16" else ["bf16"]:
        engine.decoder.set_options(CudaOptions(**VARIANTS.get(name, {})))
        runs[name] = measure(engine, vocab, steps)
        print(dtype, name, json.dumps(runs[name]), flush=True)
    engine.decoder.close()
    return runs


def ratios(bf16: dict, run: dict) -> dict:
    return {
        **{f"decode_b{b}": bf16["decode_ms"][b] / ms for b, ms in run["decode_ms"].items()},
        **{f"prefill_{k}": tok / bf16["prefill_tok_s"][k] for k, tok in run["prefill_tok_s"].items()},
    }


def suggest(runs: dict) -> dict:
    """Thresholds the measurements suggest (per dtype): the smallest decode batch from which Q8_MMA (mma_all)
    is at least as fast as moe_q8 (simt) at every larger batch, and the largest prefill token count up to which
    it is at least as fast as dequantise + cuBLAS (simt)."""
    mma, simt = runs["mma_all"], runs["simt"]
    faster = [int(b) for b in mma["decode_ms"] if mma["decode_ms"][b] <= simt["decode_ms"][b]]
    batches = [int(b) for b in mma["decode_ms"]]
    min_tokens = next((b for b in batches if all(c in faster for c in batches if c >= b)), BIG)
    tokens = {k: int(np.prod([int(v) for v in k.split("x")])) for k in mma["prefill_tok_s"]}
    above = [tokens[k] for k in tokens if tokens[k] > 64]
    wins = [tokens[k] for k in tokens if tokens[k] > 64 and mma["prefill_tok_s"][k] >= simt["prefill_tok_s"][k]]
    max_tokens = 64 if not wins else (BIG if len(wins) == len(above) else max(wins))
    return {"q8_mma_min_tokens": max(2, min_tokens), "q8_mma_max_tokens(this expert count)": max_tokens}


def main() -> int:
    from bench.engine import SHAPES as ENGINE_SHAPES
    from bench.engine import random_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/q8_mma.json")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--workdir", default="/dev/shm/colibri-q8mma")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the 8-bit engines' variants to time")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: {bad} not in {', '.join(VARIANTS)}")
    results: dict = {"shapes": {}}
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        family, params = ENGINE_SHAPES[shape]
        params = {**params, "num_hidden_layers": SHAPES[shape]}
        entry: dict = {"runs": {}, "x_bfloat16": {}, "suggested": {}}
        for dtype in ["bfloat16", *args.dtypes.split(",")]:
            model_dir = random_model(family, params, Path(args.workdir) / shape, dtype)
            entry["runs"][dtype] = run_dtype(model_dir, dtype, params["vocab_size"], args.steps, variants)
            shutil.rmtree(model_dir, ignore_errors=True)
            if dtype != "bfloat16":
                bf16 = entry["runs"]["bfloat16"]["bf16"]
                entry["x_bfloat16"][dtype] = {v: ratios(bf16, r) for v, r in entry["runs"][dtype].items()}
                if {"mma_all", "simt"} <= set(variants):
                    entry["suggested"][dtype] = suggest(entry["runs"][dtype])
        results["shapes"][shape] = entry
        print(json.dumps({shape: {"x_bfloat16": entry["x_bfloat16"], "suggested": entry["suggested"]}}, indent=1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
