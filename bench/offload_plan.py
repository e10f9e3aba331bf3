"""bench/offload.py's routing tables for the plan prefetch: the one traced for a random shape, and the tables that
prefetch only a table's most likely predictions (`--plan-top-k`) or only its confident ones (`--plan-min-share`).

A `colibri router-gen` table ranks each token's experts most counted first and keeps the first --top-k of that
ranking, so its first k columns are the table router-gen builds with `--top-k k` from the same corpus
(tests/bench/test_offload_plan.py checks it). `--plan-top-k 1,2` on a top-2 table runs every plan mode twice in
one benchmark: with the table as it is (the run keyed by the mode, "plan") and with its rank-1 predictions only
(keyed "plan/top1"), each looked up by the worker from its own file (or sent by the router, --plan-source
router) — the prefetch copies fewer experts a token, so the runs' hit rates and bytes copied a token say whether
the rank-2 predictions paid for the slots they took.

`--plan-min-share 0.3,0.5` runs every plan mode once more per F with the table gated by share (keyed
"plan/share0.3"): a prediction kept only where its expert took at least F of the token's occurrences in the
traced corpus, NO_EXPERT elsewhere (expert_service/tools/routing_shares.py). The cut reads the counts file
`colibri router-gen --save-counts` wrote beside the table (the table traced here for a random shape writes one
too) and is exactly the table `router-gen --min-share F` builds from the same corpus
(tests/bench/test_offload_plan.py checks it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.model_format import ModelDir
from common.routing_table import NO_EXPERT, RoutingTable, model_digest, write_routing_table
from expert_service.engine.engine import Engine
from expert_service.tools.routing_gen import generate
from expert_service.tools.routing_shares import check_min_share, gate_by_share, read_counts, write_counts

TABLE_SEQUENCES, TABLE_SEQUENCE_LENGTH, TABLE_HOLDOUT = 64, 128, 0.125


def build_routing_table(model: ModelDir, engine: Engine, path: Path) -> tuple[RoutingTable, dict]:
    """Traces exact routing of random token ids through `engine` (fully resident) into a table at `path`."""
    cfg = model.config
    corpus = np.random.default_rng(1).integers(0, cfg.vocab_size, TABLE_SEQUENCES * TABLE_SEQUENCE_LENGTH)
    table, report, counts = generate(
        model, engine, corpus, cfg.num_experts_per_tok, TABLE_HOLDOUT, TABLE_SEQUENCE_LENGTH
    )
    write_routing_table(path, table, cfg.num_experts, model_digest(model.path))
    assert counts is not None  # a corpus was traced
    write_counts(path, table, counts.counts, counts.occurrences)  # --plan-min-share cuts the table with them
    keys = ("top_k", "num_experts", "train_tokens", "heldout_tokens", "heldout_unseen_share", "recall")
    summary = {k: report[k] for k in (*keys, "fallback_recall")}
    summary["chance_recall"] = cfg.num_experts_per_tok / cfg.num_experts
    summary["note"] = (
        f"{TABLE_SEQUENCES} x {TABLE_SEQUENCE_LENGTH} random token ids through random weights: "
        f"this recall says nothing about a trained model's table on real traffic, so neither do "
        f"the plan-prefetch runs; token ids the corpus missed use the embedding fallback"
    )
    return RoutingTable.load(path, cfg, model_digest(model.path)), summary


def _positive_list(text: str, parse, flag: str, what: str) -> list:
    """`text` "a,b,..." parsed by `parse`, every value > 0; one line naming `flag` otherwise."""
    try:
        values = [parse(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise ConfigError(f"{flag}: {what} separated by commas, got {text!r}")
    return values


def parse_plan_top_k(text: str | None) -> list[int] | None:
    """`--plan-top-k 1,2` -> [2, 1] (the largest first: the table as it is runs before its cuts); None: not given."""
    if text is None:
        return None
    return sorted(set(_positive_list(text, int, "--plan-top-k", "integers >= 1")), reverse=True)


def parse_plan_min_share(text: str | None) -> list[float] | None:
    """`--plan-min-share 0.3,0.5` -> [0.3, 0.5] (each in (0, 1): 0 is the table as it is); None: not given."""
    if text is None:
        return None
    shares = _positive_list(text, float, "--plan-min-share", "numbers in (0, 1)")
    return sorted({check_min_share(v, "--plan-min-share") for v in shares})


def check_plan_top_k(ks: list[int] | None, top_k: int) -> None:
    """A k above the table's top_k is refused in one line: the table does not hold those predictions."""
    if too_many := [k for k in ks or () if k > top_k]:
        raise ConfigError(
            f"--plan-top-k: {too_many} above the table's top-{top_k} (build one with `colibri router-gen --top-k "
            f"{max(too_many)}`: a table's first k predictions are router-gen's --top-k k table)"
        )


