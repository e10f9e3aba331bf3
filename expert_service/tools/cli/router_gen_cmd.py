"""`colibri router-gen MODEL_DIR [--corpus FILE]`: build the static routing table (docs/routing.md) and report
its top-k recall against exact routing on a held-out part of the corpus."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from common.errors import ConfigError
from common.model_format import ModelDir
from common.routing_table import TABLE_FILE, is_routing_table
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import Engine
from expert_service.tools.cli.paths import given_path
from expert_service.tools.routing_gen import CORPUS_FORMATS, load_corpus, report_path_for, run_router_gen
from expert_service.tools.routing_shares import check_min_share, counts_path_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", help="Colibri model directory")
    parser.add_argument(
        "--corpus",
        metavar="FILE",
        help="traffic to learn from: text (tokenised with "
        "MODEL_DIR/tokenizer.json) or token ids; without it only the embedding fallback is used",
    )
    parser.add_argument(
        "--corpus-format",
        choices=CORPUS_FORMATS,
        default="auto",
        help="text, ids (integers separated by whitespace or commas), or auto: ids when the "
        "file holds only digits, commas and whitespace (default: auto)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="table file (default: MODEL_DIR/routing_table.bin); the report goes to FILE.report.json",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="experts per token in the table (default: the model's num_experts_per_tok)",
    )
    parser.add_argument(
        "--holdout",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="share of the corpus's sequences held out "
        "to measure recall (default: 0.1; at least one sequence when there are two)",
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        default=256,
        metavar="N",
        help="tokens per traced sequence; each "
        "is prefilled on its own, so this is the context routing sees (default: 256)",
    )
    parser.add_argument(
        "--backend",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="engine backend for exact routing (default: cpu)",
    )
    parser.add_argument(
        "--min-share",
        type=float,
        default=0.0,
        metavar="F",
        help="keep a token's prediction at a layer only if that expert was chosen at >= F of the token's "
        "occurrences in the corpus, no prediction (NO_EXPERT, a version-3 table) otherwise; token ids the corpus "
        "never holds then predict nothing (0 <= F < 1; default 0: every prediction, the version-2 table)",
    )
    parser.add_argument(
        "--save-counts",
        action="store_true",
        help="also write FILE.counts.npz: each entry's count and each token's occurrences, to cut the table at "
        "any --min-share later (bench/offload.py --plan-min-share) without tracing the corpus again",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    model = ModelDir.open(given_path(args.model, "MODEL_DIR", "the model directory"))
    config = model.config
    top_k = config.num_experts_per_tok if args.top_k is None else args.top_k
    if not 1 <= top_k <= config.num_experts:
        raise ConfigError(f"--top-k: must be in [1, num_experts={config.num_experts}], got {top_k}")
    if not 0 <= args.holdout < 1:
        raise ConfigError(f"--holdout: must be in [0, 1), got {args.holdout}")
    check_min_share(args.min_share)
    for flag, given in (("--min-share", args.min_share > 0), ("--save-counts", args.save_counts)):
        if given and not args.corpus:  # checked before the model's engine is built
            raise ConfigError(f"{flag}: needs --corpus (shares are counted over the corpus)")
    if not 1 <= args.sequence_length <= config.max_position_embeddings:
        raise ConfigError(
            f"--sequence-length: must be in [1, max_position_embeddings="
            f"{config.max_position_embeddings}], got {args.sequence_length}"
        )
    if not config.moe_layers:
        raise ConfigError(f"{args.model}: the model has no MoE layers, so there is nothing to route")
    # an empty value (an unset shell variable) would otherwise mean "not given": no corpus, or the default table path
    if args.corpus is not None and not str(args.corpus).strip():
        raise ConfigError("--corpus: empty; name a corpus file, or leave the flag out for the fallback-only table")
    if args.out is not None and not str(args.out).strip():
        raise ConfigError(f"--out: empty; name the table's file, or leave the flag out for {model.path / TABLE_FILE}")
    out = Path(args.out) if args.out else model.path / TABLE_FILE
    check_out(out, args.save_counts)
    corpus = load_corpus(args.corpus, args.corpus_format, model) if args.corpus else None
    batch_tokens = max(args.sequence_length, 4096)

    def engine_factory() -> Engine:
        return build_engine(
            model,
            EngineConfig(backend=args.backend, max_batch_tokens=batch_tokens, kv_cache_tokens=batch_tokens + 64 * 16),
        )

    report = run_router_gen(
        model,
        engine_factory,
        corpus,
        args.corpus,
        out,
        top_k,
        args.holdout,
        args.sequence_length,
        progress=not args.no_progress,
        min_share=args.min_share,
        save_counts=args.save_counts,
    )
    print_report(report)
    return 0


def check_out(out: Path, save_counts: bool = False) -> None:
    """Where the table and its report (and counts) go, checked before the corpus is traced (which can take hours):
    writing them used to fail only at the end, naming no flag, or with the table written and its report not."""
    names = {out: "--out", report_path_for(out): "--out's report"}
    if save_counts:
        names[counts_path_for(out)] = "--save-counts"
    for path, flag in names.items():
        if path.is_dir():
            raise ConfigError(f"{flag}: {path} is a directory (name the table's file, e.g. {out / TABLE_FILE})")
        # Each file is written new and renamed over the name: a device or FIFO there (--out /dev/null, as root)
        # would be replaced by a regular file.
        if path.exists() and not path.is_file():
            raise ConfigError(f"{flag}: {path} is not a regular file (the table is written as a new file there)")
    if _would_lose(out):
        raise ConfigError(f"--out: {out} exists and is not a routing table (name a new file, or remove this one first)")
    parent = out.parent
    if not parent.is_dir():
        raise ConfigError(f"--out: {parent} is not a directory (the table's folder must exist)")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--out: {parent} is not writable")


def _would_lose(out: Path) -> bool:
    """Whether writing the table at `out` would lose a file that is no table: the corpus or a file of the model, named
    by a slip. The table is renamed over the name, so a link there is replaced and its file kept (a symlink's target,
    a hard link's other names); an empty file (`mktemp`) holds nothing to lose."""
    try:
        found = out.lstat()
    except OSError:
        return False
    return stat.S_ISREG(found.st_mode) and found.st_nlink == 1 and found.st_size > 0 and not is_routing_table(out)


def print_report(report: dict) -> None:
    layers = report["moe_layers"]
    print(
        f"wrote {report['table']}: {len(layers)} MoE layers x {report['vocab_size']} token ids x top-{report['top_k']} "
        f"(of {report['num_experts']} experts)"
        + (f", predictions with a share >= {report['min_share']} only" if report.get("min_share") else "")
    )
    if not report["has_corpus"]:
        print(f"note: {report['note']}")
    else:
        print(
            f"corpus: {report['corpus_tokens']} tokens; train {report['train_tokens']} tokens "
            f"({report['train_sequences']} sequences), held out {report['heldout_tokens']} tokens "
            f"({report['heldout_sequences']} sequences)"
        )
    if report["recall"] is None:
        if report["has_corpus"]:
            print(f"note: {report['note']}")
    else:
        print(
            f"top-{report['top_k']} recall vs exact routing (model top-{report['model_top_k']}) on held-out "
            f"tokens, {100 * report['heldout_unseen_share']:.1f}% of them never seen in training:"
        )
        for layer, recall in zip(layers, report["recall_per_layer"]):
            print(f"  layer {layer:3d}: {recall:.4f}")
        print(f"  overall  : {report['recall']:.4f}   (embedding fallback alone: {report['fallback_recall']:.4f})")
        precision = report["precision"]
        print(
            f"predictions a held-out token keeps: {report['predictions_per_token']:.3f} a layer (of {report['top_k']}), "
            f"precision {'n/a' if precision is None else f'{precision:.4f}'}"
        )
    if report.get("counts"):
        print(f"counts: {report['counts']}")
    print(f"report: {report_path_for(Path(report['table']))}")
