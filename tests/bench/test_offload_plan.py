"""bench/offload.py --plan-top-k / --plan-min-share: the plan prefetch from a table's k most likely predictions a
token, or from its predictions with a share >= F, beside the table as it is, in one run (cpu backend, tiny model);
the cuts are router-gen's --top-k k and --min-share F tables."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import offload
from bench.offload_plan import parse_plan_min_share, parse_plan_top_k, plan_runs, plan_tables
from bench.offload_report import mode_name, offload_markdown
from common.errors import ConfigError
from common.routing_table import NO_EXPERT, RoutingTable, model_digest
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.routing_gen import load_corpus, run_router_gen


def test_a_cut_table_is_router_gens_top_1_table(model_with_table, tmp_path):
    """The table's first column, written for the worker, is the table router-gen builds with --top-k 1 from the
    same corpus (one ranking, cut at k)."""
    model, table_path, _ = model_with_table
    digest = model_digest(model.path)
    table = RoutingTable.load(table_path, model.config, digest)
    corpus_path = table_path.parent / "corpus.txt"  # the fixture's corpus (conftest.model_with_table)
    top1_path = tmp_path / "top1.bin"
    run_router_gen(
        model,
        lambda: build_engine(model, EngineConfig(backend="cpu", max_batch_tokens=4096)),
        load_corpus(corpus_path, "text", model),
        str(corpus_path),
        top1_path,
        1,
        0.1,
        256,
    )
    tables = plan_tables(model, table, table_path, [2, 1], tmp_path / "work")
    assert list(tables) == ["top2", "top1"] and tables["top2"] == (table, table_path)
    cut, cut_path = tables["top1"]
    built = RoutingTable.load(top1_path, model.config, digest)
    assert cut.top_k == built.top_k == 1 and np.array_equal(cut.table, built.table)
    assert np.array_equal(RoutingTable.load(cut_path, model.config, digest).table, built.table)
    assert plan_tables(model, table, table_path, None, tmp_path / "none") == {"top2": (table, table_path)}
    with pytest.raises(ConfigError, match=r"--plan-top-k: \[3\] above the table's top-2 .*--top-k 3"):
        plan_tables(model, table, table_path, [3, 1], tmp_path / "work")


def build(model, corpus_path, out, top_k: int, min_share: float = 0.0, save_counts: bool = False):
    return run_router_gen(
        model,
        lambda: build_engine(model, EngineConfig(backend="cpu", max_batch_tokens=4096)),
        load_corpus(corpus_path, "text", model),
        str(corpus_path),
        out,
        top_k,
        0.1,
        256,
        min_share=min_share,
        save_counts=save_counts,
    )


def test_a_share_cut_is_router_gens_min_share_table(model_with_table, tmp_path):
    """The table gated by share from router-gen's counts file is the table router-gen builds with --min-share F
    from the same corpus: one trace serves every F, and the benchmark runs exactly what a deployment would."""
    model, table_path, _ = model_with_table
    digest = model_digest(model.path)
    table = RoutingTable.load(table_path, model.config, digest)
    corpus_path = table_path.parent / "corpus.txt"
    tables = plan_tables(model, table, table_path, [2, 1], tmp_path / "work", [0.5, 0.9])
    assert list(tables) == ["top2", "top1", "share0.5", "share0.9"]
    for share in (0.5, 0.9):
        build(model, corpus_path, tmp_path / f"s{share}.bin", 2, share)
        built = RoutingTable.load(tmp_path / f"s{share}.bin", model.config, digest)
        cut, cut_path = tables[f"share{share}"]
        assert cut_path == tmp_path / "work" / f"routing_table.share{share}.bin"
        assert np.array_equal(cut.table, built.table) and not built.complete
        kept = built.table != NO_EXPERT
        assert np.array_equal(built.table[kept], table.table[kept])  # the kept entries are the table's own
    assert (tables["share0.9"][0].table == NO_EXPERT).sum() > (tables["share0.5"][0].table == NO_EXPERT).sum()
    alone = tmp_path / "alone" / "table.bin"
    alone.parent.mkdir()
    alone.write_bytes(table_path.read_bytes())
    with pytest.raises(ConfigError, match=r"table.bin.counts.npz: not found .*--save-counts"):
        plan_tables(model, table, alone, None, tmp_path / "w2", [0.3])
    other = tmp_path / "other.bin"
    build(
        model, corpus_path, other, 1, save_counts=True
    )  # another table, its counts file beside it: refused for this one
    (tmp_path / "alone" / "table.bin.counts.npz").write_bytes((tmp_path / "other.bin.counts.npz").read_bytes())
    with pytest.raises(ConfigError, match="the counts of another table"):
        plan_tables(model, table, alone, None, tmp_path / "w3", [0.3])


def test_the_counts_of_a_gated_table_cut_it_only_at_its_share_or_above(model_with_table, tmp_path):
    """router-gen --min-share F0 --save-counts writes the counts of the gated table, whose dropped predictions are
    gone: a cut below F0 came back as the F0 table, labelled with the lower share, and measured as such. It is
    refused in one line; a cut at F0 or above is router-gen's table."""
    model, table_path, _ = model_with_table
    digest = model_digest(model.path)
    corpus_path = table_path.parent / "corpus.txt"
    gated_path = tmp_path / "gated.bin"
    build(model, corpus_path, gated_path, 2, 0.5, save_counts=True)
    gated = RoutingTable.load(gated_path, model.config, digest)
    with pytest.raises(ConfigError) as error:
        plan_tables(model, gated, gated_path, None, tmp_path / "low", [0.3, 0.9])
    message = str(error.value)
    assert "\n" not in message and str(gated_path) in message and "0.5" in message and "0.3" in message, message
    assert not (tmp_path / "low").exists()
    build(model, corpus_path, tmp_path / "s0.9.bin", 2, 0.9)
    cut, _ = plan_tables(model, gated, gated_path, None, tmp_path / "high", [0.5, 0.9])["share0.9"]
    assert np.array_equal(cut.table, RoutingTable.load(tmp_path / "s0.9.bin", model.config, digest).table)


