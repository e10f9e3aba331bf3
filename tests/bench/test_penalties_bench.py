"""bench/penalties.py end to end on the tiny model with the cpu backend (the bench itself is for a GPU)."""

from __future__ import annotations

import json
import sys

from bench import penalties


def test_the_bench_runs_on_the_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setattr(penalties, "BATCHES", (1, 4))
    monkeypatch.setattr(penalties, "STEPS", 4)
    monkeypatch.setattr(penalties, "CONTEXT", 16)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "penalties.py",
            "--out",
            str(tmp_path / "out"),
            "--shape",
            "tiny",
            "--backend",
            "cpu",
            "--workdir",
            str(tmp_path / "work"),
        ],
    )
    assert penalties.main() == 0
    result = json.loads((tmp_path / "out" / "penalties-tiny-cpu.json").read_text())
    assert set(result["decode_ms"]) == {"plain", "half_penalised", "all_penalised", "logprobs_top5"}
    assert all(ms > 0 for scenario in result["decode_ms"].values() for ms in scenario.values())
    assert result["prefill_ms"]["tokens"] == 4 and result["memory_plan"]["penalties"] > 0
    assert not (tmp_path / "work").exists()
