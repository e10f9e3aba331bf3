"""bench/offload.py end to end on the tiny model with the cpu backend: the JSON's cache accounting is consistent."""

from __future__ import annotations

import importlib.util
import json

import pytest

from bench import offload
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
                if mode == "plan":
                    assert run["plan_source"] == plan_source and phase["prefetches_issued"] > 0
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
