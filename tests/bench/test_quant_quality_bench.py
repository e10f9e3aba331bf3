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


def test_each_8bit_addition_is_compared_with_what_it_adds_to():
    assert quant_quality.baseline_of("int8+int8-head+int8-attn") == ("vs_dense_attention", "int8+int8-head")
    assert quant_quality.baseline_of("fp8-block128+fp8-head+fp8-attn") == (
        "vs_dense_attention",
        "fp8-block128+fp8-head",
    )
    assert quant_quality.baseline_of("bfloat16+int8-attn") == ("vs_dense_attention", "bfloat16")
    assert quant_quality.baseline_of("int8+int8-head") == ("vs_experts_only", "int8")
    assert quant_quality.baseline_of("int8") is None


@pytest.mark.slow
def test_8bit_attention_variants_report_their_bytes_and_their_own_error(tmp_path, monkeypatch):
    out = tmp_path / "quality.json"
    argv = ["--variants", "bfloat16,int8+int8-head,int8+int8-head+int8-attn", "--max-windows", "1", "--window", "64"]
    argv += ["--prompts", "1", "--new-tokens", "2", "--backend", "cpu", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["quant_quality.py", *argv])
    assert quant_quality.main() == 0
    results = json.loads(out.read_text())["results"]
    attn, head = results["int8+int8-head+int8-attn"], results["int8+int8-head"]
    assert attn["attention_dtype"] == "int8" and head["attention_dtype"] == "bfloat16"
    assert head["attention_bytes_ratio"] == 1 and 0.45 < attn["attention_bytes_ratio"] < 0.55
    own = attn["vs_dense_attention"]
    assert own["variant"] == "int8+int8-head" and 0 < own["logits_rel_error_max"] < 0.5
    assert 0.5 < own["top1_agreement"] <= 1 and "vs_dense_attention" not in head
