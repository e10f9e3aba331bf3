"""`colibri router-gen`: tables from traced routing, the fallback, the recall report, and a model whose routing
is a function of the token id (recall must be exactly 1.0)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from colibri.cli import main
from common.model_format import ModelDir
from common.routing_table import RoutingTable, model_digest
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools import routing_gen
from expert_service.tools.routing_gen import RoutingCounts, build_table, fallback_ranking, split_sequences
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import make_token_routed_model


def write_ids(path, count: int, seed: int = 0, low: int = 3, high: int = 259):
    ids = np.random.default_rng(seed).integers(low, high, count)
    path.write_text(",".join(map(str, ids[: count // 2])) + "\n" + " ".join(map(str, ids[count // 2 :])))
    return path


def router_gen(capsys, *argv) -> tuple[int, str, str]:
    code = main(["router-gen", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def check_report(report: dict, num_layers: int) -> None:
    assert len(report["recall_per_layer"]) == num_layers
    assert all(0.0 <= r <= 1.0 for r in report["recall_per_layer"] + report["fallback_recall_per_layer"])
    assert report["recall"] == pytest.approx(np.mean(report["recall_per_layer"]))
    assert report["train_tokens"] + report["heldout_tokens"] == report["corpus_tokens"]
    assert report["heldout_tokens"] > 0 and 0.0 <= report["heldout_unseen_share"] <= 1.0


def test_ids_corpus(tiny_model, tmp_path, capsys):
    out = tmp_path / "lut.bin"
    code, stdout, _ = router_gen(
        capsys, tiny_model, "--corpus", write_ids(tmp_path / "ids.txt", 3000), "--out", out, "--sequence-length", 128
    )
    assert code == 0, stdout
    model = ModelDir.open(tiny_model, verify=False)
    table = RoutingTable.load(out, model.config, model_digest(model.path))
    assert table.top_k == model.config.num_experts_per_tok
    report = json.loads((tmp_path / "lut.bin.report.json").read_text())
    check_report(report, len(model.config.moe_layers))
    assert report["corpus_tokens"] == 3000 and report["heldout_sequences"] == 2  # 24 sequences x 0.1
    assert "overall" in stdout and "layer   1" in stdout and "never seen in training" in stdout


def test_text_corpus_on_qwen3(tmp_path, capsys):
    model_dir = make_tiny(tmp_path / "qwen3", family="qwen3_moe", seed=1)
    corpus = tmp_path / "traffic.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40 + "Ünïcödé tëxt, too!\n" * 20)
    code, stdout, _ = router_gen(capsys, model_dir, "--corpus", corpus, "--top-k", 3, "--sequence-length", 64)
    assert code == 0
    config = ModelDir.open(model_dir, verify=False).config
    assert (
        RoutingTable.load(model_dir / "routing_table.bin", config, model_digest(model_dir)).top_k == 3
    )  # default --out
    report = json.loads((model_dir / "routing_table.bin.report.json").read_text())
    check_report(report, len(config.moe_layers))
    assert report["corpus_tokens"] == len(corpus.read_bytes())  # byte tokenizer: one token per byte


def test_without_corpus_is_fallback_only(tiny_model, tmp_path, capsys):
    out = tmp_path / "fallback.bin"
    code, stdout, _ = router_gen(capsys, tiny_model, "--out", out)
    assert code == 0
    assert "no corpus given" in stdout and "fallback only" in stdout and "recall not measured" in stdout
    report = json.loads((tmp_path / "fallback.bin.report.json").read_text())
    assert report["has_corpus"] is False and report["recall"] is None and "fallback only" in report["note"]
    model = ModelDir.open(tiny_model, verify=False)
    table = RoutingTable.load(out, model.config, model_digest(model.path))
    for l, layer in enumerate(model.config.moe_layers):
        np.testing.assert_array_equal(table.table[l], fallback_ranking(model, layer, 0, model.config.vocab_size)[:, :2])


@pytest.mark.parametrize("link", ["symlink", "hard link"])
@pytest.mark.parametrize("name", ["routing_table.bin.tmp", "routing_table.bin.report.json", "routing_table.bin"])
def test_a_link_at_an_output_name_is_replaced_not_written_through(tiny_model, tmp_path, capsys, link, name):
    """The table's .tmp and the report went through open() and write_text, which follow a symlink (and write into
    a hard link's shared file): MODEL_DIR/routing_table.bin.report.json -> /etc/something was overwritten."""
    model_dir = Path(shutil.copytree(tiny_model, tmp_path / "model", ignore=shutil.ignore_patterns("hf")))
    outside = tmp_path / "elsewhere" / "precious"
    outside.parent.mkdir()
    outside.write_bytes(b"not router-gen's")
    if link == "symlink":
        (model_dir / name).symlink_to(outside)
    else:
        (model_dir / name).hardlink_to(outside)
    code, stdout, _ = router_gen(capsys, model_dir)
    assert code == 0, stdout
    assert outside.read_bytes() == b"not router-gen's"
    assert not (model_dir / name).is_symlink() and (name == "routing_table.bin.tmp") != (model_dir / name).exists()
    config = ModelDir.open(model_dir, verify=False).config
    assert (
        RoutingTable.load(model_dir / "routing_table.bin", config, model_digest(model_dir)).top_k
        == config.num_experts_per_tok
    )
    assert json.loads((model_dir / "routing_table.bin.report.json").read_text())["has_corpus"] is False


