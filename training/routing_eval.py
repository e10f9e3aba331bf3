"""The static routing table on learned routing: what routing=lut costs and what the table's prefetch buys.

    colibri convert training/default-model-hf /tmp/dm --dtype bfloat16
    colibri router-gen /tmp/dm --corpus training/data/corpus.txt --holdout 0.05     # table from the training books
    python -m training.routing_eval /tmp/dm --out bench/results/cpu-default-model-routing.json
    python -m training.routing_eval /tmp/dm --skip-lut --policies lru,lfu --out FILE   # replacement policies

On held-out text (training/data/heldout.txt, books the model and the table never saw), cpu backend:
- lut quality: perplexity with exact routing and with routing=lut (teacher-forced, every position), how often
  their top-1 next-token predictions agree, and greedy continuations of held-out prompts compared token by
  token;
- expert cache: slots for 25 % and 50 % of each layer's experts under prefetch none / plan (the table) /
  lookahead / both, exact routing, one sequence prefilled then decoded: hit rate, bytes copied per token,
  prefetches issued and used.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common.model_format import ModelDir
from common.routing_table import RoutingTable, model_digest
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import Engine, PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.experts.cache import POLICIES, CacheStats
from training.corpus import DATA_DIR

PREFETCH_MODES = ("none", "plan", "lookahead", "plan,lookahead")


@dataclass(frozen=True)
class EvalConfig:
    windows: int = 16  # teacher-forced held-out windows
    window_tokens: int = 256  # router-gen's default sequence length
    prompts: int = 16  # greedy continuations
    prompt_tokens: int = 32
    new_tokens: int = 32
    cache_fractions: tuple[float, ...] = (0.25, 0.5)
    cache_sequences: int = 8  # prefilled, then decoded one token a step
    cache_prompt_tokens: int = 128
    cache_decode_tokens: int = 32


def spaced_slices(ids: np.ndarray, count: int, length: int) -> list[np.ndarray]:
    starts = np.linspace(0, len(ids) - length - 1, count).astype(int)
    return [ids[s : s + length] for s in starts]


def teacher_forced(engine: Engine, ids: np.ndarray, table: RoutingTable | None) -> tuple[np.ndarray, np.ndarray]:
    """(log p(ids[i+1] | ids[:i+1]), argmax of that distribution) for every i, one token a step so that every
    step can carry the table's plan (a step hands back only the logits of a chunk's last token)."""
    logprobs, argmax = np.empty(len(ids) - 1), np.empty(len(ids) - 1, dtype=np.int64)
    for i in range(len(ids) - 1):
        chunk = PrefillInput(0, ids[i : i + 1], SamplingParams() if i == 0 else None, True)
        plan = table.routing_plan(ids[i : i + 1]) if table is not None else None
        logits = np.asarray(engine.step([chunk], routing_plan=plan).logits[0], dtype=np.float64)
        top = logits.max()
        logprobs[i] = logits[ids[i + 1]] - top - math.log(np.exp(logits - top).sum())
        argmax[i] = int(np.argmax(logits))
    engine.release([0])
    return logprobs, argmax


def greedy(engine: Engine, prompt: np.ndarray, new_tokens: int, table: RoutingTable | None) -> list[int]:
    plan = table.routing_plan(prompt) if table is not None else None
    tokens = [engine.step([PrefillInput(0, prompt, SamplingParams(), True)], routing_plan=plan).outputs[0].token_id]
    while len(tokens) < new_tokens:
        plan = table.routing_plan(np.array(tokens[-1:])) if table is not None else None
        tokens.append(engine.step(decode_ids=[0], routing_plan=plan).outputs[0].token_id)
    engine.release([0])
    return tokens


def lut_quality(model: ModelDir, table: RoutingTable, heldout: np.ndarray, config: EvalConfig) -> dict:
    exact = build_engine(model, EngineConfig(backend="cpu", routing="exact"))
    lut = build_engine(model, EngineConfig(backend="cpu", routing="lut"))
    nll = {"exact": [], "lut": []}
    agree = []
    for window in spaced_slices(heldout, config.windows, config.window_tokens):
        exact_lp, exact_top = teacher_forced(exact, window, None)
        lut_lp, lut_top = teacher_forced(lut, window, table)
        nll["exact"].append(-exact_lp)
        nll["lut"].append(-lut_lp)
        agree.append(np.mean(exact_top == lut_top))
    first, positions, prefix = [], [], []
    for window in spaced_slices(heldout, config.prompts, config.prompt_tokens + 1):
        prompt = window[: config.prompt_tokens]
        a, b = (np.asarray(greedy(e, prompt, config.new_tokens, t)) for e, t in ((exact, None), (lut, table)))
        first.append(bool(a[0] == b[0]))
        positions.append(float(np.mean(a == b)))
        prefix.append(int(np.argmin(a == b)) if not np.all(a == b) else len(a))
    exact_nll, lut_nll = np.concatenate(nll["exact"]), np.concatenate(nll["lut"])
    return {
        "tokens_scored": int(exact_nll.size),
        "perplexity_exact": math.exp(exact_nll.mean()),
        "perplexity_lut": math.exp(lut_nll.mean()),
        "teacher_forced_top1_agreement": float(np.mean(agree)),
        "greedy_first_token_agreement": float(np.mean(first)),
        "greedy_token_agreement_by_position": float(np.mean(positions)),
        "greedy_identical_prefix_tokens_mean": float(np.mean(prefix)),
        "greedy_new_tokens": config.new_tokens,
        "prompts": config.prompts,
    }


def cache_run(
    model: ModelDir,
    table: RoutingTable,
    heldout: np.ndarray,
    slots: int,
    prefetch: str,
    config: EvalConfig,
    policy: str = "lru",
) -> dict:
    engine = build_engine(
        model, EngineConfig(backend="cpu", expert_cache_slots=slots, prefetch=prefetch, expert_cache_policy=policy)
    )
    prefill, decode, decode_steps = CacheStats(), CacheStats(), 0
    try:
        for rid, window in enumerate(spaced_slices(heldout, config.cache_sequences, config.cache_prompt_tokens)):
            step = engine.step(
                [PrefillInput(rid, window, SamplingParams(), True)], routing_plan=table.routing_plan(window)
            )
            prefill += step.expert_cache
            for _ in range(config.cache_decode_tokens):
                last = np.array([engine.sequences[rid].last_token])
                step = engine.step(decode_ids=[rid], routing_plan=table.routing_plan(last))
                decode += step.expert_cache
                decode_steps += 1
            engine.release([rid])
    finally:
        engine.close()
    block = (decode.bytes_copied or 1) / max(1, decode.misses + decode.prefetches_issued)
    return {
        "slots_per_layer": slots,
        "prefetch": prefetch,
        "policy": policy,
        "decode": {**_cache_summary(decode, decode_steps), "expert_block_bytes": round(block)},
        "prefill": _cache_summary(prefill, config.cache_sequences * config.cache_prompt_tokens),
    }


def _cache_summary(stats: CacheStats, tokens: int) -> dict:
    summary = {k: v for k, v in asdict(stats).items() if k != "stall_seconds"}
    summary.update(
        hit_rate=round(stats.hit_rate, 4),
        bytes_copied_per_token=round(stats.bytes_copied / tokens),
        prefetch_use_rate=round(stats.prefetches_used / stats.prefetches_issued, 4)
        if stats.prefetches_issued
        else None,
        tokens=tokens,
    )
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="converted model directory")
    parser.add_argument("--table", type=Path, help="routing table (default: MODEL/routing_table.bin)")
    parser.add_argument("--text", type=Path, default=DATA_DIR / "heldout.txt", help="held-out text")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu-default-model-routing.json"))
    parser.add_argument("--skip-cache", action="store_true")
    parser.add_argument("--skip-lut", action="store_true", help="only the expert cache's counts")
    parser.add_argument("--policies", default="lru", help="expert cache replacement policies, comma-separated")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if bad := [p for p in policies if p not in POLICIES]:
        parser.error(f"--policies: {bad} not in {', '.join(POLICIES)}")
    config = EvalConfig()
    model = ModelDir.open(args.model)
    table_path = args.table or args.model / "routing_table.bin"
    table = RoutingTable.load(table_path, model.config, model_digest(model.path))
    if not table.complete and not args.skip_lut:  # lut routes each token to k predictions: a gated table lacks some
        parser.error(f"--table: {table_path} has NO_EXPERT entries (router-gen --min-share): lut needs --skip-lut")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    heldout = np.asarray(tokenizer.encode(args.text.read_text(encoding="utf-8")).ids, dtype=np.int64)
    report_path = Path(str(table_path) + ".report.json")
    result = {
        "model": str(args.model),
        "table": str(table_path),
        "text": str(args.text),
        "heldout_tokens": int(heldout.size),
        "config": asdict(config),
        "router_gen_report": json.loads(report_path.read_text()) if report_path.is_file() else None,
    }
    started = time.time()
    if not args.skip_lut:
        result["lut_quality"] = lut_quality(model, table, heldout, config)
        print(json.dumps(result["lut_quality"], indent=1), f"({time.time() - started:.0f} s)", flush=True)
    if not args.skip_cache:
        result["expert_cache"] = []
        for fraction in config.cache_fractions:
            slots = max(1, round(fraction * model.config.num_experts))
            for mode in PREFETCH_MODES:
                for policy in policies:
                    run = cache_run(model, table, heldout, slots, mode, config, policy)
                    result["expert_cache"].append({"fraction": fraction, **run})
                    d = run["decode"]
                    print(
                        f"{fraction:.0%} ({slots} slots) {policy} prefetch {mode:15s} decode hit rate "
                        f"{d['hit_rate']:.3f} bytes/token {d['bytes_copied_per_token']:,} prefetches "
                        f"{d['prefetches_issued']} used {d['prefetches_used']}",
                        flush=True,
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
