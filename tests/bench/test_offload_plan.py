"""bench/offload.py --plan-top-k: the plan prefetch from a table's k most likely predictions a token, beside the
table as it is, in one run (cpu backend, tiny model); the cut is router-gen's --top-k k table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import offload
from bench.offload_plan import parse_plan_top_k, plan_runs, plan_tables
from bench.offload_report import mode_name, offload_markdown
from common.errors import ConfigError
from common.routing_table import RoutingTable, model_digest
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
    assert list(tables) == [2, 1] and tables[2] == (table, table_path)
    cut, cut_path = tables[1]
    built = RoutingTable.load(top1_path, model.config, digest)
    assert cut.top_k == built.top_k == 1 and np.array_equal(cut.table, built.table)
    assert np.array_equal(RoutingTable.load(cut_path, model.config, digest).table, built.table)
    assert plan_tables(model, table, table_path, None, tmp_path / "none") == {2: (table, table_path)}
    with pytest.raises(ConfigError, match=r"--plan-top-k: \[3\] above the table's top-2 .*--top-k 3"):
        plan_tables(model, table, table_path, [3, 1], tmp_path / "work")


def test_plan_runs_are_keyed_by_the_cut():
    tables = {2: None, 1: None}
    runs = plan_runs(["none", "plan", "plan+lookahead"], tables, own_k=2)
    assert runs == [
        ("none", "none", None),
        ("plan", "plan", 2),
        ("plan", "plan/top1", 1),
        ("plan+lookahead", "plan+lookahead", 2),
        ("plan+lookahead", "plan+lookahead/top1", 1),
    ]
    assert plan_runs(["plan"], {1: None}, own_k=2) == [("plan", "plan/top1", 1)]  # never "plan" for a cut
    assert plan_runs(["none", "lookahead"], {}, own_k=None) == [
        ("none", "none", None),
        ("lookahead", "lookahead", None),
    ]
    assert parse_plan_top_k("1,2,1") == [2, 1] and parse_plan_top_k(None) is None
    for bad in ("0,1", "one", ""):
        with pytest.raises(ConfigError, match="--plan-top-k: integers >= 1"):
            parse_plan_top_k(bad)
    assert mode_name("plan/top1") == "table top-1" and mode_name("plan+lookahead/top1") == "both top-1"
    assert mode_name("plan/no-cached-gemv") == "table no-cached-gemv" and mode_name("none") == "none"


@pytest.mark.parametrize("plan_source", ["worker", "router"])
def test_top_1_and_top_2_plans_in_one_run(model_with_table, tmp_path, plan_source, monkeypatch):
    """--plan-top-k 1,2: a plan run per table, the cut one looked up from its own file by the worker (or sent by
    the router), its counts in the JSON and the markdown beside the full table's."""
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
    argv += ["--plan-source", plan_source, "--decode-steps", "2", "--temperature", "0"]
    assert offload.main([*argv, "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    entry = json.loads((out / "offload.json").read_text())["shapes"][model.path.name]
    runs = entry["runs"]["0.5"]
    assert list(runs) == ["none", "plan", "plan/top1"] and entry["plan_top_k"] == [2, 1]
    assert [runs[k]["plan_top_k"] for k in runs] == [None, 2, 1]
    cut_path = tmp_path / "work" / model.path.name / "routing_table.top1.bin"
    if plan_source == "worker":  # each plan engine read its own table
        assert [p for p in plan_tables_seen if p[0] == "plan"] == [("plan", str(table_path)), ("plan", str(cut_path))]
    else:
        assert all(p[1] == "router" for p in plan_tables_seen)
    block = entry["expert_block_bytes"]
    for key in ("plan", "plan/top1"):
        for b in ("1", "16"):
            d = runs[key]["decode"][b]
            assert d["bytes_copied"] == (d["misses"] + d["prefetches_issued"]) * block and d["prefetches_issued"] > 0
            if plan_source == "router":  # one prediction a token names at most one of its two experts
                assert 0 < d["plan_recall"] <= (0.5 if key == "plan/top1" else 1.0)
    assert "decode_b1_x_none" in entry["ratios"]["0.5"]["plan/top1"]
    assert "| table top-1 |" in offload_markdown(json.loads((out / "offload.json").read_text()))


def test_plan_top_k_is_checked_before_anything_runs(model_with_table, tmp_path, capsys):
    model, table_path, _ = model_with_table
    argv = ["--model", str(model.path), "--table", str(table_path), "--skip-hf", "--backend", "cpu"]
    for extra, message in (
        (["--plan-top-k", "3"], r"--plan-top-k: \[3\] above the table's top-2"),
        (["--plan-top-k", "x"], "--plan-top-k: integers >= 1"),
        (["--plan-top-k", "1", "--prefetch-modes", "none"], "--plan-top-k: no plan mode in --prefetch-modes"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            offload.main([*argv, *extra, "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert message.replace("\\", "") in capsys.readouterr().err, message
    assert not (tmp_path / "out").exists()
