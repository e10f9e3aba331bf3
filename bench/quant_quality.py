"""What 8-bit experts (and an 8-bit LM head) cost in quality: held-out perplexity, next-token agreement, logit
error and greedy agreement of a model converted with int8 / fp8 experts, against the same checkpoint with bf16
experts.

Every variant is converted from the same Hugging Face checkpoint with dense weights in bfloat16 (only the
experts' storage, and the head's in the `+...-head` variants, differs) and run on the same held-out token stream,
window by window:
- perplexity: exp(mean next-token cross-entropy) over non-overlapping windows (as training/train.py's
  `evaluate`); its change against bf16 in percent;
- top-1 agreement: share of positions whose argmax equals bf16's (teacher-forced);
- logit error: max |logits - bf16| / max |bf16| per window, worst and mean over windows;
- greedy: continuations of `--new-tokens` from held-out prompts; share identical to bf16's, and the mean
  share of positions that agree before the first difference.
- a variant with an 8-bit head (`int8+int8-head`: `--head-dtype int8`, per-row scales) is also compared with the
  same experts and a bf16 head when that variant runs too (`vs_experts_only`): perplexity change, top-1
  agreement and logit error of the head alone.
- a variant with 8-bit attention projections (`int8+int8-head+int8-attn`: `--attention-dtype int8`, per-row scales)
  likewise against the same variant with dense projections (`vs_dense_attention`).

- the `-w8a8` variants run the same 8-bit experts with 8-bit activations (CudaOptions.q8_activations, which the
  others turn off): on the
  cuda backend the real W8A8 path (the Q8_MMA steps of CudaOptions.w8a8_min_rows+ rows an expert, with Q8_MMA's
  few-expert bound lifted so large steps get there too), on the cpu backend
  an emulation of its arithmetic on every step: each routed expert's input rows and SwiGLU rows (rounded to bf16
  first) quantized per row to the experts' type and back (quantize_rows_reference), weights exact -- every step,
  where the GPU only quantizes steps of w8a8_min_rows+ rows an expert, so an upper bound of what it costs.
- `int8-a8`: int8-w8a8 plus one-token steps on int8 activations (CudaOptions.q8_decode_activations: the token and
  each SwiGLU row through int8, moe_q8_dp4a) on the cuda backend, where the greedy continuations decode; on the cpu
  backend the same emulation as int8-w8a8 (which already rounds every step).

    python bench/quant_quality.py --out bench/results/cpu-quant-quality-default.json
    python bench/quant_quality.py --variants bfloat16,int8,int8-w8a8,fp8-block128,fp8-block128-w8a8 --max-windows 16
    python bench/quant_quality.py --hf-model DIR --heldout TEXT --backend cuda --out FILE.json  # any model
    python bench/quant_quality.py --variants bfloat16,int8,int8+int8-head,fp8-block128,fp8-block128+fp8-head
    python bench/quant_quality.py --variants bfloat16,int8+int8-head,int8+int8-head+int8-attn,\
        fp8-block128+fp8-head+fp8-attn --out bench/results/cpu-quant-quality-attn.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.expert_layout import scale_name  # noqa: E402
from common.model_format import ModelDir  # noqa: E402
from common.model_manifest import ATTENTION_PROJECTIONS  # noqa: E402
from expert_service.backends import build_engine  # noqa: E402
from expert_service.engine.config import EngineConfig  # noqa: E402
from expert_service.engine.cuda_options import CudaOptions  # noqa: E402
from expert_service.engine.engine import Engine  # noqa: E402
from expert_service.tools.convert import convert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# W8A8 on the cuda backend: every Q8_MMA step on its 8-bit tensor cores, Q8_MMA at every size
W8A8_OPTIONS = CudaOptions(q8_activations=True, q8_mma_max_tokens_few_experts=1 << 20)
# ... and one-token steps on int8 activations too (moe_q8_dp4a; int8 experts only)
A8_OPTIONS = replace(W8A8_OPTIONS, q8_decode_activations=True)
EXACT_OPTIONS = CudaOptions(q8_activations=False, q8_decode_activations=False)
# name -> (--expert-dtype, --fp8-scale, the cuda backend's options, --head-dtype or None for the dense dtype,
# --attention-dtype or None for the dense dtype); "-w8a8" / "-a8" names take 8-bit activations, "+...-head" ones an
# 8-bit LM head, "+...-attn" ones 8-bit attention projections
VARIANTS = {
    "bfloat16": ("bfloat16", "block128", EXACT_OPTIONS, None, None),
    "int8": ("int8", "block128", EXACT_OPTIONS, None, None),
    "fp8-block128": ("fp8", "block128", EXACT_OPTIONS, None, None),
    "fp8-channel": ("fp8", "channel", EXACT_OPTIONS, None, None),
    "int8-w8a8": ("int8", "block128", W8A8_OPTIONS, None, None),
    "int8-a8": ("int8", "block128", A8_OPTIONS, None, None),
    "fp8-block128-w8a8": ("fp8", "block128", W8A8_OPTIONS, None, None),
    "fp8-channel-w8a8": ("fp8", "channel", W8A8_OPTIONS, None, None),
    "bfloat16+int8-head": ("bfloat16", "block128", EXACT_OPTIONS, "int8", None),
    "bfloat16+fp8-head": ("bfloat16", "block128", EXACT_OPTIONS, "fp8", None),
    "int8+int8-head": ("int8", "block128", EXACT_OPTIONS, "int8", None),
    "fp8-block128+fp8-head": ("fp8", "block128", EXACT_OPTIONS, "fp8", None),
    "bfloat16+int8-attn": ("bfloat16", "block128", EXACT_OPTIONS, None, "int8"),
    "int8+int8-head+int8-attn": ("int8", "block128", EXACT_OPTIONS, "int8", "int8"),
    "fp8-block128+fp8-head+fp8-attn": ("fp8", "block128", EXACT_OPTIONS, "fp8", "fp8"),
}


def baseline_of(name: str) -> tuple[str, str] | None:
    """(key, variant) of what `name` adds to: a variant with 8-bit attention projections against the same one with
    dense projections ("vs_dense_attention"), one with an 8-bit head against the same experts with a bf16 head
    ("vs_experts_only"); None for a variant that adds neither."""
    expert_dtype, scale, options, head, attention = VARIANTS[name]
    if attention is not None:
        key, base = "vs_dense_attention", (expert_dtype, scale, options, head, None)
    elif head is not None:
        key, base = "vs_experts_only", (expert_dtype, scale, options, None, None)
    else:
        return None
    return key, next(n for n, v in VARIANTS.items() if v == base)


def attention_nbytes(model: ModelDir) -> int:
    """The attention projections' stored bytes, their scales included."""
    names = [f"layers.{i}.{p}" for i in range(model.config.num_hidden_layers) for p in ATTENTION_PROJECTIONS]
    return sum(model.entries[n].nbytes for n in names + [scale_name(n) for n in names] if n in model.entries)


