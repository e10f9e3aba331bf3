"""Grammar-mask time per token per sequence on the router's host, for each engine installed (llguidance, which
the router uses; xgrammar and outlines-core when present), on a model's tokenizer: a JSON schema is walked by
random allowed tokens and each mask computation is timed. Writes JSON (median, p99, compile time per engine)
and prints each engine's median as a ratio against llguidance's from the same run.

    python3 bench/constraint_masks.py --model training/default-model-hf --out bench/results/cpu-constraint-masks.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def walk(step, allowed_of, consume, rng, tokens: int) -> list[float]:
    """Times `tokens` mask computations, consuming a random allowed token after each (restarting when done)."""
    times = []
    while len(times) < tokens:
        t0 = time.perf_counter()
        mask = step()
        times.append(time.perf_counter() - t0)
        allowed = allowed_of(mask)
        if allowed is None or not len(allowed):
            return times
        if not consume(int(rng.choice(allowed))):
            return times
    return times


def bits(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])


def bench_llguidance(tokenizer_json: str, vocab: int, eos: int, tokens: int, rng) -> dict:
    import llguidance

    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    template = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    times: list[float] = []
    while len(times) < tokens:
        m = template.deep_copy()

        def allowed(mask):
            ids = bits(np.frombuffer(mask, "<u4").copy(), vocab)
            return ids[ids != eos] if not m.is_stopped() else None

        times += walk(m.compute_bitmask, allowed, m.consume_token, rng, tokens - len(times))
    return {"compile_ms": compile_s * 1e3, "times": times}


def bench_xgrammar(hf_dir: str, vocab: int, eos: int, tokens: int, rng) -> dict:
    import torch
    import xgrammar
    from transformers import AutoTokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(hf_dir), vocab_size=vocab)
    t0 = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times: list[float] = []
    while len(times) < tokens:
        m = xgrammar.GrammarMatcher(compiled)

        def step():
            m.fill_next_token_bitmask(bitmask)
            return bitmask

        def allowed(mask):
            ids = bits(mask[0].numpy().astype(np.int32).view(np.uint32), vocab)
            return ids[ids != eos] if not m.is_terminated() else None

        times += walk(step, allowed, m.accept_token, rng, tokens - len(times))
    del torch
    return {"compile_ms": compile_s * 1e3, "times": times}


def summary(times: list[float]) -> dict:
    us = np.asarray(times) * 1e6
    return {"tokens": len(us), "median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="training/default-model-hf", help="a directory with tokenizer.json")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab, eos = config["vocab_size"], config.get("eos_token_id", 2)
    eos = eos[0] if isinstance(eos, list) else eos
    text = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json")).to_str()
    results = {}
    rng = np.random.default_rng(0)
    runs = {
        "llguidance": lambda: bench_llguidance(text, vocab, eos, args.tokens, rng),
        "xgrammar": lambda: bench_xgrammar(args.model, vocab, eos, args.tokens, rng),
    }
    for name, run in runs.items():
        try:
            r = run()
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        results[name] = {"compile_ms": round(r["compile_ms"], 3), **summary(r["times"])}
    base = results["llguidance"]["median_us"]
    for name, r in results.items():
        r["median_vs_llguidance"] = round(r["median_us"] / base, 3)
        print(
            f"{name}: median {r['median_us']:.1f} us, p99 {r['p99_us']:.1f} us, compile {r['compile_ms']:.1f} ms, "
            f"{r['median_vs_llguidance']}x llguidance"
        )
    report = {"model": args.model, "vocab_size": vocab, "schema": SCHEMA, "engines": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
