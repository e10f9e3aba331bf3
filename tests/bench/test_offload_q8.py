"""bench/offload_q8.py end to end on the tiny model with the cpu backend: the 8-bit model gets the slots of the
dense model's bytes, both runs are measured and compared."""

from __future__ import annotations

import json

from bench import offload_q8


def test_offload_q8_tiny_cpu(tmp_path):
    out = tmp_path / "out"
    argv = ["--shape", "tiny", "--backend", "cpu", "--fraction", "0.25", "--decode-steps", "2"]
    assert offload_q8.main([*argv, "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    result = json.loads((out / "offload-q8-tiny-int8.json").read_text())
    dense, q8 = result["runs"]["bfloat16"], result["runs"]["int8"]
    assert dense["expert_formats"] == ["bfloat16"] and q8["expert_formats"] == ["int8"]
    # a quarter of the bf16 bytes: one bf16 slot of four, two int8 ones (an int8 block is half a bf16 one + scales)
    assert (dense["slots_per_layer"], q8["slots_per_layer"]) == (1, 2)
    assert 1 < result["ratios"]["slot_bytes_x_bf16"] < 1.1
    for run in (dense, q8):
        for b in ("1", "16"):
            assert run["decode"][b]["tok_s"] > 0 and run["decode"][b]["misses"] > 0
    assert set(result["ratios"]) == {"slot_bytes_x_bf16", "prefill_x_bf16", "decode_b1_x_bf16", "decode_b16_x_bf16"}
    assert result["ratios"]["decode_b1_x_bf16"] == q8["decode"]["1"]["tok_s"] / dense["decode"]["1"]["tok_s"]
    assert not (tmp_path / "work").exists()