def test_plan_runs_are_keyed_by_the_cut():
    tables = {"top2": None, "top1": None, "share0.3": None}
    runs = plan_runs(["none", "plan", "plan+lookahead"], tables, own="top2")
    assert runs == [
        ("none", "none", None),
        ("plan", "plan", "top2"),
        ("plan", "plan/top1", "top1"),
        ("plan", "plan/share0.3", "share0.3"),
        ("plan+lookahead", "plan+lookahead", "top2"),
        ("plan+lookahead", "plan+lookahead/top1", "top1"),
        ("plan+lookahead", "plan+lookahead/share0.3", "share0.3"),
    ]
    assert plan_runs(["plan"], {"top1": None}, own="top2") == [("plan", "plan/top1", "top1")]  # never "plan" for a cut
    assert plan_runs(["none", "lookahead"], {}, own=None) == [
        ("none", "none", None),
        ("lookahead", "lookahead", None),
    ]
    assert parse_plan_top_k("1,2,1") == [2, 1] and parse_plan_top_k(None) is None
    for bad in ("0,1", "one", ""):
        with pytest.raises(ConfigError, match="--plan-top-k: integers >= 1"):
            parse_plan_top_k(bad)
    assert parse_plan_min_share("0.5,0.3,0.5") == [0.3, 0.5] and parse_plan_min_share(None) is None
    for bad in ("0,0.5", "1", "x", "", "nan", "-0.1"):
        with pytest.raises(ConfigError, match="--plan-min-share: "):
            parse_plan_min_share(bad)
    assert mode_name("plan/top1") == "table top-1" and mode_name("plan+lookahead/top1") == "both top-1"
    assert mode_name("plan/share0.3") == "table share>=0.3"
    assert mode_name("plan/no-cached-gemv") == "table no-cached-gemv" and mode_name("none") == "none"