def test_token_routed_model_has_recall_one(tmp_path, capsys):
    model_dir = make_token_routed_model(tmp_path)
    # ids over the whole vocabulary, so some held-out ids are unseen and the fallback is exercised too.
    corpus = write_ids(tmp_path / "ids.txt", 1500, seed=3, low=0, high=259)
    code, stdout, _ = router_gen(capsys, model_dir, "--corpus", corpus, "--sequence-length", 100, "--holdout", 0.2)
    assert code == 0
    report = json.loads((model_dir / "routing_table.bin.report.json").read_text())
    assert report["recall_per_layer"] == [1.0, 1.0] and report["recall"] == 1.0
    assert report["fallback_recall"] == 1.0 and report["heldout_unseen_share"] > 0


def test_token_routed_model_exact_routing_is_the_fallback(tmp_path):
    """The model's premise, checked directly: every token routes as its fallback ranking, in any context."""
    model = ModelDir.open(make_token_routed_model(tmp_path), verify=False)
    engine = build_engine(model, EngineConfig(backend="cpu", kv_cache_tokens=4096))
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 259, 200), rng.integers(0, 259, 37)]
    for token_ids, traced in routing_gen.trace_routing(engine, sequences):
        for layer in model.config.moe_layers:
            expected = fallback_ranking(model, layer, 0, 259)[token_ids, :2]
            np.testing.assert_array_equal(np.sort(traced[layer], axis=1), np.sort(expected, axis=1))


@pytest.mark.parametrize(
    "argv, code, fragments",
    [
        (["--corpus-format", "ids"], 2, ["--corpus", "259", "vocab_size=259"]),
        (["--top-k", "5"], 2, ["--top-k", "num_experts=4", "got 5"]),
        (["--holdout", "1.0"], 2, ["--holdout", "[0, 1)"]),
        (["--sequence-length", "0"], 2, ["--sequence-length", "got 0"]),
    ],
)
def test_one_line_errors(tiny_model, tmp_path, capsys, argv, code, fragments):
    corpus = tmp_path / "bad.txt"
    corpus.write_text("1 2 259 4")
    got, _, err = router_gen(capsys, tiny_model, "--corpus", corpus, "--out", tmp_path / "x.bin", *argv)
    assert got == code and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("big", [2**63, -(2**63) - 1, 10**30])
def test_an_id_past_int64_is_one_line(tiny_model, tmp_path, capsys, big):
    corpus = tmp_path / "ids.txt"
    corpus.write_text(f"1 2\n3,{big} 4")
    code, out, err = router_gen(
        capsys, tiny_model, "--corpus", corpus, "--out", tmp_path / "x.bin", "--corpus-format", "ids", "--no-progress"
    )
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err == f"colibri router-gen: error: --corpus: {corpus}: token 3 is id {big}, expected < vocab_size=259\n"


def test_text_corpus_needs_the_tokenizer(tmp_path, capsys):
    model_dir = make_tiny(tmp_path / "m", seed=0)
    (model_dir / "tokenizer.json").unlink()
    (tmp_path / "t.txt").write_text("hello")
    code, _, err = router_gen(capsys, model_dir, "--corpus", tmp_path / "t.txt")
    assert code == 3 and "tokenizer.json: not found" in err


def test_split_sequences():
    ids = np.arange(10)
    train, held = split_sequences(ids, 3, 0.1)  # 4 sequences, the last short
    assert [len(s) for s in train] == [3, 3, 3] and held[0].tolist() == [9]
    assert len(split_sequences(ids, 10, 0.5)[1]) == 0  # one sequence: nothing to hold out
    assert len(split_sequences(ids, 1, 0.99)[0]) == 1  # never holds out everything
    assert split_sequences(ids, 2, 0.0)[1] == []