DEFAULT_VARIANTS = ("bfloat16", "int8", "fp8-block128", "fp8-channel")


@contextlib.contextmanager
def emulated_w8a8(expert_dtype: str):
    """The cpu backend's routed experts with W8A8's arithmetic while inside (module docstring)."""
    from expert_service.cpu.layers import moe as cpu_moe
    from expert_service.kernels.expert_quant import CODE_FP8, CODE_INT8
    from expert_service.kernels.quantize_rows import w8a8_swiglu_reference

    code = CODE_INT8 if expert_dtype == "int8" else CODE_FP8

    def mlp(x, gate, up, down):
        return w8a8_swiglu_reference(x, gate, up, down, code)

    exact = cpu_moe.swiglu_mlp
    cpu_moe.swiglu_mlp = mlp
    try:
        yield
    finally:
        cpu_moe.swiglu_mlp = exact


def run_variant(name: str, backend: str):
    """The context a variant's engine runs in: W8A8 emulated on the cpu backend, nothing otherwise."""
    expert_dtype, _, options, _, _ = VARIANTS[name]
    eight_bit = options is not EXACT_OPTIONS
    return emulated_w8a8(expert_dtype) if eight_bit and backend == "cpu" else contextlib.nullcontext()


def heldout_stream(model: ModelDir, heldout: Path) -> np.ndarray:
    """The held-out text as the training run evaluates it: <s> chapter </s> per chapter."""
    from tokenizers import Tokenizer

    from training.corpus import read_chapters
    from training.tokenizer import encode_documents

    path = model.tokenizer_path()
    if path is None:
        raise SystemExit(f"{model.path}: no tokenizer.json to encode {heldout}")
    docs = encode_documents(Tokenizer.from_file(str(path)), [c.as_paragraph() for c in read_chapters(heldout)])
    return np.fromiter((t for d in docs for t in d), dtype=np.int64)


