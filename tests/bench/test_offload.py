"""bench/offload.py end to end on the tiny model with the cpu backend: the JSON's cache accounting is consistent."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from bench import offload, offload_args, offload_hf, offload_measure
from bench.offload_report import option_key
from expert_service.engine.cuda_options import CudaOptions


@pytest.mark.parametrize("plan_source", ["worker", "router"])
def test_offload_tiny_cpu(tmp_path, plan_source):
    """The worker looks the plan up itself (no plan sent; the recall of its lookup measured) or the router sends it
    with each step (its recall measured)."""
    out = tmp_path / "out"
    assert (
        offload.main(
            [
                "--shapes",
                "tiny",
                "--backend",
                "cpu",
                "--fractions",
                "1,0.5",
                "--prefetch-modes",
                "none,plan",
                "--plan-source",
                plan_source,
                "--out",
                str(out),
                "--workdir",
                str(tmp_path / "work"),
            ]
        )
        == 0
    )
    results = json.loads((out / "offload.json").read_text())
    assert results["pcie_bytes_per_s"] > 0 and results["backend"] == "cpu"
    entry = results["shapes"]["tiny"]
    assert entry["hf"] is None
    block = entry["expert_block_bytes"]
    assert entry["expert_bytes"] == block * entry["num_experts"] * entry["num_moe_layers"]
    assert 0 <= entry["routing_table"]["recall"] <= 1
    assert list(entry["runs"]["1.0"]) == ["resident"] and list(entry["runs"]["0.5"]) == ["none", "plan"]
    assert entry["runs"]["0.5"]["none"]["slots_per_layer"] == entry["num_experts"] // 2

    for _fraction, modes in entry["runs"].items():
        for mode, run in modes.items():
            phases = [run["prefill"], *(run["decode"][b] for b in ("1", "16"))]
            for phase in phases:
                assert phase["tok_s"] > 0 and phase["steps"] > 0
                assert phase["hits"] + phase["misses"] > 0
                assert 0 <= phase["hit_rate"] <= 1
                assert phase["bytes_copied"] == (phase["misses"] + phase["prefetches_issued"]) * block
                assert phase["prefetches_used"] <= phase["prefetches_issued"]
                assert 0 <= phase["stall_fraction"] <= 1
                if mode == "none":
                    assert phase["bytes_copied"] == phase["misses"] * block and phase["prefetches_issued"] == 0
                if mode == "resident":
                    assert phase["misses"] == 0 and phase["bytes_copied"] == 0 and phase["hit_rate"] == 1
                    assert phase["x_pcie_bound"] is None
                else:
                    assert phase["misses"] > 0 and phase["x_pcie_bound"] > 0
                if mode != "plan":
                    assert phase["plan_recall"] is None
                elif plan_source == "router":  # every step's plan scored (the worker's lookup: one step in 8)
                    assert 0 <= phase["plan_recall"] <= 1
                if mode == "plan":  # only one-token steps' experts fit the slots: the others copy only misses
                    assert run["plan_source"] == plan_source
                    assert (phase["prefetches_issued"] > 0) == (phase is run["decode"]["1"])
    # b=16 x top-2 needs every expert of the tiny model and only half of them fit: misses every step
    assert entry["runs"]["0.5"]["none"]["decode"]["16"]["hit_rate"] < 1
    assert "decode_b1_x_none" in entry["ratios"]["0.5"]["plan"]
    assert (out / "offload.png").is_file() or importlib.util.find_spec("matplotlib") is None


def test_offload_tiny_cpu_with_int8_experts(tmp_path):
    """--expert-dtype converts the shape's experts; the blocks the cache copies are the int8 ones."""
    out = tmp_path / "out"
    argv = ["--shapes", "tiny", "--backend", "cpu", "--fractions", "0.5", "--prefetch-modes", "none"]
    argv += ["--out", str(out), "--workdir", str(tmp_path / "work"), "--expert-dtype", "int8"]
    assert offload.main(argv) == 0
    results = json.loads((out / "offload.json").read_text())
    entry = results["shapes"]["tiny"]
    F, D = 96, 64  # the tiny mixtral's expert: three int8 matrices, then float32 scales [F], [F], [D], each
    scales = 512 + 512 + 4 * D  # starting on a 256-byte boundary (384 bytes of [F] take 512 with padding)
    assert results["expert_dtype"] == "int8" and entry["expert_block_bytes"] == 3 * F * D + scales
    assert entry["runs"]["0.5"]["none"]["slots_per_layer"] == entry["num_experts"] // 2


