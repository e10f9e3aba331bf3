"""A routing table's recall on held-out text, per MoE layer, against the fallback alone and chance.

    colibri router-gen MODEL --corpus train.txt --holdout 0      # the table from the training text only
    python bench/table_recall.py MODEL --text heldout.txt [--train-text train.txt] [--backend cuda] --out r.json
        [--table A.bin [--table B.bin ...]]      # several tables (a --top-k 1 and a --top-k 2 one) on one trace

`colibri router-gen` measures recall on the tail of its own corpus. This measures it on a separate file the
table never saw (held-out books), the way router-gen does: the text is tokenised with the model's tokenizer
without special tokens, cut into sequences of --sequence-length tokens, each prefilled on its own with exact
routing, and for every token and MoE layer recall = |table(token) ∩ exact(token)| / k. The embedding
fallback alone (router-gen without a corpus) is scored on the same tokens, and chance is top_k / num_experts.
With --train-text, the share of held-out tokens whose id never occurs in the training text (those the table
fills from the fallback) is reported too.

Precision by rank: for the table's j-th prediction of a token (router-gen orders them most frequent first), the
share of the tokens that have one for which it is among the exact top-k experts, per layer. A plan prefetch of
the rank-j prediction copies an expert that the step uses that often; a prefetch that is wrong more often than
the slot it evicts would have been hit costs bytes on a link-bound step. Only real predictions count: a gated
table (router-gen --min-share) has NO_EXPERT entries, which predict nothing, so "predictions_per_rank" is the
share of tokens with a rank-j prediction and "predictions_per_token" the predictions a token keeps (k for a
table without NO_EXPERT). Recall = |table ∩ exact| / the model's k over all tokens; "precision" = hits over
predictions. Every --table is scored on the same traced routing; the first one's figures are the JSON's
top-level keys, and "tables" lists each one's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import ColibriError, ConfigError  # noqa: E402
from common.model_format import ModelDir  # noqa: E402
from common.routing_table import NO_EXPERT, TABLE_FILE, RoutingTable, model_digest  # noqa: E402
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig  # noqa: E402
from expert_service.engine.engine import Engine  # noqa: E402
from expert_service.tools.routing_gen import build_table, load_corpus, recall_sums, split_sequences, trace_routing  # noqa: E402

BATCH_TOKENS = 4096  # what router-gen packs into one step


def rank_hits(table: np.ndarray, token_ids: np.ndarray, experts_per_layer: list[np.ndarray]) -> np.ndarray:
    """[2, L, k] int: per MoE layer and rank j, the tokens whose j-th predicted expert is among the exact ones,
    and the tokens that have a j-th prediction (not NO_EXPERT)."""
    counts = np.zeros((2, len(experts_per_layer), table.shape[2]), dtype=np.int64)
    for l, exact in enumerate(experts_per_layer):
        predicted = table[l, token_ids]  # [T, k]; NO_EXPERT equals no expert id
        counts[0, l] = (predicted[:, :, None] == exact[:, None, :]).any(axis=2).sum(axis=0)
        counts[1, l] = (predicted != NO_EXPERT).sum(axis=0)
    return counts


def table_scores(table: RoutingTable, counts: np.ndarray, tokens: int, model_top_k: int) -> dict:
    """A table's recall, precision by rank and predictions a token from its rank_hits summed over `tokens`
    held-out tokens (a rank no token has a prediction at, at some layer, has precision None there)."""
    hits, made = counts
    recall = hits.sum(axis=1) / tokens / model_top_k  # the table's entries of a token are distinct
    per_rank = np.where(made > 0, hits / np.maximum(made, 1), np.nan)  # [L, k]
    by_rank = hits.sum(axis=0) / np.maximum(made.sum(axis=0), 1)
    return {
        "top_k": table.top_k,
        "recall_per_layer": [float(r) for r in recall],
        "recall": float(recall.mean()),
        "precision_per_rank": [[_number(p) for p in per_rank[:, j]] for j in range(table.top_k)],
        "precision_by_rank": [_number(p) if m else None for p, m in zip(by_rank, made.sum(axis=0))],
        "precision": _number(hits.sum() / made.sum()) if made.sum() else None,
        "predictions_per_rank": [[float(m) for m in made[:, j] / tokens] for j in range(table.top_k)],
        "predictions_per_token_per_layer": [float(m) for m in made.sum(axis=1) / tokens],
        "predictions_per_token": float(made.sum() / tokens / made.shape[0]),
    }


def _number(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def heldout_recall(
    model: ModelDir,
    engine: Engine,
    table: RoutingTable,
    ids: np.ndarray,
    sequence_length: int,
    seen: np.ndarray | None = None,
    others: tuple[RoutingTable, ...] = (),
) -> dict:
    """Recall and precision by rank of `table` (and of each of `others`, under "tables", `table` first), and the
    fallback-only table's recall, on token ids `ids` [N], per MoE layer and overall.
    seen: bool [V], the token ids of the training text (for the unseen share), or None."""
    config = model.config
    sequences, _ = split_sequences(ids, sequence_length, 0.0)
    fallback = build_table(model, None, table.top_k)
    tables = (table, *others)
    layers = len(config.moe_layers)
    hits = [np.zeros((2, layers, t.top_k), dtype=np.int64) for t in tables]
    fallback_sums, unseen = np.zeros(layers), 0
    for token_ids, traced in trace_routing(engine, sequences):
        exact = [traced[layer] for layer in config.moe_layers]
        for h, t in zip(hits, tables):
            h += rank_hits(t.table, token_ids, exact)
        fallback_sums += recall_sums(fallback, token_ids, exact)
        if seen is not None:
            unseen += int((~seen[token_ids]).sum())
    scores = [table_scores(t, h, ids.size, config.num_experts_per_tok) for t, h in zip(tables, hits)]
    fallback_per_layer = fallback_sums / ids.size
    return {
        "tokens": int(ids.size),
        "sequence_length": sequence_length,
        "sequences": len(sequences),
        "model_top_k": config.num_experts_per_tok,
        "num_experts": config.num_experts,
        "moe_layers": list(config.moe_layers),
        **scores[0],
        "tables": scores,
        "fallback_recall_per_layer": [float(r) for r in fallback_per_layer],
        "fallback_recall": float(fallback_per_layer.mean()),
        "chance_recall": table.top_k / config.num_experts,
        "chance_precision": config.num_experts_per_tok / config.num_experts,  # of any one prediction
        "heldout_unseen_share": unseen / ids.size if seen is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="converted Colibri model directory")
    parser.add_argument(
        "--table",
        action="append",
        help="routing table (default: MODEL/routing_table.bin); repeat it to score several on one trace",
    )
    parser.add_argument("--text", required=True, help="held-out text: never in the table's corpus")
    parser.add_argument("--train-text", help="the text the table was built from (for the unseen-token share)")
    parser.add_argument(
        "--sequence-length", type=int, default=256, help="tokens per traced sequence (router-gen's default: 256)"
    )
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    started = time.time()
    try:
        model = ModelDir.open(args.model, verify=False)
        paths = args.table or [model.path / TABLE_FILE]
        digest = model_digest(model.path)
        tables = [RoutingTable.load(path, model.config, digest) for path in paths]
        if not 1 <= args.sequence_length <= model.config.max_position_embeddings:
            raise ConfigError(
                f"--sequence-length: must be in [1, {model.config.max_position_embeddings}], got {args.sequence_length}"
            )
        ids = load_corpus(args.text, "text", model)
        seen = None
        if args.train_text:
            seen = np.zeros(model.config.vocab_size, dtype=bool)
            seen[load_corpus(args.train_text, "text", model)] = True
    except ColibriError as e:
        parser.error(str(e))
    batch_tokens = max(args.sequence_length, BATCH_TOKENS)
    engine = build_engine(
        model, EngineConfig(backend=args.backend, max_batch_tokens=batch_tokens, kv_cache_tokens=batch_tokens + 64 * 16)
    )
    result = {
        "model": str(model.path),
        "table": str(paths[0]),
        "text": str(args.text),
        "train_text": args.train_text,
        "backend": args.backend,
        **heldout_recall(model, engine, tables[0], ids, args.sequence_length, seen, tuple(tables[1:])),
    }
    for entry, path in zip(result["tables"], paths):
        entry["table"] = str(path)
    result["wall_s"] = round(time.time() - started, 1)
    print(
        f"top-{result['top_k']} recall on {result['tokens']} held-out tokens ({args.text}), chance "
        f"{result['chance_recall']:.3f}"
        + ("" if seen is None else f", {100 * result['heldout_unseen_share']:.1f}% unseen in training")
    )
    for l, (layer, r, f) in enumerate(
        zip(result["moe_layers"], result["recall_per_layer"], result["fallback_recall_per_layer"])
    ):
        print(f"  layer {layer:3d}: {r:.4f}   (fallback {f:.4f})   precision by rank {_ranks(result, l)}")
    print(
        f"  overall  : {result['recall']:.4f}   (fallback {result['fallback_recall']:.4f})   precision by rank "
        f"{_ranks(result)}  {result['wall_s']} s",
        flush=True,
    )
    print(f"  predictions a token keeps: {result['predictions_per_token']:.3f} a layer (of {result['top_k']})")
    for entry in result["tables"][1:]:
        print(
            f"top-{entry['top_k']} table {entry['table']}: recall {entry['recall']:.4f}, "
            f"{entry['predictions_per_token']:.3f} predictions a token, precision by rank"
        )
        for l, layer in enumerate(result["moe_layers"]):
            print(f"  layer {layer:3d}: {_ranks(entry, l)}")
        print(f"  overall  : {_ranks(entry)}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _ranks(scores: dict, layer: int | None = None) -> str:
    """ "1: 0.9412  2: 0.7012" — one layer's precision per rank, or the layers' mean."""
    values = scores["precision_by_rank"] if layer is None else [p[layer] for p in scores["precision_per_rank"]]
    return "  ".join(f"{j + 1}: " + ("n/a" if p is None else f"{p:.4f}") for j, p in enumerate(values))


if __name__ == "__main__":
    sys.exit(main())