@pytest.mark.parametrize("plan_source", ["worker", "router"])
def test_top_1_top_2_and_gated_plans_in_one_run(model_with_table, tmp_path, plan_source, monkeypatch):
    """--plan-top-k 1,2 --plan-min-share 0.5: a plan run per table, each cut looked up from its own file by the
    worker (or sent by the router), its counts in the JSON and the markdown beside the full table's."""
    model, table_path, prompts = model_with_table
    plan_tables_seen = []
    make_engine = offload.make_engine

    def spy(*args):  # (model, backend) for the resident engine; a cached one's prefetch and plan_table too
        if len(args) > 2:
            plan_tables_seen.append((args[3], args[5]))
        return make_engine(*args)

    monkeypatch.setattr(offload, "make_engine", spy)
    out = tmp_path / "out"
    argv = ["--model", str(model.path), "--prompts", str(prompts), "--table", str(table_path), "--skip-hf"]
    argv += ["--backend", "cpu", "--fractions", "0.5", "--prefetch-modes", "none,plan", "--plan-top-k", "1,2"]
    argv += ["--plan-source", plan_source, "--decode-steps", "2", "--temperature", "0", "--plan-min-share", "0.5"]
    assert offload.main([*argv, "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    entry = json.loads((out / "offload.json").read_text())["shapes"][model.path.name]
    runs = entry["runs"]["0.5"]
    assert list(runs) == ["none", "plan", "plan/top1", "plan/share0.5"]
    assert entry["plan_cuts"] == ["top2", "top1", "share0.5"]
    assert [runs[k]["plan_top_k"] for k in runs] == [None, 2, 1, 2]
    assert [runs[k]["plan_min_share"] for k in runs] == [None, None, None, 0.5]
    kept = [runs[k]["plan_predictions_per_token"] for k in runs]
    assert kept[:3] == [None, 2.0, 1.0] and 0 < kept[3] < 2.0
    work = tmp_path / "work" / model.path.name
    cut_paths = [str(work / "routing_table.top1.bin"), str(work / "routing_table.share0.5.bin")]
    if plan_source == "worker":  # each plan engine read its own table
        seen = [p for p in plan_tables_seen if p[0] == "plan"]
        assert seen == [("plan", str(table_path)), *(("plan", p) for p in cut_paths)]
    else:
        assert all(p[1] == "router" for p in plan_tables_seen)
    block = entry["expert_block_bytes"]
    for key in ("plan", "plan/top1", "plan/share0.5"):
        for b in ("1", "16"):
            d = runs[key]["decode"][b]
            assert d["bytes_copied"] == (d["misses"] + d["prefetches_issued"]) * block
            # the random model's greedy tokens may be ones the corpus never held: the gated table predicts nothing;
            # b=16 prefetches nothing (its tokens' experts exceed the slots)
            assert (d["prefetches_issued"] > 0 or key == "plan/share0.5") if b == "1" else d["prefetches_issued"] == 0
            if plan_source == "router":  # one prediction a token names at most one of its two experts
                assert 0 < d["plan_recall"] <= (0.5 if key == "plan/top1" else 1.0) or key == "plan/share0.5"
    for b in ("1", "16"):  # the gated table prefetches no more than the table it was cut from
        assert runs["plan/share0.5"]["decode"][b]["prefetches_issued"] <= runs["plan"]["decode"][b]["prefetches_issued"]
    assert "decode_b1_x_none" in entry["ratios"]["0.5"]["plan/top1"]
    assert "| table top-1 |" in offload_markdown(json.loads((out / "offload.json").read_text()))


def test_plan_cuts_are_checked_before_anything_runs(model_with_table, tmp_path, capsys):
    model, table_path, _ = model_with_table
    argv = ["--model", str(model.path), "--table", str(table_path), "--skip-hf", "--backend", "cpu"]
    for extra, message in (
        (["--plan-top-k", "3"], r"--plan-top-k: \[3\] above the table's top-2"),
        (["--plan-top-k", "x"], "--plan-top-k: integers >= 1"),
        (["--plan-top-k", "1", "--prefetch-modes", "none"], "--plan-top-k: no plan mode in --prefetch-modes"),
        (["--plan-min-share", "0.3", "--prefetch-modes", "none"], "--plan-min-share: no plan mode in --prefetch-modes"),
        (["--plan-min-share", "1.5"], "--plan-min-share: must be in [0, 1), got 1.5"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            offload.main([*argv, *extra, "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert message.replace("\\", "") in capsys.readouterr().err, message
    assert not (tmp_path / "out").exists()