@pytest.mark.parametrize("compact_keys, num_adds", [(10, 7), (10**9, 7), (10**9, 1)])
def test_counts_match_direct_counting(monkeypatch, compact_keys, num_adds):
    monkeypatch.setattr(routing_gen, "_COMPACT_KEYS", compact_keys)  # 10: merge after almost every add
    rng = np.random.default_rng(1)
    counts, direct = RoutingCounts(50, 4, 2), np.zeros((2, 50, 4), dtype=np.int64)
    for _ in range(num_adds):
        tokens = rng.integers(0, 20, 30)  # repeated ids inside one add
        experts = [np.argsort(rng.random((30, 4)), axis=1)[:, :2] for _ in range(2)]
        counts.add(tokens, experts)
        for l in range(2):
            np.add.at(direct[l], (np.repeat(tokens, 2), experts[l].ravel()), 1)
    for l in range(2):
        np.testing.assert_array_equal(counts.dense(l), direct[l])


def test_table_ranks_by_count_then_fallback(tiny_model):
    model = ModelDir.open(tiny_model, verify=False)
    best, second, third, worst = fallback_ranking(model, 0, 5, 6)[0].tolist()
    # Token 5 at layer 0: the fallback's worst expert is counted 5 times, its 2nd and 3rd twice each (a tie
    # the fallback order breaks), its best once. The other layer gets token 5 on the fallback's best two.
    rows = np.array([[worst, second], [worst, third], [second, worst], [third, worst], [best, worst]])
    counts = RoutingCounts(259, 4, 2)
    counts.add(np.full(5, 5), [rows, np.tile(fallback_ranking(model, 1, 5, 6)[:, :2], (5, 1))])
    table = build_table(model, counts, top_k=2)
    assert table[0, 5].tolist() == [worst, second]
    np.testing.assert_array_equal(table[1, 5], fallback_ranking(model, 1, 5, 6)[0, :2])
    np.testing.assert_array_equal(table[0, 6], fallback_ranking(model, 0, 6, 7)[0, :2])  # unseen token


def test_out_that_is_a_directory_is_one_line_naming_it(tiny_model, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    code, out, err = router_gen(capsys, tiny_model, "--out", tmp_path / "out", "--no-progress")
    assert (code, out) == (2, "") and err.startswith(
        f"colibri router-gen: error: --out: {tmp_path / 'out'} is a directory"
    )
    assert err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(
    "words, culprit", [("1 2 --5 3", "--5"), ("1 2 1_0 3", "1_0"), ("4,+-3", "+-3"), ("7 0x10", "0x10")]
)
def test_an_ids_corpus_word_that_is_no_decimal_integer_is_named_in_one_line(
    tiny_model, tmp_path, capsys, words, culprit
):
    """`--5` raised a StopIteration traceback (no culprit found by the looser test that named it), and `1_0` was
    read as 10 (Python's int() takes underscores)."""
    corpus = tmp_path / "ids.txt"
    corpus.write_text(words)
    code, out, err = router_gen(
        capsys, tiny_model, "--corpus", corpus, "--out", tmp_path / "x.bin", "--corpus-format", "ids", "--no-progress"
    )
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.endswith(f"found {culprit.encode()!r}\n"), err


def test_an_empty_corpus_holds_no_tokens_even_without_a_tokenizer(tmp_path, capsys):
    """An empty (or blank) file is read as text: it was refused for the model's missing tokenizer instead."""
    model_dir = make_tiny(tmp_path / "m", seed=0)
    (model_dir / "tokenizer.json").unlink()
    (tmp_path / "empty.txt").write_text(" \n")
    code, _, err = router_gen(capsys, model_dir, "--corpus", tmp_path / "empty.txt", "--out", tmp_path / "x.bin")
    assert code == 2 and err.endswith("empty.txt holds no tokens\n"), err


@pytest.mark.parametrize("where", ["a directory", "a missing folder"])
def test_an_out_that_cannot_be_written_is_refused_before_the_corpus_is_traced(
    tiny_model, tmp_path, capsys, monkeypatch, where
):
    """The table used to be written only after every sequence was traced, then fail naming no flag."""
    from expert_service.tools.cli import router_gen_cmd

    monkeypatch.setattr(router_gen_cmd, "build_engine", lambda *a, **k: pytest.fail("traced before --out was checked"))
    out = tmp_path if where == "a directory" else tmp_path / "missing" / "t.bin"
    code, stdout, err = router_gen(capsys, tiny_model, "--corpus", write_ids(tmp_path / "ids.txt", 300), "--out", out)
    assert (code, stdout) == (2, "") and err.count("\n") == 1, err
    assert err.startswith("colibri router-gen: error: --out: "), err


def test_a_corpus_that_is_a_directory_is_named_as_one(tiny_model, tmp_path, capsys):
    """It was reported as "not found", though it is there."""
    folder = tmp_path / "traffic"
    folder.mkdir()
    code, out, err = router_gen(capsys, tiny_model, "--corpus", folder, "--out", tmp_path / "x.bin")
    assert (code, out) == (2, ""), err
    assert err == f"colibri router-gen: error: --corpus: {folder} is a directory (name the corpus file)\n"


@pytest.mark.parametrize("flag", ["--corpus", "--out"])
def test_an_empty_corpus_or_out_is_refused_naming_the_flag(tiny_model, tmp_path, capsys, flag):
    """`--corpus "$CORPUS"` with the variable unset built the fallback-only table in silence, and `--out ""` wrote
    the model directory's default table: both read an empty value as the flag left out."""
    before = sorted(p.name for p in tiny_model.iterdir())
    code, out, err = router_gen(capsys, tiny_model, flag, "", "--no-progress")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"colibri router-gen: error: {flag}: empty"), err
    assert sorted(p.name for p in tiny_model.iterdir()) == before


