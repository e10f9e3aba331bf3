"""8-bit experts in the expert cache against bf16 ones at the same device bytes, one run.

The same random shape (bench/engine.py SHAPES, written straight into the model format by bench/random_model.py)
is written twice, once with bf16 experts and once with `--expert-dtype` (int8 or fp8) experts. The bf16 model
gets `--fraction` of its expert bytes as slots (slots per layer = round(fraction x experts)); the 8-bit model
gets the slots those same bytes hold, rounded to the nearest whole slot (an int8 block is half a bf16 one plus
its scales, so 25 % of the bf16 bytes hold 50 % of the int8 experts, 0.07 % over on mixtral-shape). Both run
with the cuda backend and no prefetch through bench/offload.py's measurement (prefill b=1 x 512, decode b=1 and
b=16 at context 128); the ratios say how much faster the 8-bit cache runs: decode_b1_x_bf16 = 8-bit tok/s / bf16
tok/s (target on mixtral-shape at 25 %: >= 1.8). Decode runs with greedy continuations and again with continuations
sampled at `--temperature` (0.8; seed = request id, the same for both models; decode_sampled_b1_x_bf16, ...):
greedy continuations of a random model loop over the same few experts, so they hit far more often than traffic does.

    python bench/offload_q8.py --out out/ [--shape mixtral-shape] [--expert-dtype int8] [--fraction 0.25]

`--shape tiny --backend cpu` runs expert_service.tools.tiny_model's Mixtral (its experts bf16 or 8-bit) on the
cpu backend: counts only, for the tests.

A trained model instead of a random shape: two `colibri convert` directories of one checkpoint, its experts bf16
and 8-bit, and held-out text for the prompts (bench/trained_offload.sh runs it on the `large` preset):

    python bench/offload_q8.py --models BF16_DIR,INT8_DIR --prompts heldout.txt --out out/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import SHAPES, random_model  # noqa: E402
from bench.offload import NOMINAL_PCIE_BYTES_PER_S  # noqa: E402
from bench.offload_args import SAMPLED_TEMPERATURE, TINY  # noqa: E402
from bench.offload_hf import DECODE_CONTEXT, PREFILL_TOKENS  # noqa: E402
from bench.offload_measure import bench_colibri, close, make_engine, measure_pcie  # noqa: E402
from bench.offload_model import TokenSource, open_model, text_source  # noqa: E402
from bench.offload_report import DECODE_PHASES  # noqa: E402
from common.dtypes import EXPERT_ALIASES  # noqa: E402
from common.errors import ColibriError, ConfigError  # noqa: E402
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


def open_models(dirs: str, expert_dtype: str) -> dict[str, ModelDir]:
    """--models BF16_DIR,Q8_DIR: {"bfloat16": model, expert_dtype: model}, checked to be one checkpoint whose experts
    are stored bf16 in the first and `expert_dtype` in the second (one-line errors naming the directory)."""
    paths = dirs.split(",")
    if len(paths) != 2:
        raise ConfigError(f"--models: two directories, BF16_DIR,Q8_DIR, got {len(paths)}")
    models = dict(zip(("bfloat16", expert_dtype), (open_model(path, "--models") for path in paths)))
    for dtype, model in models.items():
        formats = model.expert_formats
        if len(formats) != 1 or formats[0].split("/")[0] != EXPERT_ALIASES[dtype]:
            raise ConfigError(f"--models: {model.path} stores its experts as {', '.join(formats)}, expected {dtype}")
    dense, quantized = models.values()
    if dense.dtype != quantized.dtype:  # the 8-bit tensor-core kernels need bf16 dense weights: compare alike
        raise ConfigError(
            f"--models: {dense.path} keeps its dense weights in {dense.dtype}, {quantized.path} in {quantized.dtype}"
        )
    fields = (f.name for f in dataclasses.fields(dense.config))
    if differ := [k for k in fields if getattr(dense.config, k) != getattr(quantized.config, k)]:
        raise ConfigError(f"--models: {dense.path} and {quantized.path} differ in {', '.join(differ)}")
    return models


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
    for phase in (phase for phase in DECODE_PHASES if phase in q8):
        name = f"{phase}_b"  # decode_b1_x_bf16, decode_sampled_b1_x_bf16
        for b, d in q8[phase].items():
            out[f"{name}{b}_x_bf16"] = d["tok_s"] / dense[phase][b]["tok_s"]
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
    parser.add_argument(
        "--models", help="BF16_DIR,Q8_DIR: two converted directories of one checkpoint to run instead of --shape"
    )
    parser.add_argument("--prompts", help="with --models: text to take prompts from (default: random token ids)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=SAMPLED_TEMPERATURE,
        help="decode also with continuations sampled at this temperature (fixed seeds); 0: greedy only",
    )
    args = parser.parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature: a finite number >= 0, got {args.temperature}")
    if not 0 < args.fraction < 1:
        parser.error(f"--fraction: a share of the expert bytes in (0, 1), got {args.fraction}")
    if args.prompts and not args.models:
        parser.error("--prompts needs --models (a random shape has no tokenizer)")
    try:
        given = open_models(args.models, args.expert_dtype) if args.models else None
        tokens = (
            text_source(given["bfloat16"], args.prompts, max(PREFILL_TOKENS, DECODE_CONTEXT))
            if given and args.prompts
            else None
        )
    except ColibriError as e:
        parser.error(str(e))
    workdir = Path(args.workdir)
    measured = measure_pcie()
    bytes_per_s = measured or NOMINAL_PCIE_BYTES_PER_S
    try:
        if given is None:
            dirs = write_models(args.shape, args.expert_dtype, workdir)
            models = {dtype: ModelDir.open(path, verify=False) for dtype, path in dirs.items()}
        else:
            models = given
        slots = slots_at_same_bytes(models, args.fraction)
        runs = {}
        for dtype, model in models.items():
            plan = plan_slots(model, 0, 0)
            if slots[dtype] >= plan.num_experts:
                parser.error(f"--fraction {args.fraction}: every {dtype} expert fits, nothing is cached")
            engine = make_engine(model, args.backend, slots[dtype], "none")
            try:
                tokens = tokens or TokenSource(model.config.vocab_size)  # the same prompts for both models
                runs[dtype] = {
                    "expert_formats": list(model.expert_formats),
                    "slots_per_layer": slots[dtype],
                    "num_experts": plan.num_experts,
                    "expert_block_bytes": plan.expert_block_bytes,
                    "slot_bytes": slots[dtype] * plan.num_moe_layers * plan.expert_block_bytes,
                    **bench_colibri(engine, None, bytes_per_s, tokens, args.decode_steps, temperature=args.temperature),
                }
            finally:
                close(engine)
            for phase in (phase for phase in DECODE_PHASES if phase in runs[dtype]):
                print(
                    f"{dtype:<9} {slots[dtype]}/{plan.num_experts} slots, {phase}: "
                    + ", ".join(
                        f"b={b} {d['tok_s']:.1f} tok/s (hit rate {d['hit_rate']:.2f})"
                        for b, d in runs[dtype][phase].items()
                    ),
                    flush=True,
                )
            print(f"{dtype:<9} prefill {runs[dtype]['prefill']['tok_s']:.0f} tok/s", flush=True)
    finally:
        if given is None:  # written here; given directories are never removed
            shutil.rmtree(workdir, ignore_errors=True)
    name = models["bfloat16"].path.name if given else args.shape
    result = {
        "shape": name,
        "models": [str(m.path) for m in models.values()] if given else None,
        "prompts": tokens.describe() if tokens else None,
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
    (out / f"offload-q8-{name}-{args.expert_dtype}.json").write_text(json.dumps(result, indent=1))
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
