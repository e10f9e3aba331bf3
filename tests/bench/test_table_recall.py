"""bench/table_recall.py: a table's recall on a text it never saw, per MoE layer, with the fallback, chance and
the unseen-token share; exactly 1.0 on a model whose routing is a function of the token id."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import table_recall
from common.model_format import ModelDir
from common.routing_table import RoutingTable, model_digest
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import Engine, PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.tools.routing_gen import load_corpus, run_router_gen
from tests.bench.conftest import HELDOUT_TEXT
from tests.helpers import make_token_routed_model

SEQUENCE_LENGTH = 64


def texts(tmp_path, seed: int):
    """Two disjoint pieces of the held-out books at random offsets: the table's corpus and the text to score."""
    start = int(np.random.default_rng(seed).integers(0, len(HELDOUT_TEXT) - 8_000))
    train, held = tmp_path / "train.txt", tmp_path / "held.txt"
    train.write_text(HELDOUT_TEXT[start : start + 4_000], encoding="utf-8")
    held.write_text(HELDOUT_TEXT[start + 4_000 : start + 5_000], encoding="utf-8")
    return train, held


def build_table(model_dir, corpus_path, out, top_k: int | None = None):
    model = ModelDir.open(model_dir, verify=False)
    corpus = load_corpus(corpus_path, "text", model)
    run_router_gen(
        model,
        lambda: build_engine(model, EngineConfig(backend="cpu", max_batch_tokens=4096)),
        corpus,
        str(corpus_path),
        out,
        top_k or model.config.num_experts_per_tok,
        0.0,
        SEQUENCE_LENGTH,
    )
    return out


def engine_of(model: ModelDir) -> Engine:
    return build_engine(model, EngineConfig(backend="cpu", max_batch_tokens=4096))