def _tiny_option_runs(tmp_path, *options) -> dict:
    """bench/offload.py on the tiny model at 50 %, prefetch none, with the given option flags: the runs by key."""
    out = tmp_path / "out"
    argv = ["--shapes", "tiny", "--backend", "cpu", "--fractions", "0.5", "--prefetch-modes", "none"]
    assert offload.main([*argv, "--out", str(out), "--workdir", str(tmp_path / "work"), *options]) == 0
    return json.loads((out / "offload.json").read_text())["shapes"]["tiny"]["runs"]["0.5"]


def test_offload_runs_both_cached_gemv_settings_side_by_side(tmp_path, capsys):
    """--cached-gemv on,off: each cached run twice, keyed apart, printed together with their ratio."""
    runs = _tiny_option_runs(tmp_path, "--cached-gemv", "on,off")
    assert list(runs) == ["none", "none/no-cached-gemv"]
    assert runs["none"]["cached_gemv"] is True and runs["none/no-cached-gemv"]["cached_gemv"] is False
    assert "ms per step with cached_gemv on/off: b=1 " in capsys.readouterr().out


def test_offload_runs_the_engine_switch_prefetch_large_steps_side_by_side(tmp_path, capsys):
    """--prefetch-large-steps on,off (an EngineConfig setting, off by default): lookahead prefetches in b=16 steps
    only with it on; both runs keyed apart and printed together."""
    argv = ["--prefetch-modes", "lookahead", "--prefetch-large-steps", "on,off"]
    runs = _tiny_option_runs(tmp_path, *argv)
    assert list(runs) == ["lookahead", "lookahead/prefetch-large-steps"]
    on, off = runs["lookahead/prefetch-large-steps"], runs["lookahead"]
    assert on["prefetch_large_steps"] is True and off["prefetch_large_steps"] is False
    assert on["decode"]["16"]["prefetches_issued"] > 0 and off["decode"]["16"]["prefetches_issued"] == 0
    assert "ms per step with prefetch_large_steps on/off: b=1 " in capsys.readouterr().out


def test_offload_runs_every_option_combination_keyed_apart(tmp_path, capsys):
    """--cached-gemv on,off --pipelined-waves off,on: four runs, each keyed by the options it turned off, and
    both side-by-side lines printed."""
    runs = _tiny_option_runs(tmp_path, "--cached-gemv", "on,off", "--pipelined-waves", "off,on")
    keys = ["none", "none/no-pipelined-waves", "none/no-cached-gemv", "none/no-cached-gemv/no-pipelined-waves"]
    assert list(runs) == keys
    assert [(r["cached_gemv"], r["pipelined_waves"]) for r in runs.values()] == [
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    ]
    printed = capsys.readouterr().out
    assert "ms per step with cached_gemv on/off: b=1 " in printed
    assert "ms per step with pipelined_waves on/off: b=1 " in printed


def test_cached_mma_runs_are_keyed_apart(tmp_path, capsys):
    """--cached-mma on,off: the default (on) run keeps the mode's key, the other is MODE/no-cached-mma."""
    runs = _tiny_option_runs(tmp_path, "--cached-mma", "on,off")
    assert list(runs) == ["none", "none/no-cached-mma"]
    assert runs["none"]["cached_mma"] is True and runs["none/no-cached-mma"]["cached_mma"] is False
    assert "ms per step with cached_mma on/off: b=1 " in capsys.readouterr().out


