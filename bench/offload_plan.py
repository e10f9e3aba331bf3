"""bench/offload.py's routing tables for the plan prefetch: the one traced for a random shape, and the tables that
prefetch only a table's most likely predictions (`--plan-top-k`).

A `colibri router-gen` table ranks each token's experts most counted first and keeps the first --top-k of that
ranking, so its first k columns are the table router-gen builds with `--top-k k` from the same corpus
(tests/bench/test_offload_plan.py checks it). `--plan-top-k 1,2` on a top-2 table runs every plan mode twice in
one benchmark: with the table as it is (the run keyed by the mode, "plan") and with its rank-1 predictions only
(keyed "plan/top1"), each looked up by the worker from its own file (or sent by the router, --plan-source
router) — the prefetch copies fewer experts a token, so the runs' hit rates and bytes copied a token say whether
the rank-2 predictions paid for the slots they took.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.model_format import ModelDir
from common.routing_table import RoutingTable, model_digest, write_routing_table
from expert_service.engine.engine import Engine
from expert_service.tools.routing_gen import generate

TABLE_SEQUENCES, TABLE_SEQUENCE_LENGTH, TABLE_HOLDOUT = 64, 128, 0.125


def build_routing_table(model: ModelDir, engine: Engine, path: Path) -> tuple[RoutingTable, dict]:
    """Traces exact routing of random token ids through `engine` (fully resident) into a table at `path`."""
    cfg = model.config
    corpus = np.random.default_rng(1).integers(0, cfg.vocab_size, TABLE_SEQUENCES * TABLE_SEQUENCE_LENGTH)
    table, report = generate(model, engine, corpus, cfg.num_experts_per_tok, TABLE_HOLDOUT, TABLE_SEQUENCE_LENGTH)
    write_routing_table(path, table, cfg.num_experts, model_digest(model.path))
    keys = ("top_k", "num_experts", "train_tokens", "heldout_tokens", "heldout_unseen_share", "recall")
    summary = {k: report[k] for k in (*keys, "fallback_recall")}
    summary["chance_recall"] = cfg.num_experts_per_tok / cfg.num_experts
    summary["note"] = (
        f"{TABLE_SEQUENCES} x {TABLE_SEQUENCE_LENGTH} random token ids through random weights: "
        f"this recall says nothing about a trained model's table on real traffic, so neither do "
        f"the plan-prefetch runs; token ids the corpus missed use the embedding fallback"
    )
    return RoutingTable.load(path, cfg, model_digest(model.path)), summary


def parse_plan_top_k(text: str | None) -> list[int] | None:
    """`--plan-top-k 1,2` -> [2, 1] (the largest first: the table as it is runs before its cuts); None: not given."""
    if text is None:
        return None
    try:
        ks = [int(v) for v in text.split(",")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise ConfigError(f"--plan-top-k: integers >= 1 separated by commas, got {text!r}")
    return sorted(set(ks), reverse=True)


def check_plan_top_k(ks: list[int] | None, top_k: int) -> None:
    """A k above the table's top_k is refused in one line: the table does not hold those predictions."""
    if too_many := [k for k in ks or () if k > top_k]:
        raise ConfigError(
            f"--plan-top-k: {too_many} above the table's top-{top_k} (build one with `colibri router-gen --top-k "
            f"{max(too_many)}`: a table's first k predictions are router-gen's --top-k k table)"
        )


def plan_tables(
    model: ModelDir, table: RoutingTable, path: Path | None, ks: list[int] | None, workdir: Path
) -> dict[int, tuple[RoutingTable, Path | None]]:
    """k -> (the table cut to its k most likely predictions a token, its file for the worker's lookup) for every k
    of `ks` (None: the table alone). The table's own k is the table and `path`; a smaller one is written to
    `workdir`. A k above the table's is refused (check_plan_top_k)."""
    if ks is None:
        return {table.top_k: (table, path)}
    check_plan_top_k(ks, table.top_k)
    out: dict[int, tuple[RoutingTable, Path | None]] = {}
    for k in ks:
        if k == table.top_k:
            out[k] = (table, path)
            continue
        cut = np.ascontiguousarray(table.table[:, :, :k])
        file = workdir / f"routing_table.top{k}.bin"
        workdir.mkdir(parents=True, exist_ok=True)
        write_routing_table(file, cut, table.num_experts, model_digest(model.path))
        out[k] = (RoutingTable.load(file, model.config, model_digest(model.path)), file)
    return out


def plan_runs(modes: list[str], tables: dict[int, tuple], own_k: int | None) -> list[tuple[str, str, int | None]]:
    """(prefetch mode, run key, plan top-k or None) of every run: a mode without the plan once, one with it once
    per table of `tables`, keyed by the mode for the table as it is (top-`own_k`) and MODE/topK for a cut."""
    runs = []
    for mode in modes:
        if "plan" not in mode or not tables:
            runs.append((mode, mode, None))
            continue
        runs += [(mode, mode if k == own_k else f"{mode}/top{k}", k) for k in tables]
    return runs
