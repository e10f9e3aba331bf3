"""bench/offload.py on a given model (--model, --prompts, --table, --decode-steps) with the cpu backend: prompts
are slices of the text, the router-gen table and its report are what the plan prefetch and the JSON use, and
bad arguments fail in one line before anything runs."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest

from bench import offload
from bench.offload_model import TokenSource, load_table, text_source
from common.errors import ConfigError
from common.routing_table import RoutingTableError
from expert_service.tools.routing_gen import load_corpus
from tests.bench.conftest import HELDOUT_TEXT


def test_random_source_draws_ids_in_range_and_restarts_per_run():
    source = TokenSource(vocab_size=97, seed=3)
    first, again = source.sampler(), source.sampler()
    a = [first(n) for n in (512, 128, 128)]
    assert all(x.dtype == np.int64 and 0 <= x.min() and x.max() < 97 for x in a)
    assert all(np.array_equal(x, again(len(x))) for x in a)  # every run gets the same prompts
    assert not np.array_equal(a[1], a[2])
    # the same stream as the random shapes always used: one generator seeded 0, ids drawn in order
    rng = np.random.default_rng(0)
    take = TokenSource(vocab_size=1000).sampler()
    assert np.array_equal(take(300), rng.integers(0, 1000, 300))


def test_text_source_gives_contiguous_slices_of_the_text(model_with_table):
    model, _, prompts = model_with_table
    source = text_source(model, prompts, longest_prompt=512)
    stream = load_corpus(prompts, "text", model)
    assert np.array_equal(source.stream, stream) and source.describe()["tokens"] == stream.size
    take = source.sampler()
    starts = set()
    for n in (512, 128, 128, 128, 1):
        got = take(n)
        matches = [s for s in range(stream.size - n + 1) if np.array_equal(stream[s : s + n], got)]
        assert len(got) == n and matches, n
        starts.add(matches[0])
    assert len(starts) > 1
    with pytest.raises(ConfigError, match="prompts.txt holds .* tokens, a prompt needs"):
        take(stream.size + 1)


def test_text_too_short_for_a_prompt_is_one_line(model_with_table, tmp_path):
    model, _, _ = model_with_table
    short = tmp_path / "short.txt"
    short.write_text(HELDOUT_TEXT[:100], encoding="utf-8")
    n = load_corpus(short, "text", model).size
    assert 100 <= n < 512
    with pytest.raises(ConfigError, match=rf"--prompts: .*short.txt holds {n} tokens, the longest prompt needs 512"):
        text_source(model, short, 512)


def test_load_table_records_the_router_gen_report(model_with_table, tmp_path):
    model, table_path, _ = model_with_table
    table, summary = load_table(model, table_path)
    report = json.loads((table_path.parent / "table.bin.report.json").read_text())
    assert summary["source"] == "colibri router-gen" and summary["table"] == str(table_path)
    assert summary["recall"] == report["recall"] and summary["recall_per_layer"] == report["recall_per_layer"]
    assert summary["chance_recall"] == model.config.num_experts_per_tok / model.config.num_experts
    assert table.top_k == summary["top_k"] == model.config.num_experts_per_tok
    with pytest.raises(ConfigError, match="--table: .*missing.bin not found .*colibri router-gen"):
        load_table(model, tmp_path / "missing.bin")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"CLRT" + bytes(40))
    with pytest.raises(RoutingTableError, match="bad.bin: version is 0"):
        load_table(model, bad)


def test_model_run_uses_the_text_and_the_table(model_with_table, offload_run):
    model, table_path, prompts = model_with_table
    out, prefilled = offload_run
    stream = load_corpus(prompts, "text", model)
    windows = {stream[s : s + 128].tobytes() for s in range(stream.size - 127)}
    # per run (the resident reference, then none and plan): 1 + 3 prefills of 512, then 1 and 16 decode contexts
    # of 128, greedy and again sampled; each starts with a window of the text
    assert len(prefilled) == 3 * (4 + 2 * (1 + 16)) and all(p[:128].tobytes() in windows for p in prefilled)
    results = json.loads((out / "offload.json").read_text())
    entry = results["shapes"][model.path.name]
    assert entry["prompts"] == {"kind": "text slices", "file": str(prompts), "tokens": int(stream.size), "seed": 0}
    report = json.loads((table_path.parent / "table.bin.report.json").read_text())
    assert entry["routing_table"]["recall"] == report["recall"] and entry["hf"] is None
    assert list(entry["runs"]["0.5"]) == ["none", "plan"]
    block = entry["expert_block_bytes"]
    for mode, run in entry["runs"]["0.5"].items():
        for phase, b in itertools.product(("decode", "decode_sampled"), ("1", "16")):
            d = run[phase][b]
            assert d["steps"] == 3 and d["bytes_copied"] == (d["misses"] + d["prefetches_issued"]) * block
            # the worker looks the table up itself (no plan sent) and scores that lookup on one step in 8
            assert (
                d["plan_recall"] is None if mode != "plan" else d["plan_recall"] is None or 0 <= d["plan_recall"] <= 1
            )
        assert run["plan_source"] == ("worker" if mode == "plan" else None)
    plan = entry["runs"]["0.5"]["plan"]["decode"]  # one-token steps prefetch; b=16's experts exceed the slots
    assert plan["1"]["prefetches_issued"] > 0 and plan["16"]["prefetches_issued"] == 0
    assert (model.path / "colibri.json").is_file()  # the given model is never removed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "M"], "--model: the HF reference needs --hf-model"),
        (["--table", "t.bin", "--skip-hf"], "--table needs --model"),
        (["--hf-model", "hf", "--skip-hf"], "--hf-model needs --model"),
        (["--prompts", "p.txt", "--skip-hf"], "--prompts needs a model with a tokenizer"),
        (["--model", "{model}", "--hf-model", "{tmp}"], "--hf-model: .* has no config.json"),
        (["--model", "{tmp}/nowhere", "--skip-hf"], "--model: .*nowhere is not a Colibri model directory"),
        (["--model", "{model}", "--skip-hf", "--table", "{tmp}/none.bin"], "--table: .*none.bin not found"),
        (
            ["--model", "{model}", "--skip-hf", "--prompts", "{tmp}/none.txt", "--prefetch-modes", "none"],
            "--prompts: .*none.txt not found",
        ),
        (["--model", "{model}", "--skip-hf", "--decode-steps", "0"], "--decode-steps: must be >= 1"),
    ],
)
def test_bad_arguments_fail_in_one_line(argv, message, tiny_model, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, model=tiny_model) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        offload.main(argv + ["--backend", "cpu", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(": error: " + message, error), error
    assert not (tmp_path / "out").exists()
