"""bench/offload_q8.py end to end on the tiny model with the cpu backend: the 8-bit model gets the slots of the
dense model's bytes, both runs are measured and compared."""

from __future__ import annotations

import json

import pytest

from bench import offload_q8
from tests.bench.conftest import text_file


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
        assert run["sampled_temperature"] == 0.8  # greedy and sampled continuations, one run
        for phase in ("decode", "decode_sampled"):
            for b in ("1", "16"):
                assert run[phase][b]["tok_s"] > 0 and run[phase][b]["misses"] > 0
    decode = {f"decode{s}_b{b}_x_bf16" for s in ("", "_sampled") for b in (1, 16)}
    assert set(result["ratios"]) == {"slot_bytes_x_bf16", "prefill_x_bf16", *decode}
    assert result["ratios"]["decode_b1_x_bf16"] == q8["decode"]["1"]["tok_s"] / dense["decode"]["1"]["tok_s"]
    sampled = q8["decode_sampled"]["16"]["tok_s"] / dense["decode_sampled"]["16"]["tok_s"]
    assert result["ratios"]["decode_sampled_b16_x_bf16"] == sampled
    assert not (tmp_path / "work").exists()


def _tiny_pair(tmp_path):
    from expert_service.tools.tiny_model import make_tiny

    return [make_tiny(tmp_path / d, family="mixtral", seed=1, expert_dtype=d) for d in ("bfloat16", "int8")]


def test_offload_q8_on_given_models_with_text_prompts(tmp_path):
    """--models BF16,INT8 --prompts TEXT: both runs take the same slices of the text; the directories stay."""
    dense_dir, q8_dir = _tiny_pair(tmp_path)
    prompts = text_file(tmp_path / "heldout.txt", 0, 8_000)
    out = tmp_path / "out"
    argv = ["--models", f"{dense_dir},{q8_dir}", "--prompts", str(prompts), "--backend", "cpu", "--decode-steps", "2"]
    assert offload_q8.main([*argv, "--out", str(out)]) == 0
    result = json.loads((out / f"offload-q8-{dense_dir.name}-int8.json").read_text())
    assert result["models"] == [str(dense_dir), str(q8_dir)]
    assert result["prompts"]["kind"] == "text slices" and result["prompts"]["file"] == str(prompts)
    assert (result["runs"]["bfloat16"]["slots_per_layer"], result["runs"]["int8"]["slots_per_layer"]) == (1, 2)
    assert "decode_sampled_b1_x_bf16" in result["ratios"]
    assert (dense_dir / "colibri.json").is_file() and (q8_dir / "colibri.json").is_file()


def test_offload_q8_refuses_models_that_are_not_a_bf16_and_an_8bit_pair(tmp_path, capsys):
    from expert_service.tools.tiny_model import make_tiny

    dense_dir, q8_dir = _tiny_pair(tmp_path)
    other = make_tiny(tmp_path / "olmoe", family="olmoe", seed=1, expert_dtype="int8")
    cases = [
        ([f"{dense_dir}"], "--models: two directories, BF16_DIR,Q8_DIR, got 1"),
        ([f"{q8_dir},{dense_dir}"], f"--models: {q8_dir} stores its experts as int8, expected bfloat16"),
        ([f"{dense_dir},{q8_dir}", "--expert-dtype", "fp8"], f"{q8_dir} stores its experts as int8, expected fp8"),
        ([f"{dense_dir},{tmp_path}"], f"--models: {tmp_path} is not a Colibri model directory"),
        ([f"{dense_dir},{other}"], f"--models: {dense_dir} and {other} differ in"),
    ]
    for models, message in cases:
        with pytest.raises(SystemExit):
            offload_q8.main(["--backend", "cpu", "--out", str(tmp_path / "out"), "--models", *models])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        offload_q8.main(["--backend", "cpu", "--prompts", "x.txt"])
    assert "--prompts needs --models" in capsys.readouterr().err
    from expert_service.tools.convert import convert

    bf16_dense = convert(q8_dir / "hf", tmp_path / "bf16-dense", "bfloat16", progress=False, expert_dtype="int8")
    with pytest.raises(SystemExit):
        offload_q8.main(["--backend", "cpu", "--out", str(tmp_path / "out"), "--models", f"{dense_dir},{bf16_dense}"])
    message = f"--models: {dense_dir} keeps its dense weights in float32, {bf16_dense} in bfloat16"
    assert message in capsys.readouterr().err