def head_nbytes(model: ModelDir) -> int:
    """A dense head's stored bytes: lm_head, or the embedding a tied model's logits read."""
    return model.entries["lm_head" if "lm_head" in model.entries else "embed_tokens"].nbytes


def against(logits: np.ndarray, ref: np.ndarray) -> tuple[int, float]:
    """A window's logits against a reference's: positions whose next-token argmax agrees (the last position has no
    target), and the logit error max |logits - ref| / max |ref|."""
    agree = int((logits[:-1].argmax(1) == ref[:-1].argmax(1)).sum())
    return agree, float(np.abs(logits - ref).max() / np.abs(ref).max())


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per-position next-token loss in nats (float64 log-sum-exp)."""
    z = logits.astype(np.float64)
    peak = z.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(z - peak).sum(axis=1))
    return lse - z[np.arange(len(targets)), targets]


def greedy(engine: Engine, prompt: np.ndarray, new_tokens: int) -> list[int]:
    return engine.generate(prompt.tolist(), max_new_tokens=new_tokens)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-model", default=str(ROOT / "training/default-model-hf"), help="HF checkpoint dir")
    parser.add_argument("--heldout", default=str(ROOT / "training/data/heldout.txt"), help="held-out text")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}"
    )
    parser.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    parser.add_argument("--max-windows", type=int, default=0, help="0: every window of the held-out stream")
    parser.add_argument("--prompts", type=int, default=32, help="greedy prompts (held-out slices)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default="out/quant_quality.json")
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or "bfloat16" not in names:
        raise SystemExit(f"--variants: {unknown or 'bfloat16 missing'} (choose from {', '.join(VARIANTS)}; bf16 first)")
    names = ["bfloat16"] + [v for v in names if v != "bfloat16"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        engines, sizes, head_sizes, attention_sizes = {}, {}, {}, {}
        for name in names:
            expert_dtype, scale, options, head_dtype, attention_dtype = VARIANTS[name]
            fp8_scale = scale if expert_dtype == "fp8" else None  # convert refuses a scale no expert takes
            out = convert(
                args.hf_model,
                Path(tmp) / name,
                "bfloat16",
                False,
                expert_dtype,
                fp8_scale,
                head_dtype=head_dtype,
                attention_dtype=attention_dtype,
            )
            model = ModelDir.open(out)
            sizes[name] = sum(model.expert_block(*key)[2] for key in model.expert_layouts)
            head_sizes[name] = model.head_format.nbytes if model.head_format else head_nbytes(model)
            attention_sizes[name] = attention_nbytes(model)
            config = EngineConfig(
                backend=args.backend, kv_block_size=16, kv_cache_tokens=2 * args.window, cuda_options=options
            )
            engines[name] = build_engine(model, config)
        stream = heldout_stream(ModelDir.open(Path(tmp) / "bfloat16", verify=False), Path(args.heldout))
        starts = list(range(0, len(stream) - 1, args.window))[: args.max_windows or None]
        nats = {n: 0.0 for n in names}
        agree = {n: 0 for n in names}
        errors: dict[str, list[float]] = {n: [] for n in names}
        # an 8-bit head against the same experts with a bf16 head, 8-bit attention projections against the same
        # model with dense ones: top-1 agreement, logit errors
        keys = {n: pair for n in names if (pair := baseline_of(n)) is not None and pair[1] in names}
        pairs = {n: pair[1] for n, pair in keys.items()}
        head_agree = {n: 0 for n in pairs}
        head_errors: dict[str, list[float]] = {n: [] for n in pairs}
        tokens = 0
        for i, start in enumerate(starts):
            window = stream[start : start + args.window]
            if len(window) < 2:
                continue
            ref = engines["bfloat16"].prompt_logits(window)
            window_logits = {}
            for name in names:
                with run_variant(name, args.backend):
                    logits = ref if name == "bfloat16" else engines[name].prompt_logits(window)
                window_logits[name] = logits
                nats[name] += float(cross_entropy(logits[:-1], window[1:]).sum())
                agreed, error = against(logits, ref)
                agree[name] += agreed
                errors[name].append(error)
            for name, base in pairs.items():
                logits, base_logits = window_logits[name], window_logits[base]
                agreed, error = against(logits, base_logits)
                head_agree[name] += agreed
                head_errors[name].append(error)
            tokens += len(window) - 1
            print(f"window {i + 1}/{len(starts)}: {tokens} tokens, {time.perf_counter() - started:.0f} s", flush=True)
        rng = np.random.default_rng(0)
        prompt_starts = rng.integers(0, len(stream) - args.prompt_tokens, size=args.prompts)
        prompts = [stream[s : s + args.prompt_tokens] for s in prompt_starts]
        ref_greedy = [greedy(engines["bfloat16"], p, args.new_tokens) for p in prompts]
        results: dict[str, dict[str, Any]] = {}
        for name in names:
            with run_variant(name, args.backend):
                ours = (
                    ref_greedy if name == "bfloat16" else [greedy(engines[name], p, args.new_tokens) for p in prompts]
                )
            prefix = [
                next((k for k, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) / len(r)
                for o, r in zip(ours, ref_greedy)
            ]
            ppl = float(np.exp(nats[name] / tokens))
            results[name] = {
                "expert_dtype": VARIANTS[name][0],
                "head_dtype": VARIANTS[name][3] or "bfloat16",
                "head_bytes": head_sizes[name],
                "attention_dtype": VARIANTS[name][4] or "bfloat16",
                "attention_bytes": attention_sizes[name],
                "fp8_scale": VARIANTS[name][1] if VARIANTS[name][0] == "fp8" else None,
                "activations_8bit": VARIANTS[name][2] is not EXACT_OPTIONS,
                "decode_activations_8bit": VARIANTS[name][2].q8_decode_activations,
                "expert_bytes": sizes[name],
                "perplexity": ppl,
                "cross_entropy": nats[name] / tokens,
                "top1_agreement": agree[name] / tokens,
                "logits_rel_error_max": max(errors[name]),
                "logits_rel_error_mean": float(np.mean(errors[name])),
                "greedy_identical": float(np.mean([o == r for o, r in zip(ours, ref_greedy)])),
                "greedy_prefix_agreement": float(np.mean(prefix)),
            }
        base = results["bfloat16"]["perplexity"]
        for name in names:
            results[name]["perplexity_change_pct"] = 100.0 * (results[name]["perplexity"] / base - 1.0)
            results[name]["expert_bytes_ratio"] = results[name]["expert_bytes"] / results["bfloat16"]["expert_bytes"]
            results[name]["head_bytes_ratio"] = results[name]["head_bytes"] / results["bfloat16"]["head_bytes"]
            attention_bf16 = results["bfloat16"]["attention_bytes"]
            results[name]["attention_bytes_ratio"] = results[name]["attention_bytes"] / attention_bf16
        for name, base in pairs.items():
            results[name][keys[name][0]] = {
                "variant": base,
                "perplexity_change_pct": 100.0 * (results[name]["perplexity"] / results[base]["perplexity"] - 1.0),
                "top1_agreement": head_agree[name] / tokens,
                "logits_rel_error_max": max(head_errors[name]),
                "logits_rel_error_mean": float(np.mean(head_errors[name])),
            }
    report = {
        "model": str(args.hf_model),
        "heldout": str(args.heldout),
        "backend": args.backend,
        "tokens": tokens,
        "windows": len(starts),
        "window": args.window,
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "host": platform.node(),
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{'variant':<30} {'ppl':>8} {'vs bf16':>8} {'top1':>7} {'rel err max':>11} {'greedy same':>11} "
        f"{'bytes':>6} {'head':>6} {'attn':>6}"
    )
    for name, r in results.items():
        print(
            f"{name:<30} {r['perplexity']:8.3f} {r['perplexity_change_pct']:+7.3f}% {r['top1_agreement']:7.4f} "
            f"{r['logits_rel_error_max']:11.2e} {r['greedy_identical']:11.3f} {r['expert_bytes_ratio']:6.3f} "
            f"{r['head_bytes_ratio']:6.3f} {r['attention_bytes_ratio']:6.3f}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