def check_plan_cuts(table: RoutingTable, path: Path, ks: list[int] | None, shares: list[float] | None) -> None:
    """The cuts plan_tables will make of the table at `path`, checked before anything runs (check_plan_top_k, and
    the counts file a share cut reads)."""
    check_plan_top_k(ks, table.top_k)
    if shares:
        read_counts(path, table.table, shares)


def own_cut(table: RoutingTable) -> str:
    """The cut name of a table as it is: its run is keyed by the mode alone."""
    return f"top{table.top_k}"


def plan_tables(
    model: ModelDir,
    table: RoutingTable,
    path: Path | None,
    ks: list[int] | None,
    workdir: Path,
    shares: list[float] | None = None,
) -> dict[str, tuple[RoutingTable, Path | None]]:
    """cut -> (the table cut, its file for the worker's lookup): "topK" for every k of `ks` (None: the table's
    own k alone), the table cut to its k most likely predictions a token, then "shareF" for every F of `shares`,
    the table gated by share (from the counts file beside `path`). The table's own k is the table and `path`;
    the others are written to `workdir`. A k above the table's is refused (check_plan_top_k), a share cut of a
    table without its counts file in one line naming the file."""
    check_plan_top_k(ks, table.top_k)
    cuts: dict[str, np.ndarray | None] = {
        f"top{k}": None if k == table.top_k else table.table[:, :, :k] for k in ks or [table.top_k]
    }
    if shares:
        if path is None:
            raise ConfigError("--plan-min-share: needs the table's file (its counts file lies beside it)")
        counts, occurrences = read_counts(path, table.table, shares)
        cuts.update({f"share{f:g}": gate_by_share(table.table, counts, occurrences, f) for f in shares})
    out: dict[str, tuple[RoutingTable, Path | None]] = {}
    for name, cut in cuts.items():
        if cut is None:
            out[name] = (table, path)
            continue
        file = workdir / f"routing_table.{name}.bin"
        workdir.mkdir(parents=True, exist_ok=True)
        write_routing_table(file, np.ascontiguousarray(cut), table.num_experts, model_digest(model.path))
        out[name] = (RoutingTable.load(file, model.config, model_digest(model.path)), file)
    return out


def plan_runs(modes: list[str], tables: dict[str, tuple], own: str | None) -> list[tuple[str, str, str | None]]:
    """(prefetch mode, run key, plan cut or None) of every run: a mode without the plan once, one with it once
    per table of `tables`, keyed by the mode for the table as it is (cut `own`) and MODE/CUT for a cut
    (plan/top1, plan/share0.3)."""
    runs = []
    for mode in modes:
        if "plan" not in mode or not tables:
            runs.append((mode, mode, None))
            continue
        runs += [(mode, mode if cut == own else f"{mode}/{cut}", cut) for cut in tables]
    return runs


def cut_fields(cut: str | None, table: RoutingTable | None, token_ids: np.ndarray | None) -> dict:
    """A plan run's record of its table: the predictions a token it holds at most, the share it is gated at, and
    the predictions it keeps a token and layer on average over `token_ids` (the text the prompts are cut from;
    None: every token id alike), NO_EXPERT entries not counted."""
    if cut is None or table is None:
        return {"plan_top_k": None, "plan_min_share": None, "plan_predictions_per_token": None}
    ids = np.arange(table.vocab_size) if token_ids is None else token_ids
    return {
        "plan_top_k": table.top_k,
        "plan_min_share": float(cut[5:]) if cut.startswith("share") else None,
        "plan_predictions_per_token": float((table.lookup(ids) != NO_EXPERT).sum(axis=2).mean()),
    }
