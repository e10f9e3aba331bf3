"""`colibri router-gen --min-share F` and `--save-counts`: a table keeps a token's prediction at a layer only if the
expert was chosen at >= F of the token's occurrences in the traced corpus (shares computed here again from a trace
of our own), token ids the corpus misses predict nothing, F = 0 is the version-2 table as before, and the report
counts only real predictions."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from colibri.cli import main
from common.model_format import ModelDir
from common.routing_table import NO_EXPERT, RoutingTable, model_digest
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.routing_gen import split_sequences, trace_routing
from expert_service.tools.routing_shares import read_counts

SEQUENCE_LENGTH = 100


def router_gen(capsys, *argv) -> tuple[int, str, str]:
    code = main(["router-gen", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """2,000 ids from a few dozen token ids (each seen in many contexts: shares between 0 and 1), none of 41..258."""
    path = tmp_path_factory.mktemp("corpus") / "ids.txt"
    path.write_text(" ".join(map(str, np.random.default_rng(4).integers(3, 41, 2000))))
    return path


def traced_counts(model: ModelDir, corpus, holdout: float):
    """(occurrences [V], counts [L, V, E], held-out traces) counted here from the engine's exact routing, the way
    router-gen's CLI builds its engine and cuts its sequences."""
    cfg = model.config
    ids = np.array(corpus.read_text().split(), dtype=np.int64)
    train, held = split_sequences(ids, SEQUENCE_LENGTH, holdout)
    engine = build_engine(model, EngineConfig(backend="cpu", max_batch_tokens=4096, kv_cache_tokens=4096 + 64 * 16))
    occurrences = np.zeros(cfg.vocab_size, np.int64)
    counts = np.zeros((len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts), np.int64)
    for token_ids, traced in trace_routing(engine, train):
        np.add.at(occurrences, token_ids, 1)
        for l, layer in enumerate(cfg.moe_layers):
            for t, experts in zip(token_ids, traced[layer]):
                counts[l, t, experts] += 1
    return occurrences, counts, list(trace_routing(engine, held)) if held else []


def expected_gate(table: np.ndarray, occurrences: np.ndarray, counts: np.ndarray, share: float) -> np.ndarray:
    """The ungated table with each entry kept iff count(token, expert) / occurrences(token) >= share."""
    out = table.copy()
    for l in range(table.shape[0]):
        for t in range(table.shape[1]):
            for j, e in enumerate(table[l, t]):
                if occurrences[t] == 0 or counts[l, t, e] / occurrences[t] < share:
                    out[l, t, j] = NO_EXPERT
    return out


def version(path) -> int:
    return struct.unpack_from("<I", path.read_bytes(), 4)[0]


def test_min_share_keeps_exactly_the_predictions_whose_share_is_at_least_f(tiny_model, tmp_path, capsys, corpus):
    model = ModelDir.open(tiny_model, verify=False)
    digest = model_digest(model.path)
    common = ["--corpus", corpus, "--holdout", 0, "--sequence-length", SEQUENCE_LENGTH, "--no-progress"]
    assert router_gen(capsys, tiny_model, *common, "--out", tmp_path / "full.bin", "--save-counts")[0] == 0
    full = RoutingTable.load(tmp_path / "full.bin", model.config, digest)
    assert version(tmp_path / "full.bin") == 2 and full.complete  # F = 0: the table router-gen always wrote
    occurrences, counts, _ = traced_counts(model, corpus, 0.0)
    assert (occurrences[41:] == 0).all() and (occurrences[3:41] > 0).all()
    saved, saved_occurrences = read_counts(tmp_path / "full.bin", full.table)
    np.testing.assert_array_equal(saved_occurrences, occurrences)
    np.testing.assert_array_equal(saved, np.take_along_axis(counts, full.table.astype(np.int64), axis=2))
    shares = np.take_along_axis(counts, full.table.astype(np.int64), axis=2) / np.maximum(occurrences, 1)[:, None]
    seen_shares = shares[:, 3:41]
    assert (seen_shares[..., 1] < 0.6).any() and (seen_shares[..., 1] >= 0.6).any()  # the gate cuts somewhere
    for share in (0.25, 0.6, 0.9):
        out = tmp_path / f"share{share}.bin"
        code, stdout, err = router_gen(capsys, tiny_model, *common, "--out", out, "--min-share", share)
        assert code == 0, err
        assert f"predictions with a share >= {share} only" in stdout
        gated = RoutingTable.load(out, model.config, digest)
        np.testing.assert_array_equal(gated.table, expected_gate(full.table, occurrences, counts, share))
        assert version(out) == 3 and not gated.complete
        assert (gated.table[:, 41:] == NO_EXPERT).all() and (gated.table[:, :3] == NO_EXPERT).all()  # never seen
        report = json.loads((tmp_path / f"share{share}.bin.report.json").read_text())
        assert report["min_share"] == share and "unseen token ids predict nothing" in report["note"]


