"""bench/quant_quality.py end to end on the cpu backend: the shipped default model converted with bf16, int8 and
fp8 experts (W8A8 emulated for the -w8a8 variant), one held-out window and one greedy prompt."""

from __future__ import annotations

import json
import sys

import pytest

from bench import quant_quality


@pytest.mark.slow
def test_quant_quality_compares_each_variant_with_bf16(tmp_path, monkeypatch):
    out = tmp_path / "quality.json"
    argv = ["--variants", "int8,bfloat16,fp8-block128,int8-w8a8", "--max-windows", "1", "--window", "64"]
    argv += ["--prompts", "1", "--new-tokens", "2", "--backend", "cpu", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["quant_quality.py", *argv])
    assert quant_quality.main() == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["bfloat16", "int8", "fp8-block128", "int8-w8a8"]  # bf16 first: the reference
    assert report["windows"] == 1 and report["tokens"] == 63
    bf16 = results["bfloat16"]
    assert bf16["perplexity_change_pct"] == 0 and bf16["top1_agreement"] == 1 and bf16["logits_rel_error_max"] == 0
    for name in ("int8", "fp8-block128", "int8-w8a8"):
        r = results[name]
        assert 0.45 < r["expert_bytes_ratio"] < 0.55  # 8-bit experts and their scales: about half of bf16
        assert 0 < r["logits_rel_error_max"] < 0.5 and 0.5 < r["top1_agreement"] <= 1
    assert results["int8-w8a8"]["activations_8bit"] and not results["int8"]["activations_8bit"]
    # W8A8's emulation rounds activations too: not the same logits as the exact int8 run
    assert results["int8-w8a8"]["logits_rel_error_max"] != results["int8"]["logits_rel_error_max"]