def test_recall_matches_a_set_count_over_each_sequence(tiny_model, tmp_path):
    train, held = texts(tmp_path, seed=1)
    model = ModelDir.open(tiny_model, verify=False)
    table = RoutingTable.load(
        build_table(tiny_model, train, tmp_path / "t.bin"), model.config, model_digest(model.path)
    )
    ids = load_corpus(held, "text", model)
    got = table_recall.heldout_recall(model, engine_of(model), table, ids, SEQUENCE_LENGTH)

    # the same measure, one sequence at a time on a fresh engine, counted with Python sets
    engine, k = engine_of(model), model.config.num_experts_per_tok
    hits = np.zeros(len(model.config.moe_layers))
    by_rank = np.zeros((len(model.config.moe_layers), table.top_k))  # rank j's prediction among the exact experts
    for rid, start in enumerate(range(0, ids.size, SEQUENCE_LENGTH)):
        seq = ids[start : start + SEQUENCE_LENGTH]
        trace = engine.step([PrefillInput(rid, seq, SamplingParams(), False)]).trace
        engine.release([rid])
        for l, layer in enumerate(model.config.moe_layers):
            for t, token in enumerate(seq):
                hits[l] += len(set(trace.expert_ids[layer][t]) & set(table.table[l, token])) / k
                for j, expert in enumerate(table.table[l, token]):
                    by_rank[l, j] += expert in set(trace.expert_ids[layer][t])
    assert got["tokens"] == ids.size and got["sequences"] == -(-ids.size // SEQUENCE_LENGTH)
    assert got["recall_per_layer"] == pytest.approx(list(hits / ids.size), abs=1e-12)
    assert got["recall"] == pytest.approx(float(np.mean(hits / ids.size)), abs=1e-12)
    assert got["chance_recall"] == k / model.config.num_experts
    assert got["precision_per_rank"] == [pytest.approx(list(by_rank[:, j] / ids.size), abs=1e-12) for j in range(k)]
    assert got["precision_by_rank"] == pytest.approx(list((by_rank / ids.size).mean(axis=0)), abs=1e-12)
    assert got["precision"] == pytest.approx(float(by_rank.mean() / ids.size), abs=1e-12)
    assert got["tables"] == [{key: got[key] for key in got["tables"][0]}]  # one table: its figures at the top
    assert all(0 <= r <= 1 for r in got["fallback_recall_per_layer"]) and got["heldout_unseen_share"] is None


def test_token_routed_model_scores_one_at_every_layer(tmp_path):
    model_dir = make_token_routed_model(tmp_path / "model")
    train, held = texts(tmp_path, seed=2)
    model = ModelDir.open(model_dir, verify=False)
    table = RoutingTable.load(build_table(model_dir, train, tmp_path / "t.bin"), model.config, model_digest(model.path))
    ids = load_corpus(held, "text", model)
    got = table_recall.heldout_recall(model, engine_of(model), table, ids, SEQUENCE_LENGTH)
    assert got["recall_per_layer"] == [1.0] * len(model.config.moe_layers)
    assert got["fallback_recall_per_layer"] == [1.0] * len(model.config.moe_layers)


def test_main_writes_the_report_with_the_unseen_share(tiny_model, tmp_path, capsys):
    train, held = texts(tmp_path, seed=3)
    table = build_table(tiny_model, train, tmp_path / "t.bin")
    only_e = tmp_path / "e.txt"
    only_e.write_text("e" * 50)
    out = tmp_path / "recall.json"
    assert (
        table_recall.main(
            [
                str(tiny_model),
                "--table",
                str(table),
                "--text",
                str(held),
                "--train-text",
                str(only_e),
                "--sequence-length",
                str(SEQUENCE_LENGTH),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    model = ModelDir.open(tiny_model, verify=False)
    ids = load_corpus(held, "text", model)
    e_id = load_corpus(only_e, "text", model)[0]
    assert result["heldout_unseen_share"] == pytest.approx(float(np.mean(ids != e_id)))
    assert result["text"] == str(held) and len(result["recall_per_layer"]) == len(model.config.moe_layers)
    printed = capsys.readouterr().out
    assert f"overall  : {result['recall']:.4f}" in printed and "unseen in training" in printed


def test_a_top_1_table_is_the_top_2_tables_first_rank(tiny_model, tmp_path, capsys):
    """router-gen --top-k 1 keeps the first column of the --top-k 2 table (one ranking, cut), so its precision is
    the top-2 table's rank-1 precision; both are scored on one trace, the first --table's figures at the top."""
    train, held = texts(tmp_path, seed=4)
    model = ModelDir.open(tiny_model, verify=False)
    top2, top1 = (build_table(tiny_model, train, tmp_path / f"t{k}.bin", top_k=k) for k in (2, 1))
    digest = model_digest(model.path)
    t2, t1 = (RoutingTable.load(path, model.config, digest) for path in (top2, top1))
    assert t1.top_k == 1 and np.array_equal(t1.table[:, :, 0], t2.table[:, :, 0])
    out = tmp_path / "recall.json"
    argv = [str(tiny_model), "--table", str(top2), "--table", str(top1), "--text", str(held)]
    assert table_recall.main([*argv, "--sequence-length", str(SEQUENCE_LENGTH), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    first, second = result["tables"]
    assert (first["table"], first["top_k"], second["table"], second["top_k"]) == (str(top2), 2, str(top1), 1)
    assert result["precision_by_rank"] == first["precision_by_rank"] and len(first["precision_by_rank"]) == 2
    assert second["precision_per_rank"] == first["precision_per_rank"][:1]
    assert second["recall"] == pytest.approx(first["precision_by_rank"][0] / 2)  # one of the model's two experts
    assert result["chance_precision"] == 2 / model.config.num_experts
    # the rank-2 prediction is right less often than the rank-1 one on every layer of this model
    assert all(p1 > p2 for p1, p2 in zip(*first["precision_per_rank"]))
    printed = capsys.readouterr().out
    assert f"top-1 table {top1}: recall {second['recall']:.4f}" in printed and "precision by rank 1: " in printed


def test_missing_table_is_one_line(tiny_model, tmp_path, capsys):
    held = tmp_path / "held.txt"
    held.write_text(HELDOUT_TEXT[:500])
    with pytest.raises(SystemExit) as exit_info:
        table_recall.main([str(tiny_model), "--table", str(tmp_path / "none.bin"), "--text", str(held)])
    assert exit_info.value.code == 2
    assert "none.bin: routing table not found" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_gated_tables_precision_counts_only_its_real_predictions(tiny_model, tmp_path, capsys):
    """A table with NO_EXPERT entries (router-gen --min-share): precision by rank over the tokens that have a
    prediction at that rank, the predictions a token keeps, and recall over every token, each recomputed here
    from one trace of our own."""
    from common.routing_table import NO_EXPERT, write_routing_table
    from expert_service.tools.routing_gen import split_sequences, trace_routing

    train, held = texts(tmp_path, seed=6)
    model = ModelDir.open(tiny_model, verify=False)
    digest = model_digest(model.path)
    full = RoutingTable.load(build_table(tiny_model, train, tmp_path / "t.bin"), model.config, digest)
    gated = full.table.copy()
    rng = np.random.default_rng(6)
    gated[:, :, 1][rng.random(gated.shape[:2]) < 0.5] = NO_EXPERT  # half the tokens lose their second prediction
    gated[:, :, :][rng.random(gated.shape[:2]) < 0.2] = NO_EXPERT  # a fifth predict nothing
    path = write_routing_table(tmp_path / "gated.bin", gated, model.config.num_experts, digest)
    out = tmp_path / "recall.json"
    argv = [str(tiny_model), "--table", str(path), "--table", str(tmp_path / "t.bin"), "--text", str(held)]
    assert table_recall.main([*argv, "--sequence-length", str(SEQUENCE_LENGTH), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    ids = load_corpus(held, "text", model)
    L, K = gated.shape[0], model.config.num_experts_per_tok
    hits, made, recall = np.zeros((L, 2)), np.zeros((L, 2)), np.zeros(L)
    for token_ids, traced in trace_routing(engine_of(model), split_sequences(ids, SEQUENCE_LENGTH, 0.0)[0]):
        for l, layer in enumerate(model.config.moe_layers):
            for row, exact in zip(gated[l, token_ids], traced[layer]):
                for j, e in enumerate(row):
                    made[l, j] += e != NO_EXPERT
                    hits[l, j] += e != NO_EXPERT and e in exact
                recall[l] += sum(e in exact for e in row) / K
    np.testing.assert_allclose(result["predictions_per_rank"], (made / ids.size).T)
    np.testing.assert_allclose(result["precision_per_rank"], (hits / made).T)
    assert result["precision"] == pytest.approx(hits.sum() / made.sum())
    assert (
        result["predictions_per_token"] == pytest.approx(made.sum() / ids.size / L)
        and result["predictions_per_token"] < 2
    )
    assert result["recall_per_layer"] == pytest.approx((recall / ids.size).tolist())
    full_scores = result["tables"][1]
    assert full_scores["predictions_per_token"] == 2.0 and full_scores["recall"] >= result["recall"]
    assert f"predictions a token keeps: {result['predictions_per_token']:.3f}" in capsys.readouterr().out