def test_an_option_off_by_default_is_keyed_when_turned_on():
    """A field off by default is named bare when a run turns it on, and a field at its default not at all."""
    defaults = CudaOptions(cached_mma=False)
    assert option_key("plan", {"cached_mma": True, "cached_gemv": True}, defaults) == "plan/cached-mma"
    assert option_key("plan", {"cached_mma": False, "cached_gemv": False}, defaults) == "plan/no-cached-gemv"


def test_offload_refuses_an_unknown_cached_gemv_setting(capsys):
    with pytest.raises(SystemExit) as exit_:
        offload.main(["--shapes", "tiny", "--backend", "cpu", "--cached-gemv", "on,maybe"])
    assert exit_.value.code == 2
    assert "--cached-gemv: ['maybe'] not in on, off" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        offload.main(["--shapes", "tiny", "--backend", "cpu", "--pipelined-waves", "yes"])
    assert "--pipelined-waves: ['yes'] not in on, off" in capsys.readouterr().err


def test_sampled_phase_samples_with_fixed_seeds(tmp_path):
    """temperature > 0: a second decode phase on new prompts whose sequences sample at that temperature, seeded
    by their request ids; the greedy phase and the prefill stay greedy; both phases count the cache alike."""
    from bench.offload_model import TokenSource
    from common.model_format import ModelDir
    from expert_service.tools.tiny_model import make_tiny

    model = ModelDir.open(make_tiny(tmp_path / "tiny", family="mixtral", seed=1), verify=False)
    engine = offload.make_engine(model, "cpu", 2, "none")
    sent, step = [], engine.step
    engine.step = lambda prefill, decode, plan=None: (sent.extend(prefill), step(prefill, decode, plan))[1]
    tokens = TokenSource(model.config.vocab_size)
    out = offload.bench_colibri(engine, None, 55e9, tokens, decode_steps=2, temperature=0.7)
    assert out["sampled_temperature"] == 0.7
    for phase in ("decode", "decode_sampled"):
        assert list(out[phase]) == ["1", "16"]
        for d in out[phase].values():
            assert d["steps"] == 2 and d["tok_s"] > 0 and d["hits"] + d["misses"] > 0
    prefill, greedy, sampled = sent[: offload_measure.PREFILL_REPEATS + 1], sent[4:21], sent[21:]
    assert [len(c.token_ids) for c in prefill] == [offload_hf.PREFILL_TOKENS] * 4
    assert len(greedy) == len(sampled) == 17  # b=1 then b=16 prompts of DECODE_CONTEXT tokens
    assert all(c.sampling.temperature == 0 for c in prefill + greedy)
    assert all(c.sampling.temperature == 0.7 and c.sampling.seed == c.request_id for c in sampled)
    assert not any(np.array_equal(g.token_ids, s.token_ids) for g, s in zip(greedy, sampled))  # new prompts

    greedy_only = offload.bench_colibri(engine, None, 55e9, tokens, decode_steps=2)
    assert "decode_sampled" not in greedy_only and "sampled_temperature" not in greedy_only