def test_the_report_counts_only_real_predictions(tiny_model, tmp_path, capsys, corpus):
    """Held-out recall, predictions a token keeps and their precision, each recomputed from our own trace."""
    model = ModelDir.open(tiny_model, verify=False)
    out = tmp_path / "gated.bin"
    argv = ["--corpus", corpus, "--holdout", 0.25, "--sequence-length", SEQUENCE_LENGTH, "--no-progress"]
    code, stdout, err = router_gen(capsys, tiny_model, *argv, "--out", out, "--min-share", 0.5)
    assert code == 0, err
    table = RoutingTable.load(out, model.config, model_digest(model.path)).table
    report = json.loads((tmp_path / "gated.bin.report.json").read_text())
    occurrences, counts, held = traced_counts(model, corpus, 0.25)
    L, K = table.shape[0], model.config.num_experts_per_tok
    hits = made = tokens = 0
    recall = np.zeros(L)
    for token_ids, traced in held:
        tokens += len(token_ids)
        for l, layer in enumerate(model.config.moe_layers):
            rows = table[l, token_ids]
            real = rows != NO_EXPERT
            made += int(real.sum())
            found = int(sum(len(set(r[m].tolist()) & set(e.tolist())) for r, m, e in zip(rows, real, traced[layer])))
            hits += found
            recall[l] += found / K
    assert tokens == report["heldout_tokens"]
    assert report["recall_per_layer"] == pytest.approx((recall / tokens).tolist())
    assert report["predictions_per_token"] == pytest.approx(made / tokens / L)
    assert report["precision"] == pytest.approx(hits / made)
    assert 0 < report["predictions_per_token"] < K and f"{report['predictions_per_token']:.3f} a layer" in stdout
    kept = np.argwhere(table != NO_EXPERT)  # each kept prediction's share, by our own count, is >= F
    assert all(counts[l, t, table[l, t, j]] >= 0.5 * occurrences[t] for l, t, j in kept)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--min-share", "1"], "--min-share: must be in [0, 1), got 1.0"),
        (["--min-share", "-0.1"], "--min-share: must be in [0, 1), got -0.1"),
        (["--min-share", "nan"], "--min-share: must be in [0, 1), got nan"),
        (["--min-share", "0.5", "--no-corpus"], "--min-share: needs --corpus"),
        (["--save-counts", "--no-corpus"], "--save-counts: needs --corpus"),
    ],
)
def test_min_share_and_save_counts_errors_are_one_line(tiny_model, tmp_path, capsys, corpus, argv, fragment):
    given = [a for a in argv if a != "--no-corpus"]
    with_corpus = [] if "--no-corpus" in argv else ["--corpus", corpus]
    code, _, err = router_gen(capsys, tiny_model, *with_corpus, "--out", tmp_path / "x.bin", *given)
    assert code == 2 and err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "x.bin").exists()


def test_a_directory_at_the_counts_name_is_refused_before_the_corpus_is_traced(tiny_model, tmp_path, capsys, corpus):
    (tmp_path / "t.bin.counts.npz").mkdir()
    code, _, err = router_gen(capsys, tiny_model, "--corpus", corpus, "--out", tmp_path / "t.bin", "--save-counts")
    assert code == 2 and err.count("\n") == 1 and "--save-counts: " in err and "is a directory" in err, err
    assert not (tmp_path / "t.bin").exists()
    assert router_gen(capsys, tiny_model, "--corpus", corpus, "--out", tmp_path / "t.bin", "--no-progress")[0] == 0


def test_a_counts_file_that_is_cut_short_or_no_npz_is_one_line(tmp_path):
    from common.errors import ConfigError
    from expert_service.tools.routing_shares import write_counts

    table = np.tile(np.array([0, 1], np.uint16), (2, 5, 1))
    path = write_counts(tmp_path / "t.bin", table, np.ones((2, 5, 2)), np.full(5, 2))
    counts, occurrences = read_counts(tmp_path / "t.bin", table)
    assert counts.tolist() == np.ones((2, 5, 2)).tolist() and occurrences.tolist() == [2] * 5
    good = path.read_bytes()
    for bad in (good[:40], good[:-10], b"PK\x03\x04 no zip", b"not even that"):
        path.write_bytes(bad)
        with pytest.raises(ConfigError, match=r"t.bin.counts.npz: not a router-gen counts file \(") as e:
            read_counts(tmp_path / "t.bin", table)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("field", ["table_crc32", "min_share"])
def test_a_counts_file_whose_number_is_an_array_is_one_line(tmp_path, field):
    """A table_crc32 or min_share holding an array instead of one number failed with a TypeError traceback."""
    from common.errors import ConfigError

    table = np.tile(np.array([0, 1], np.uint16), (2, 5, 1))
    fields = dict(counts=np.ones((2, 5, 2), np.uint32), occurrences=np.full(5, 2, np.uint32))
    fields.update(table_crc32=np.uint32(0), min_share=np.float64(0))
    fields[field] = np.zeros(2)
    np.savez(tmp_path / "t.bin.counts.npz", **fields)
    with pytest.raises(ConfigError, match=r"t.bin.counts.npz: not a router-gen counts file \(") as e:
        read_counts(tmp_path / "t.bin", table)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("built_at", [float("nan"), -0.5, 1.0, 7.0])
def test_a_counts_file_whose_min_share_is_no_share_is_one_line(tmp_path, built_at):
    """A NaN min_share compared below no cut, so a table gated at an unknown share was cut anywhere in silence."""
    import zlib

    from common.errors import ConfigError

    table = np.tile(np.array([0, 1], np.uint16), (2, 5, 1))
    crc = zlib.crc32(np.ascontiguousarray(table, dtype="<u2").tobytes())
    fields = dict(counts=np.ones((2, 5, 2), np.uint32), occurrences=np.full(5, 2, np.uint32))
    np.savez(tmp_path / "t.bin.counts.npz", table_crc32=np.uint32(crc), min_share=np.float64(built_at), **fields)
    with pytest.raises(ConfigError, match=r"t.bin.counts.npz: min_share is .*, expected a share in \[0, 1\)") as e:
        read_counts(tmp_path / "t.bin", table, [0.3])
    assert "\n" not in str(e.value)
