"""`colibri convert --head-dtype`: the LM head quantized per row with experts' quantize function, tied checkpoints
quantized from their embedding, fine-grained fp8 checkpoints, bad values and weights refused in one line, and the
memory bound."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from safetensors.torch import load_file

from colibri.cli import main
from common import quant
from common.errors import ModelFormatError
from common.model_format import ModelDir
from expert_service.tools.convert import convert
from tests.expert_service.tools.fp8_checkpoint import write_fp8_checkpoint
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def head_source(weights: dict[str, np.ndarray], tied: bool) -> np.ndarray:
    return weights["model.embed_tokens.weight" if tied else "lm_head.weight"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("flag, head_dtype", [("int8", "int8"), ("fp8", "float8_e4m3fn"), ("float8_e4m3fn", None)])
def test_the_head_is_quantized_per_row_as_experts_are(tmp_path, capsys, family, tied, flag, head_dtype):
    head_dtype = head_dtype or flag
    weights = write_head_checkpoint(tmp_path / "hf", head_config(family, tied), seed=4)
    argv = ["convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", "--head-dtype", flag]
    rc, out, err = run_cli(capsys, *argv, "--dtype", "bfloat16")
    assert rc == 0, err
    assert out.rstrip().endswith(f"experts bfloat16, head {head_dtype}")
    model = ModelDir.open(tmp_path / "m")
    assert model.head_format is not None and model.head_format.dtype == head_dtype
    q, scale = quant.quantize(head_source(weights, tied), head_dtype, quant.CHANNEL, "lm_head")
    assert np.array_equal(model.tensor("lm_head"), q) and np.array_equal(model.tensor("lm_head_scale"), scale)
    # every other tensor exactly as without the flag; a tied embedding stays in the dense dtype
    plain = ModelDir.open(convert(tmp_path / "hf", tmp_path / "plain", "bfloat16", False))
    for name, entry in plain.entries.items():
        if name != "lm_head":
            assert model.entries[name].dtype == entry.dtype == "bfloat16"
            assert np.array_equal(model.tensor(name), plain.tensor(name)), name


def test_the_dense_dtype_as_head_dtype_changes_nothing(tmp_path):
    write_head_checkpoint(tmp_path / "hf", head_config("olmoe"), seed=2)
    plain = convert(tmp_path / "hf", tmp_path / "plain", "bfloat16", False)
    named = convert(tmp_path / "hf", tmp_path / "named", "bfloat16", False, head_dtype="bf16")
    assert ModelDir.open(named).head_format is None
    for name in ("colibri.json", "dense.bin", "experts-L000.bin"):
        assert (plain / name).read_bytes() == (named / name).read_bytes(), name


def test_8bit_experts_and_head_together(tmp_path):
    write_head_checkpoint(tmp_path / "hf", head_config("mixtral", True), seed=6)
    model = ModelDir.open(
        convert(tmp_path / "hf", tmp_path / "m", "bfloat16", False, expert_dtype="fp8", head_dtype="fp8")
    )
    assert model.expert_formats == ("float8_e4m3fn/block128",) and model.head_format.dtype == "float8_e4m3fn"
    assert model.head_format.scheme == "channel"  # per row, whatever the experts' scale scheme


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--head-dtype", "int4"], "--head-dtype: 'int4' is not supported (supported: int8, float8_e4m3fn (fp8), or "
         "the dense dtype: float32, float16, bfloat16 as --dtype)"),
        (["--head-dtype", ""], "--head-dtype: '' is not supported (supported: int8, float8_e4m3fn (fp8), or the "
         "dense dtype: float32, float16, bfloat16 as --dtype)"),
        (["--head-dtype", "float32", "--dtype", "bfloat16"], "--head-dtype: 'float32' is not the dense dtype bfloat16 "
         "(supported: int8, float8_e4m3fn (fp8), or bfloat16)"),
        (["--head-dtype", "fp16"], "--head-dtype: 'fp16' is not the dense dtype float32 (supported: int8, "
         "float8_e4m3fn (fp8), or float32)"),
    ],
)  # fmt: skip
def test_a_bad_head_dtype_is_one_line_and_writes_nothing(tmp_path, capsys, flags, message):
    write_head_checkpoint(tmp_path / "hf", head_config("mixtral"))
    rc, _, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", *flags)
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.rstrip() == f"colibri convert: error: {message}", err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "value, head_dtype, message",
    [
        (np.nan, "int8", "non-finite weights cannot be quantized to int8"),
        (np.inf, "fp8", "non-finite weights cannot be quantized to float8_e4m3fn"),
        (np.float32(3.4e38), "int8", "weights up to 3.4e+38 are too large to quantize to int8 (their scale times a "
         "code would overflow float32)"),
    ],
)  # fmt: skip
def test_head_weights_that_cannot_be_quantized_are_named(tmp_path, capsys, tied, value, head_dtype, message):
    weights = write_head_checkpoint(tmp_path / "hf", head_config("mixtral", tied))
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    weights[name][7, 3] = value
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    argv = ["convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", "--head-dtype", head_dtype]
    rc, _, err = run_cli(capsys, *argv)  # float32 kept: the dense copy takes any float32, the head cannot
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1, err
    assert err.rstrip() == f"colibri convert: error: tensor {name}: {message}", err
    assert not (tmp_path / "m" / "colibri.json").exists()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_fp8_checkpoint_takes_an_8bit_head(tmp_path, tied):
    """Published fp8 checkpoints leave lm_head unquantized (modules_to_not_convert): it is quantized like any."""
    hf_config = head_config("qwen3_moe", tied)
    quantized = write_fp8_checkpoint(tmp_path / "hf", hf_config, seed=1)
    source = load_file(tmp_path / "hf" / "model.safetensors")
    head = source["model.embed_tokens.weight" if tied else "lm_head.weight"].float().numpy()  # bf16, widened
    model = ModelDir.open(convert(tmp_path / "hf", tmp_path / "m", progress=False, head_dtype="int8"))
    assert model.dtype == "bfloat16" and model.expert_formats == ("float8_e4m3fn/block128",)
    q, scale = quant.quantize(head, "int8", quant.CHANNEL, "lm_head")
    assert np.array_equal(model.tensor("lm_head"), q) and np.array_equal(model.tensor("lm_head_scale"), scale)
    expert = "model.layers.0.mlp.experts.1.down_proj.weight"
    assert np.array_equal(model.tensor("layers.0.experts.1.down_proj"), quantized[expert][0])  # bytes kept


@pytest.mark.parametrize("head_dtype", [None, "int8", "fp8"])
def test_an_fp8_checkpoint_whose_lm_head_is_fp8_too(tmp_path, monkeypatch, head_dtype):
    """A checkpoint that quantized lm_head with the rest (not in modules_to_not_convert): its block scale is the
    last tensor read, and no view of it may outlive the shards' maps (a BufferError traceback on close)."""
    import tests.expert_service.tools.fp8_checkpoint as fp8_checkpoint

    every = fp8_checkpoint.unquantized_modules
    monkeypatch.setattr(fp8_checkpoint, "unquantized_modules", lambda c: [m for m in every(c) if m != "lm_head"])
    quantized = write_fp8_checkpoint(tmp_path / "hf", head_config("qwen3_moe"), seed=1)
    model = ModelDir.open(convert(tmp_path / "hf", tmp_path / "m", progress=False, head_dtype=head_dtype))
    head = quant.dequantize(*quantized["lm_head.weight"], "float8_e4m3fn", quant.BLOCK128)
    if head_dtype is None:
        assert model.head_format is None and model.entries["lm_head"].dtype == "bfloat16"
        assert np.allclose(model.tensor_f32("lm_head"), head, rtol=2**-8, atol=0)
    else:
        q, scale = quant.quantize(head, model.head_format.dtype, quant.CHANNEL, "lm_head")
        assert np.array_equal(model.tensor("lm_head"), q) and np.array_equal(model.tensor("lm_head_scale"), scale)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("head_dtype", ["int8", "fp8"])