def test_sampled_runs_reported_with_their_ratios(tmp_path, capsys):
    """The default runs sampled continuations beside greedy ones: ratios per phase, printed, in the markdown."""
    from bench.offload_report import offload_markdown

    out = tmp_path / "out"
    argv = ["--shapes", "tiny", "--backend", "cpu", "--fractions", "1,0.5", "--prefetch-modes", "none"]
    assert offload.main([*argv, "--decode-steps", "2", "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    results = json.loads((out / "offload.json").read_text())
    entry = results["shapes"]["tiny"]
    run = entry["runs"]["0.5"]["none"]
    assert run["sampled_temperature"] == offload_args.SAMPLED_TEMPERATURE
    ratios = entry["ratios"]["0.5"]["none"]
    base = entry["resident"]["decode_sampled"]["16"]
    assert ratios["decode_sampled_b16_x_resident"] == run["decode_sampled"]["16"]["tok_s"] / base["tok_s"]
    assert ratios["decode_sampled_b1_x_pcie_bound"] == run["decode_sampled"]["1"]["x_pcie_bound"]
    assert "decode_sampled_b1_x_target_bound" in ratios and "decode_b1_x_target_bound" in ratios
    printed = capsys.readouterr().out
    assert "   0.5 none            sampled b=1 " in printed and "continuations sampled at temperature 0.8" in printed
    assert "Continuations sampled at temperature 0.8" in offload_markdown(results)
    assert results["fetch_kernel"] is None and "fetch kernel" not in printed  # no GPU: nothing measured
    results["fetch_kernel"] = {"bytes_per_s": 33e9, "copy_engine_bytes_per_s": 55e9, "x_copy_engine": 0.6}
    assert "(nominal), the fetch kernel 33.0 GB/s (0.60x);" in offload_markdown(results)


def test_the_fetch_kernels_rate_beside_the_copy_engines(tmp_path, monkeypatch, capsys):
    """With a GPU the run records what the fetch kernel (a cached step's miss copies) reaches on the host against
    the copy engine the PCIe bound is taken from, and prints it."""
    fetch = {"bytes_per_s": 33e9, "copy_engine_bytes_per_s": 55e9, "x_copy_engine": 0.6}
    monkeypatch.setattr(offload, "measure_pcie", lambda: 54.5e9)
    monkeypatch.setattr(offload, "measure_fetch_kernel", lambda: fetch)
    out = tmp_path / "out"
    argv = ["--shapes", "tiny", "--backend", "cuda", "--fractions", "1", "--prefetch-modes", "none", "--skip-hf"]
    monkeypatch.setattr(offload, "bench_shape", lambda *a, **kw: {"runs": {}})
    monkeypatch.setattr(offload, "add_ratios", lambda entry: None)
    monkeypatch.setattr(offload, "print_offload", lambda name, entry: None)
    monkeypatch.setattr(offload, "plot_offload", lambda results, path: None)
    assert offload.main([*argv, "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    results = json.loads((out / "offload.json").read_text())
    assert results["fetch_kernel"] == fetch and results["pcie_bytes_per_s"] == 54.5e9
    printed = capsys.readouterr().out
    assert "copy engine 54.5 GB/s" in printed and "copies a cached step's misses 33.0 GB/s (0.60x" in printed


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_temperature_must_be_finite_and_not_negative(tmp_path, value, capsys):
    argv = ["--shapes", "tiny", "--backend", "cpu", "--out", str(tmp_path), "--temperature", value]
    with pytest.raises(SystemExit):
        offload.main(argv)
    assert f"--temperature: a finite number >= 0, got {float(value)}" in capsys.readouterr().err


def test_a_run_cut_off_leaves_the_runs_before_it_in_the_json(model_with_table, tmp_path, monkeypatch):
    """The JSON is rewritten after every run (marked partial), so a call stopped by its time limit keeps what
    finished: here the second cached run raises, and the file holds the resident run and the first cached one."""
    model, table_path, prompts = model_with_table
    bench_colibri, calls = offload.bench_colibri, []

    def stopped_on_the_third(*args, **kwargs):  # resident, none, then plan: "killed"
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return bench_colibri(*args, **kwargs)

    monkeypatch.setattr(offload, "bench_colibri", stopped_on_the_third)
    argv = ["--model", str(model.path), "--prompts", str(prompts), "--table", str(table_path), "--skip-hf"]
    argv += ["--backend", "cpu", "--fractions", "0.5", "--prefetch-modes", "none,plan", "--decode-steps", "2"]
    argv += ["--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")]
    with pytest.raises(KeyboardInterrupt):
        offload.main(argv)
    shape = json.loads((tmp_path / "out" / "offload.json").read_text())["shapes"][model.path.name]
    assert shape["partial"] is True and "decode" in shape["resident"]
    assert list(shape["runs"]["0.5"]) == ["none"] and "decode" in shape["runs"]["0.5"]["none"]