@pytest.mark.parametrize("which", ["table", "report"])
@pytest.mark.parametrize("kind", ["a FIFO", "a directory"])
def test_an_out_or_report_name_holding_no_regular_file_is_refused_before_the_corpus_is_traced(
    tiny_model, tmp_path, capsys, monkeypatch, which, kind
):
    """The table is renamed over its name: a FIFO or a device there (--out /dev/null, as root) was replaced by a
    regular file. The report's name was not checked at all: a directory there failed after the trace, leaving the
    table without its report."""
    from expert_service.tools.cli import router_gen_cmd

    monkeypatch.setattr(router_gen_cmd, "build_engine", lambda *a, **k: pytest.fail("traced before --out was checked"))
    out = tmp_path / f"t{np.random.default_rng().integers(1000)}.bin"
    taken = out if which == "table" else out.with_name(out.name + ".report.json")
    os.mkfifo(taken) if kind == "a FIFO" else taken.mkdir()
    code, stdout, err = router_gen(capsys, tiny_model, "--corpus", write_ids(tmp_path / "ids.txt", 300), "--out", out)
    assert (code, stdout) == (2, "") and err.count("\n") == 1, err
    assert err.startswith("colibri router-gen: error: --out") and str(taken) in err, err
    assert stat.S_ISFIFO(taken.lstat().st_mode) if kind == "a FIFO" else taken.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ids.txt", taken.name])


def test_a_corpus_that_is_a_fifo_is_named_as_one(tiny_model, tmp_path, capsys):
    """It was reported as "not found", though it is there."""
    os.mkfifo(tmp_path / "traffic")
    code, out, err = router_gen(capsys, tiny_model, "--corpus", tmp_path / "traffic", "--out", tmp_path / "x.bin")
    assert (code, out) == (2, ""), err
    assert err == (
        f"colibri router-gen: error: --corpus: {tmp_path / 'traffic'} is not a regular file (a corpus is read from "
        "a file)\n"
    )


@pytest.mark.parametrize("which", ["the corpus", "the model's colibri.json", "a tensor file"])
def test_an_out_naming_a_file_that_is_no_table_is_refused_before_anything_is_replaced(
    tmp_path, capsys, monkeypatch, which
):
    """The table is renamed over --out's name, whatever was there: `--out traffic.txt` beside `--corpus traffic.txt`
    replaced the corpus, and `--out MODEL/colibri.json` the model's manifest (the model was gone), after the whole
    trace. A file there that is not a routing table is refused in one line, before the corpus is traced."""
    from expert_service.tools.cli import router_gen_cmd

    model_dir = make_tiny(tmp_path / "m", seed=0)
    corpus = write_ids(tmp_path / "ids.txt", 300)
    out = {"the corpus": corpus, "the model's colibri.json": model_dir / "colibri.json"}.get(which)
    out = out or model_dir / "experts-L000.bin"
    before = out.read_bytes()
    monkeypatch.setattr(router_gen_cmd, "build_engine", lambda *a, **k: pytest.fail("traced before --out was checked"))
    code, stdout, err = router_gen(capsys, model_dir, "--corpus", corpus, "--out", out, "--no-progress")
    assert (code, stdout) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"colibri router-gen: error: --out: {out} ") and "not a routing table" in err, err
    assert out.read_bytes() == before and not out.with_name(out.name + ".report.json").exists()


def test_an_out_holding_a_table_or_an_empty_file_is_replaced(tiny_model, tmp_path, capsys):
    """A table built before (router-gen run again) and an empty file (`OUT=$(mktemp)`) are what --out may replace."""
    out = tmp_path / "t.bin"
    out.touch()
    for _ in range(2):  # empty, then the table the first run wrote
        code, _, err = router_gen(capsys, tiny_model, "--out", out, "--no-progress")
        assert code == 0, err
        RoutingTable.load(out, ModelDir.open(tiny_model, verify=False).config, model_digest(tiny_model))