def test_quantizing_the_head_holds_a_few_bytes_per_element_of_it(tmp_path, tied, head_dtype):
    """The head (and the embedding) are the largest tensors: 2048 x 520 floats. Tied, the embedding is written
    dense first and then quantized: one at a time, so the peak is one tensor's, not two."""
    hf_config = head_config(
        "mixtral", tied, vocab_size=2048, hidden_size=520, intermediate_size=64, num_attention_heads=4
    )
    weights = write_head_checkpoint(tmp_path / "hf", hf_config)
    largest = max(w.size for w in weights.values())
    assert largest == 2048 * 520
    tracemalloc.start()
    try:
        convert(tmp_path / "hf", tmp_path / "m", progress=False, head_dtype=head_dtype)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_element = peak / largest
    print(f"{head_dtype} tied={tied}: peak {peak:,} bytes = {per_element:.1f} bytes per element of the head")
    assert per_element <= 10


def test_convert_records_the_tied_model_as_tied(tmp_path):
    write_head_checkpoint(tmp_path / "hf", head_config("olmoe", True), seed=1)
    out = convert(tmp_path / "hf", tmp_path / "m", "bfloat16", False, head_dtype="int8")
    manifest = json.loads((Path(out) / "colibri.json").read_text())
    assert manifest["config"]["tie_word_embeddings"] is True and manifest["format_version"] == 2
    assert list(manifest["tensors"])[-2:] == ["lm_head", "lm_head_scale"]  # the head ends dense.bin


