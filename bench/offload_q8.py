"""8-bit experts in the expert cache against bf16 ones at the same device bytes, one run.

The same random shape (bench/engine.py SHAPES, written straight into the model format by bench/random_model.py)
is written twice, once with bf16 experts and once with `--expert-dtype` (int8 or fp8) experts. The bf16 model
gets `--fraction` of its expert bytes as slots (slots per layer = round(fraction x experts)); the 8-bit model
gets the slots those same bytes hold, rounded to the nearest whole slot (an int8 block is half a bf16 one plus
its scales, so 25 % of the bf16 bytes hold 50 % of the int8 experts, 0.07 % over on mixtral-shape). Both run
with the cuda backend and no prefetch through bench/offload.py's measurement (prefill b=1 x 512, decode b=1 and
b=16 at context 128); the ratios say how much faster the 8-bit cache runs: decode_b1_x_bf16 = 8-bit tok/s / bf16
tok/s (target on mixtral-shape at 25 %: >= 1.8).

    python bench/offload_q8.py --out out/ [--shape mixtral-shape] [--expert-dtype int8] [--fraction 0.25]

`--shape tiny --backend cpu` runs expert_service.tools.tiny_model's Mixtral (its experts bf16 or 8-bit) on the
cpu backend: counts only, for the tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import SHAPES, random_model  # noqa: E402
from bench.offload import (  # noqa: E402
    NOMINAL_PCIE_BYTES_PER_S,
    TINY,
    bench_colibri,
    close,
    make_engine,
    measure_pcie,
)
from bench.offload_model import TokenSource  # noqa: E402
from common.model_format import ModelDir  # noqa: E402
from expert_service.experts.slots import plan_slots  # noqa: E402

TARGET_B1 = 1.8  # 8-bit b=1 decode over bf16 at 25 % of bf16's expert bytes (mixtral-shape)


def write_models(shape: str, expert_dtype: str, workdir: Path) -> dict[str, Path]:
    """{"bfloat16": dir, expert_dtype: dir} of the same shape."""
    if shape == TINY:
        from expert_service.tools.tiny_model import make_tiny

        return {
            "bfloat16": make_tiny(workdir / "bfloat16", family="mixtral", seed=1, expert_dtype="bfloat16"),
            expert_dtype: make_tiny(workdir / expert_dtype, family="mixtral", seed=1, expert_dtype=expert_dtype),
        }
    family, params = SHAPES[shape]
    return {dtype: random_model(family, params, workdir / "model", dtype) for dtype in ("bfloat16", expert_dtype)}


def slots_at_same_bytes(models: dict[str, ModelDir], fraction: float) -> dict[str, int]:
    """bf16: round(fraction x experts); the others: the slots of the same bytes, to the nearest whole one."""
    dense = plan_slots(models["bfloat16"], 0, 0)
    budget = max(1, round(fraction * dense.num_experts)) * dense.expert_block_bytes
    return {
        dtype: min(dense.num_experts, max(1, round(budget / plan_slots(model, 0, 0).expert_block_bytes)))
        for dtype, model in models.items()
    }


def ratios(runs: dict, expert_dtype: str) -> dict:
    dense, q8 = runs["bfloat16"], runs[expert_dtype]
    out = {
        "slot_bytes_x_bf16": q8["slot_bytes"] / dense["slot_bytes"],
        "prefill_x_bf16": q8["prefill"]["tok_s"] / dense["prefill"]["tok_s"],
    }
    for b, d in q8["decode"].items():
        out[f"decode_b{b}_x_bf16"] = d["tok_s"] / dense["decode"][b]["tok_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out")
    parser.add_argument("--shape", default="mixtral-shape", choices=[*SHAPES, TINY])
    parser.add_argument("--expert-dtype", default="int8", choices=("int8", "fp8"))
    parser.add_argument("--fraction", type=float, default=0.25, help="of the bf16 expert bytes, as slots")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--workdir", default="/dev/shm/colibri-offload-q8")
    args = parser.parse_args(argv)
    if not 0 < args.fraction < 1:
        parser.error(f"--fraction: a share of the expert bytes in (0, 1), got {args.fraction}")
    workdir = Path(args.workdir)
    measured = measure_pcie()
    bytes_per_s = measured or NOMINAL_PCIE_BYTES_PER_S
    try:
        dirs = write_models(args.shape, args.expert_dtype, workdir)
        models = {dtype: ModelDir.open(path, verify=False) for dtype, path in dirs.items()}
        slots = slots_at_same_bytes(models, args.fraction)
        runs = {}
        for dtype, model in models.items():
            plan = plan_slots(model, 0, 0)
            if slots[dtype] >= plan.num_experts:
                parser.error(f"--fraction {args.fraction}: every {dtype} expert fits, nothing is cached")
            engine = make_engine(model, args.backend, slots[dtype], "none")
            try:
                tokens = TokenSource(model.config.vocab_size)
                runs[dtype] = {
                    "expert_formats": list(model.expert_formats),
                    "slots_per_layer": slots[dtype],
                    "num_experts": plan.num_experts,
                    "expert_block_bytes": plan.expert_block_bytes,
                    "slot_bytes": slots[dtype] * plan.num_moe_layers * plan.expert_block_bytes,
                    **bench_colibri(engine, None, bytes_per_s, tokens, args.decode_steps),
                }
            finally:
                close(engine)
            decode = runs[dtype]["decode"]
            print(
                f"{dtype:<9} {slots[dtype]}/{plan.num_experts} slots: "
                + ", ".join(f"b={b} {d['tok_s']:.1f} tok/s (hit rate {d['hit_rate']:.2f})" for b, d in decode.items())
                + f", prefill {runs[dtype]['prefill']['tok_s']:.0f} tok/s",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "shape": args.shape,
        "backend": args.backend,
        "fraction_of_bf16_expert_bytes": args.fraction,
        "pcie_bytes_per_s": bytes_per_s,
        "pcie_measured": measured is not None,
        "runs": runs,
        "ratios": ratios(runs, args.expert_dtype),
        "target_decode_b1_x_bf16": TARGET_B1,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"offload-q8-{args.shape}-{args.expert_dtype}.json").write_text(json.dumps(result, indent=1))
    r = result["ratios"]
    print(
        f"{args.expert_dtype} vs bf16 at {args.fraction:.0%} of bf16's expert bytes ({r['slot_bytes_x_bf16']:.4f}x "
        "the slot bytes): "
        + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "slot_bytes_x_bf16")
        + f" (target decode_b1_x_bf16 >= {TARGET_B1})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
