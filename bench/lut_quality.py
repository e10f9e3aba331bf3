"""What routing=lut costs in quality (approximations are opt-in, and each one is measured).

For tiny random models of each family: build a routing table from a random-id corpus with router-gen's
code, then run the same prompts with exact routing and with the table's routing (CPU backend) and report
the table's held-out recall, the relative logit divergence of the prefill, agreement of the first generated
token, and greedy-token agreement position by position over the continuation (one different token sends
the rest of a random model's continuation elsewhere, so this falls fast). Writes JSON.

    python bench/lut_quality.py --out out/lut_quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.model_format import ModelDir  # noqa: E402
from common.models import FAMILIES  # noqa: E402
from common.routing_table import RoutingTable, model_digest, write_routing_table  # noqa: E402
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig  # noqa: E402
from expert_service.engine.engine import Engine, PrefillInput  # noqa: E402
from expert_service.engine.sampling import SamplingParams  # noqa: E402
from expert_service.tools.routing_gen import generate  # noqa: E402
from expert_service.tools.tiny_model import make_tiny  # noqa: E402


def run(engine: Engine, prompt: list[int], steps: int, table: RoutingTable | None):
    """Greedy continuation and prefill logits, with the table's routing plan on every step when given."""

    def routing_plan(tokens):
        return table.routing_plan(np.asarray(tokens)) if table is not None else None

    first = engine.step(
        [PrefillInput(0, np.asarray(prompt), SamplingParams(), True)], routing_plan=routing_plan(prompt)
    )
    tokens, logits = [first.outputs[0].token_id], np.asarray(first.logits[0])
    for _ in range(steps - 1):
        tokens.append(engine.step(decode_ids=[0], routing_plan=routing_plan([tokens[-1]])).outputs[0].token_id)
    engine.release([0])
    return tokens, logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-tokens", type=int, default=20000)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", default="out/lut_quality.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in sorted(FAMILIES):
            model_dir = make_tiny(Path(tmp) / family, family=family, seed=11)
            model = ModelDir.open(model_dir)
            exact = build_engine(model, EngineConfig(backend="cpu", routing="exact"))
            lut = build_engine(model, EngineConfig(backend="cpu", routing="lut"))
            corpus = rng.integers(3, model.config.vocab_size, args.corpus_tokens)
            table_array, report, _ = generate(model, exact, corpus, model.config.num_experts_per_tok, 0.1, 256)
            path = write_routing_table(
                Path(tmp) / f"{family}.bin", table_array, model.config.num_experts, model_digest(model.path)
            )
            table = RoutingTable.load(path, model.config, model_digest(model.path))
            # routing=lut routes each token to its k predictions: a gated table (NO_EXPERT, router-gen
            # --min-share) has tokens with fewer, which no lut step takes; generate() keeps every one here
            assert table.complete, "routing=lut needs a table without NO_EXPERT entries"
            divergence, agreement, first = [], [], []
            for _ in range(args.prompts):
                prompt = rng.integers(3, model.config.vocab_size, int(rng.integers(4, 40))).tolist()
                exact_tokens, exact_logits = run(exact, prompt, args.steps, None)
                lut_tokens, lut_logits = run(lut, prompt, args.steps, table)
                divergence.append(float(np.abs(lut_logits - exact_logits).max() / np.abs(exact_logits).max()))
                agreement.append(float(np.mean(np.asarray(exact_tokens) == np.asarray(lut_tokens))))
                first.append(exact_tokens[0] == lut_tokens[0])
            results[family] = {
                "heldout_recall": report["recall"],
                "recall_per_layer": report["recall_per_layer"],
                "prefill_logit_rel_divergence_median": float(np.median(divergence)),
                "prefill_logit_rel_divergence_max": float(np.max(divergence)),
                "first_token_agreement": float(np.mean(first)),
                "greedy_token_agreement": float(np.mean(agreement)),
            }
            print(family, json.dumps(results[family]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