def test_dtype_takes_the_aliases_the_other_dtype_flags_take(tmp_path, capsys):
    """--dtype bf16 converts as --dtype bfloat16 (as --expert-dtype and --head-dtype read bf16); an unknown one is
    argparse's usage error naming --dtype and what it takes."""
    write_head_checkpoint(tmp_path / "hf", head_config("mixtral"))
    rc, _, err = run_cli(
        capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", "--dtype", "BF16"
    )
    assert rc == 0, err
    assert ModelDir.open(tmp_path / "m").dtype == "bfloat16"
    with pytest.raises(SystemExit) as exit_:
        run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "n"), "--no-progress", "--dtype", "i8")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and not (tmp_path / "n").exists() and "Traceback" not in err
    assert err.splitlines()[-1] == (
        "colibri convert: error: argument --dtype: dtype 'i8' is not supported (supported: float32, float16, bfloat16)"
    ), err


EMBED = "model.embed_tokens.weight"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("head_scale", ["other", "stray", "same"])
def test_a_tied_checkpoints_lm_head_copy_counts_only_with_the_embeddings_scale(tmp_path, capsys, seed, head_scale):
    """A tied checkpoint may hold lm_head.weight as a copy of the embedding; the copy was taken for one on its bytes
    alone, so an fp8 head with its own block scale (another matrix: q x another scale), or a scale beside a bf16
    copy, was dropped without a word."""
    import torch
    from safetensors.torch import save_file as save_torch

    rng = np.random.default_rng(seed)
    write_fp8_checkpoint(tmp_path / "hf", head_config("qwen3_moe", tied=True), seed=seed)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    if head_scale == "stray":  # a bf16 copy of the embedding, and a scale no weight takes
        tensors["lm_head.weight"] = tensors[EMBED].clone()
        tensors["lm_head.weight_scale_inv"] = torch.ones(3, 1)
    else:  # embedding and head stored fp8 with the same bytes
        q, scale = quant.quantize(tensors[EMBED].float().numpy(), "float8_e4m3fn", quant.BLOCK128, EMBED)
        tensors[EMBED] = torch.from_numpy(q).view(torch.float8_e4m3fn)
        tensors[EMBED + "_scale_inv"] = torch.from_numpy(scale)
        tensors["lm_head.weight"] = tensors[EMBED].clone()
        other = scale * np.float32(rng.uniform(1.5, 4.0)) if head_scale == "other" else scale.copy()
        tensors["lm_head.weight_scale_inv"] = torch.from_numpy(other)
    save_torch(tensors, str(tmp_path / "hf" / "model.safetensors"))
    rc, out, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress")
    if head_scale == "same":
        assert rc == 0, err
        return
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert "checkpoint tensor lm_head.weight is not part of the qwen3_moe model config.json describes" in err
    assert not (tmp_path / "m").exists()
