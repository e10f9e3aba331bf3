"""bench/q8mma_kernels.py end to end in the simulator: the tiny shape, both 8-bit encodings, the current module
against itself as `--previous` (same launches on the same buffers: outputs equal)."""

from __future__ import annotations

import json

from bench import q8mma_kernels
from expert_service.kernels import moe_gemm_q8mma


def test_tiny_run_writes_every_case_and_compares_the_previous_version(tmp_path, capsys):
    out = tmp_path / "q8mma.json"
    argv = ["--out", str(out), "--shapes", "tiny", "--tokens", "3", "--iters", "1"]
    assert q8mma_kernels.main([*argv, "--previous", moe_gemm_q8mma.__file__]) == 0
    result = json.loads(out.read_text())
    cases = result["cases"]
    assert [(c["dtype"], c["tokens"]) for c in cases] == [("int8", 3), ("fp8", 3)]
    for case in cases:
        assert case["max_rel_diff_y"] == 0.0
        for version in ("current", "previous"):
            assert case[version]["gate_up_us"] > 0 and case[version]["down_us"] > 0
            assert case[version]["gate_up_roofline"] > 0 and case[version]["tflop_s"] > 0
        assert case["previous_over_current"] > 0
    printed = capsys.readouterr().out
    assert printed.count("previous (y diff 0.0e+00)") == 2 and f"wrote {out}" in printed


def test_configs_take_named_and_new_shapes(tmp_path, capsys):
    """--configs: a named config and a new shape side by side (the simulator's tiny shape), and one-line errors."""
    import pytest

    out = tmp_path / "q8mma.json"
    argv = ["--out", str(out), "--shapes", "tiny", "--dtypes", "int8", "--tokens", "3", "--iters", "1"]
    assert q8mma_kernels.main([*argv, "--configs", "sim,alt=2/1/1/4/64/3"]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["config"] for c in cases] == ["sim", "alt"]
    assert [c["chosen"] for c in cases] == [True, False]
    for bad, message in (("m99", "unknown config 'm99'"), ("x=1/2/3", "is not NAME=WM/WN/MT/NT/BK/STAGES")):
        with pytest.raises(SystemExit, match=message):
            q8mma_kernels.main([*argv, "--configs", bad])
