"""bench/offload_hf.py's host-side parts (the reference itself needs a GPU, torch and accelerate)."""

from __future__ import annotations

from bench.offload_hf import bench_hf_budgets
from bench.offload_model import TokenSource


def test_a_reference_that_cannot_load_is_an_error_per_budget_not_a_lost_run(tmp_path):
    entry = {
        "runs": {"1.0": {"resident": {"slot_bytes": 10}}, "0.5": {"none": {"slot_bytes": 5}}},
        "non_expert_bytes": 7,
    }
    hf = bench_hf_budgets(entry, tmp_path / "no-checkpoint", TokenSource(vocab_size=50))
    assert list(hf) == ["1.0", "0.5"]
    assert all(h["budget_bytes"] is None and "no-checkpoint has no config.json" in h["error"] for h in hf.values())
