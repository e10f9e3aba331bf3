"""`colibri convert --attention-dtype`: the attention projections quantized per row with the head's and experts'
quantize function in every family (biases and q/k norms kept dense), beside 8-bit experts and head, from fine-grained
fp8 checkpoints, and bad values, sizes and weights refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from common import quant
from common.errors import ModelFormatError
from common.model_format import ModelDir
from expert_service.tools.convert import convert
from tests.expert_service.tools.fp8_checkpoint import write_fp8_checkpoint
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint
from tests.expert_service.tools.test_convert_head import run_cli

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def hf_name(layer: int, projection: str) -> str:
    return f"model.layers.{layer}.self_attn.{projection}.weight"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("flag, dtype", [("int8", "int8"), ("fp8", "float8_e4m3fn")])
def test_the_projections_are_quantized_per_row_and_nothing_else_changes(tmp_path, capsys, family, flag, dtype):
    weights = write_head_checkpoint(tmp_path / "hf", head_config(family), seed=8)
    argv = ["convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", "--dtype", "bf16"]
    rc, out, err = run_cli(capsys, *argv, "--attention-dtype", flag)
    assert rc == 0, err
    assert out.rstrip().endswith(f"experts bfloat16, attention {dtype}")
    model = ModelDir.open(tmp_path / "m")
    assert model.attention_format is not None and model.attention_format.dtype == dtype
    for i in range(model.config.num_hidden_layers):
        for p in PROJECTIONS:
            q, scale = quant.quantize(weights[hf_name(i, p)], dtype, quant.CHANNEL, hf_name(i, p))
            assert np.array_equal(model.tensor(f"layers.{i}.{p}"), q)
            assert np.array_equal(model.tensor(f"layers.{i}.{p}_scale"), scale)
    plain = ModelDir.open(convert(tmp_path / "hf", tmp_path / "plain", "bfloat16", False))
    kept = [n for n in plain.entries if not n.endswith(PROJECTIONS)]
    assert any(n.endswith(("q_bias", "q_norm")) for n in kept) is (family != "mixtral")  # the family's extras
    for name in kept:  # biases, q/k norms and everything else exactly as without the flag
        assert model.entries[name].dtype == "bfloat16"
        assert np.array_equal(model.tensor(name), plain.tensor(name)), name


def test_8bit_experts_head_and_projections_together(tmp_path):
    write_head_checkpoint(tmp_path / "hf", head_config("qwen3_moe", True), seed=6)
    model = ModelDir.open(
        convert(
            tmp_path / "hf", tmp_path / "m", "bfloat16", False, expert_dtype="fp8", head_dtype="int8",
            attention_dtype="fp8",
        )
    )  # fmt: skip
    assert model.expert_formats == ("float8_e4m3fn/block128",) and model.head_format.dtype == "int8"
    assert model.attention_format.dtype == "float8_e4m3fn" and model.attention_format.scheme == "channel"


def test_the_dense_dtype_as_attention_dtype_changes_nothing(tmp_path):
    write_head_checkpoint(tmp_path / "hf", head_config("olmoe"), seed=2)
    plain = convert(tmp_path / "hf", tmp_path / "plain", "bfloat16", False)
    named = convert(tmp_path / "hf", tmp_path / "named", "bfloat16", False, attention_dtype="BF16")
    assert ModelDir.open(named).attention_format is None
    for name in ("colibri.json", "dense.bin", "experts-L000.bin"):
        assert (plain / name).read_bytes() == (named / name).read_bytes(), name


ODD = dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    "overrides, flags, message",
    [
        ({}, ["--attention-dtype", "int4"], "--attention-dtype: 'int4' is not supported (supported: int8, "
         "float8_e4m3fn (fp8), or the dense dtype: float32, float16, bfloat16 as --dtype)"),
        ({}, ["--attention-dtype", "float32", "--dtype", "bfloat16"], "--attention-dtype: 'float32' is not the dense "
         "dtype bfloat16 (supported: int8, float8_e4m3fn (fp8), or bfloat16)"),
        (ODD, ["--attention-dtype", "int8"], "--attention-dtype int8: 8-bit attention projections need hidden_size a "
         "multiple of 64 and the q and kv projection sizes multiples of 16; this model has hidden_size 40, q 40, kv 20 "
         "(leave the flag out to keep them dense)"),
        ({**ODD, "hidden_size": 64, "head_dim": 12}, ["--attention-dtype", "fp8"], "--attention-dtype fp8: 8-bit "
         "attention projections need hidden_size a multiple of 64 and the q and kv projection sizes multiples of 16; "
         "this model has hidden_size 64, q 48, kv 24 (leave the flag out to keep them dense)"),
    ],
)  # fmt: skip
def test_a_bad_attention_dtype_or_model_is_one_line_and_writes_nothing(tmp_path, capsys, overrides, flags, message):
    family = "qwen3_moe" if "head_dim" in overrides else "mixtral"
    write_head_checkpoint(tmp_path / "hf", head_config(family, **overrides))
    rc, _, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", *flags)
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.rstrip() == f"colibri convert: error: {message}", err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    "value, dtype, message",
    [
        (np.nan, "int8", "non-finite weights cannot be quantized to int8"),
        (np.float32(3.4e38), "int8", "weights up to 3.4e+38 are too large to quantize to int8 (their scale times a "
         "code would overflow float32)"),
        (-np.inf, "fp8", "non-finite weights cannot be quantized to float8_e4m3fn"),
    ],
)  # fmt: skip
def test_projection_weights_that_cannot_be_quantized_are_named(tmp_path, capsys, value, dtype, message):
    weights = write_head_checkpoint(tmp_path / "hf", head_config("mixtral"))
    name = hf_name(1, "v_proj")
    weights[name][5, 2] = value
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    argv = ["convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", "--attention-dtype", dtype]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1, err
    assert err.rstrip() == f"colibri convert: error: tensor {name}: {message}", err
    assert not (tmp_path / "m" / "colibri.json").exists()


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_an_fp8_checkpoints_projections_are_dequantised_then_requantised_per_row(tmp_path, dtype):
    quantized = write_fp8_checkpoint(tmp_path / "hf", head_config("qwen3_moe"), seed=3)
    model = ModelDir.open(convert(tmp_path / "hf", tmp_path / "m", progress=False, attention_dtype=dtype))
    assert model.dtype == "bfloat16" and model.expert_formats == ("float8_e4m3fn/block128",)
    for i in range(model.config.num_hidden_layers):
        for p in PROJECTIONS:
            exact = quant.dequantize(*quantized[hf_name(i, p)], "float8_e4m3fn", quant.BLOCK128)
            q, scale = quant.quantize(exact, dtype, quant.CHANNEL, hf_name(i, p))
            assert np.array_equal(model.tensor(f"layers.{i}.{p}"), q)
            assert np.array_equal(model.tensor(f"layers.{i}.{p}_scale"), scale)
    expert = "model.layers.0.mlp.experts.1.down_proj.weight"
    assert np.array_equal(model.tensor("layers.0.experts.1.down_proj"), quantized[expert][0])  # bytes kept
