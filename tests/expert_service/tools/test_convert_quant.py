"""`colibri convert` with 8-bit experts: each expert dtype, the per-layer/per-expert file, fine-grained fp8
Hugging Face checkpoints (bytes kept), refused quantization configs, and the memory bound."""

from __future__ import annotations

import json
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from colibri.cli import main
from common import dtypes, quant
from common.errors import ConfigError, ModelFormatError
from common.model_format import ModelDir
from common.models import config_from_hf, tensor_specs
from common.routing_table import write_routing_table
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import tiny_hf_config, tiny_weights, write_tiny_checkpoint
from tests.expert_service.tools.fp8_checkpoint import write_fp8_checkpoint


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def expert_names(model: ModelDir) -> list[str]:
    return [s.name for s in tensor_specs(model.config) if s.expert is not None]


@pytest.mark.parametrize(
    "flags, label",
    [
        (["--expert-dtype", "int8"], "int8"),
        (["--expert-dtype", "fp8"], "float8_e4m3fn/block128"),
        (["--expert-dtype", "float8_e4m3fn", "--fp8-scale", "channel"], "float8_e4m3fn/channel"),
        (["--expert-dtype", "bf16"], "bfloat16"),
        (["--expert-dtype", "float16", "--dtype", "float32"], "float16"),
    ],
)
def test_each_expert_dtype_through_the_cli(tmp_path, capsys, flags, label):
    hf = write_tiny_checkpoint(tmp_path / "hf", "olmoe", seed=3)
    rc, out, err = run_cli(capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress", *flags)
    assert rc == 0, err
    model = ModelDir.open(tmp_path / "m")
    assert model.expert_formats == (label,) and out.rstrip().endswith(f"experts {label}")
    assert model.dtype == "float32"  # dense tensors keep the checkpoint's dtype: only experts change
    source = tiny_weights(tiny_hf_config("olmoe"), seed=3)
    specs = {s.name: s.hf_name for s in tensor_specs(model.config)}
    for name, hf_name in specs.items():
        ours = model.tensor_f32(name)
        if name in expert_names(model):
            tolerance = {"int8": 1 / 254, "bfloat16": 1 / 256, "float16": 1 / 2048}.get(label, 1 / 16)
            assert np.all(np.abs(ours - source[hf_name]) <= tolerance * np.abs(source[hf_name]).max()), name
        else:
            assert np.array_equal(ours, source[hf_name]), name


def test_expert_dtype_file_mixes_dtypes_and_keeps_hot_experts_dense(tmp_path):
    hf_config = tiny_hf_config("mixtral")
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=1)
    config = config_from_hf(hf_config)
    table = np.zeros((2, config.vocab_size, 2), dtype=np.uint16)  # layer 0 predicts 3 most, then 1
    table[0, :, 0], table[0, :100, 1], table[0, 100:, 1] = 3, 1, 2
    table[1, :, 0], table[1, :, 1] = 0, 2
    earlier_conversion = "sha256:" + "5a" * 32  # keep_hot reads an earlier conversion's table: not this one's digest
    write_routing_table(tmp_path / "lut.bin", table, config.num_experts, earlier_conversion)
    (tmp_path / "plan.yaml").write_text(
        "default: fp8\nfp8_scale: channel\nlayers: {1: int8}\nexperts: {'0.0': bfloat16, '1.3': fp8}\n"
        "keep_hot: {routing_table: lut.bin, per_layer: 1}\n"
    )
    out = convert(hf, tmp_path / "m", "bfloat16", False, expert_dtype="int8", expert_dtype_file=tmp_path / "plan.yaml")
    model = ModelDir.open(out)
    got = {key: (layout.dtype, layout.scheme) for key, layout in model.expert_layouts.items()}
    fp8, int8, bf16 = ("float8_e4m3fn", "channel"), ("int8", "channel"), ("bfloat16", None)
    assert got == {
        (0, 0): bf16,
        (0, 1): fp8,
        (0, 2): fp8,
        (0, 3): bf16,
        (1, 0): bf16,
        (1, 1): int8,
        (1, 2): int8,
        (1, 3): fp8,
    }


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"default": "int4"}', r"plan\.json: default: expert dtype 'int4' is not supported \(supported: float32, "),
        ('{"layer": {}}', r"plan\.json: unknown key 'layer' \(keys: default, fp8_scale, layers, experts, keep_hot\)$"),
        # the file plans experts only: a head key is pointed at the flag
        (
            '{"lm_head": "int8"}',
            r"plan\.json: unknown key 'lm_head' \(keys: default, fp8_scale, layers, experts, "
            r"keep_hot; the LM head's storage is --head-dtype\)$",
        ),
        ('{"layers": {"2": "int8"}}', r"plan\.json: layers: layer '2' is not in \[0, 2\)$"),
        ('{"experts": {"1.4": "int8"}}', r"plan\.json: experts\.1\.4: expert '4' is not in \[0, 4\)$"),
        ('{"experts": {"x": "int8"}}', r"plan\.json: experts\.x: layer 'x' is not in \[0, 2\)$"),
        ('{"fp8_scale": "tensor"}', r"plan\.json: fp8_scale: fp8 scale 'tensor' is not supported"),
        ('{"keep_hot": {"per_layer": 1}}', r"plan\.json: keep_hot takes routing_table \(required\) and per_layer"),
        (
            '{"keep_hot": {"routing_table": "none.bin"}}',
            r"plan\.json: keep_hot\.routing_table: \S*none\.bin: routing table not found",
        ),
        (
            '{"keep_hot": {"routing_table": "plan.json"}}',
            r"plan\.json: keep_hot\.routing_table: \S*plan\.json: magic is .* \(not a Colibri routing table\)$",
        ),
        ("[1, 2]", r"plan\.json: the file must be a mapping, got list$"),
        ("{", r"plan\.json: not valid JSON"),
    ],
)
def test_bad_expert_dtype_files_are_one_line(tmp_path, capsys, text, message):
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral")
    (tmp_path / "plan.json").write_text(text)
    rc, out, err = run_cli(
        capsys,
        "convert",
        str(hf),
        str(tmp_path / "m"),
        "--no-progress",
        "--expert-dtype-file",
        str(tmp_path / "plan.json"),
    )
    assert rc in (ConfigError.exit_code, ModelFormatError.exit_code) and err.count("\n") == 1, err
    assert err.startswith("colibri convert: error: ") and "Traceback" not in err
    assert re.search(message, err.rstrip()), err
    assert not (tmp_path / "m" / "colibri.json").exists()


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("plan.yaml", "experts: {1.10: bfloat16}", r"plan\.yaml: experts: key 1\.1 must be a quoted string 'layer\.expert'"),
        ("plan.yaml", "experts: {1: bfloat16}", r"plan\.yaml: experts: key 1 must be a quoted string 'layer\.expert'"),
        ("plan.json", '{"layers": {"0": "int8", "0": "fp8"}}', r"plan\.json: duplicate key '0'$"),
        ("plan.yaml", "layers: {0: int8, 0: fp8}", r"plan\.yaml: duplicate key 0 \(line 1, column 19\)$"),
        ("plan.yaml", "layers: {0: int8, '0': fp8}", r"plan\.yaml: layers: layer 0 is named twice$"),
        ("plan.json", '{"experts": {"1.2": "int8", "1.02": "fp8"}}', r"plan\.json: experts: expert 2 of layer 1 is named twice$"),
        ("plan.json", '{"layers": {"\u00b2": "int8"}}', r"plan\.json: layers: layer '\u00b2' is not in \[0, 2\)$"),
        ("plan.json", '{"experts": {"1.\u0661": "int8"}}', r"plan\.json: experts\.1\.\u0661: expert '\u0661' is not in \[0, 4\)$"),
    ],
)  # fmt: skip
def test_ambiguous_expert_dtype_files_are_refused_not_guessed(tmp_path, capsys, name, text, message):
    """A YAML float key 1.10 is the number 1.1, so it would pick expert 1; a key named twice (or twice
    after normalising, 0 and '0', 2 and 02) would silently lose all but one choice; only ASCII digits count."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral")
    (tmp_path / name).write_text(text)
    rc, out, err = run_cli(
        capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress", "--expert-dtype-file", str(tmp_path / name)
    )
    assert rc == ConfigError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("colibri convert: error: ") and re.search(message, err.rstrip()), err
    assert not (tmp_path / "m" / "colibri.json").exists()


@pytest.mark.parametrize("value", ["int4", ""])  # "": `--expert-dtype "$DTYPE"` with DTYPE unset, once ignored
def test_unknown_expert_dtype_flag_is_one_line(tmp_path, capsys, value):
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral")
    rc, _, err = run_cli(capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress", "--expert-dtype", value)
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1
    assert f"--expert-dtype: expert dtype {value!r} is not supported (supported: float32, float16, bfloat16" in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    "value, message",
    [
        ("", "--expert-dtype-file: empty; name a JSON or YAML file"),  # `--expert-dtype-file "$PLAN"`, PLAN unset
        ("plans", "--expert-dtype-file: plans is not a file"),
    ],
)
def test_an_empty_or_directory_expert_dtype_file_is_named(tmp_path, capsys, monkeypatch, value, message):
    """An empty value was read as the directory ".", reported as `.: expert dtype file not found`."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral")
    (tmp_path / "plans").mkdir()
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(capsys, "convert", str(hf), "m", "--no-progress", "--expert-dtype-file", value)
    assert rc == ConfigError.exit_code and err == f"colibri convert: error: {message}\n", err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize(  # Qwen3's FP8 releases store bfloat16 (some float16) scales: widened exactly
    "scale_suffix, scale_dtype",
    [("_scale_inv", "float32"), ("_scale", "float32"), ("_scale_inv", "bfloat16"), ("_scale_inv", "float16")],
)
def test_fp8_checkpoint_keeps_expert_bytes_and_dequantises_dense_layers(tmp_path, family, scale_suffix, scale_dtype):
    hf_config = {**tiny_hf_config(family), "hidden_size": 160, "head_dim": 40}  # two 128-blocks along D
    quantized = write_fp8_checkpoint(tmp_path / "hf", hf_config, scale_suffix=scale_suffix, scale_dtype=scale_dtype)
    model = ModelDir.open(convert(tmp_path / "hf", tmp_path / "m", progress=False))
    assert model.dtype == "bfloat16" and model.expert_formats == ("float8_e4m3fn/block128",)
    specs = tensor_specs(model.config)
    for spec in specs:
        if spec.hf_name not in quantized:
            assert model.entries[spec.name].dtype == "bfloat16", spec.name
            continue
        q, scale = quantized[spec.hf_name]
        if spec.expert is not None:  # bytes as they are, scale as it is
            assert model.raw_bytes(spec.name).tobytes() == q.tobytes(), spec.name
            assert np.array_equal(model.tensor(spec.name + "_scale"), scale)
            assert np.array_equal(model.tensor_f32(spec.name), quant.dequantize(q, scale, "float8_e4m3fn", "block128"))
        else:  # dense: dequantised, rounded once to bf16
            expected = dtypes.float32_to_bf16(quant.dequantize(q, scale, "float8_e4m3fn", "block128"))
            assert model.entries[spec.name].dtype == "bfloat16" and np.array_equal(model.tensor(spec.name), expected)
    assert any(s.expert is None and s.hf_name in quantized for s in specs)


@pytest.mark.parametrize(
    "expert_dtype, label", [("int8", "int8"), ("bfloat16", "bfloat16"), ("fp8", "float8_e4m3fn/block128")]
)
def test_fp8_checkpoint_to_other_expert_dtypes(tmp_path, expert_dtype, label):
    hf_config = tiny_hf_config("qwen3_moe")
    quantized = write_fp8_checkpoint(tmp_path / "hf", hf_config)
    model = ModelDir.open(convert(tmp_path / "hf", tmp_path / "m", progress=False, expert_dtype=expert_dtype))
    assert model.expert_formats == (label,)
    for name in expert_names(model):
        hf_name = next(s.hf_name for s in tensor_specs(model.config) if s.name == name)
        ref = quant.dequantize(*quantized[hf_name], "float8_e4m3fn", "block128")
        tolerance = {"int8": 1 / 254, "bfloat16": 1 / 256, "fp8": 0}[expert_dtype]
        assert np.all(np.abs(model.tensor_f32(name) - ref) <= tolerance * np.abs(ref).max()), name


@pytest.mark.parametrize("how", ["flag", "file"])
def test_an_fp8_checkpoint_takes_the_fp8_scale_asked_for(tmp_path, capsys, how):
    """--fp8-scale channel (or the file's fp8_scale) alone: the checkpoint's fp8 experts are fp8 experts, so they
    take per-channel scales; they kept their 128x128 block scales, the setting dropped in silence."""
    quantized = write_fp8_checkpoint(tmp_path / "hf", tiny_hf_config("qwen3_moe"))
    (tmp_path / "plan.json").write_text(json.dumps({"fp8_scale": "channel"}))
    asked = ["--fp8-scale", "channel"] if how == "flag" else ["--expert-dtype-file", str(tmp_path / "plan.json")]
    rc, out, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", *asked)
    assert rc == 0, err
    model = ModelDir.open(tmp_path / "m")
    assert model.expert_formats == ("float8_e4m3fn/channel",)
    for name in expert_names(model):
        hf_name = next(s.hf_name for s in tensor_specs(model.config) if s.name == name)
        ref = quant.dequantize(*quantized[hf_name], "float8_e4m3fn", "block128")
        assert np.all(np.abs(model.tensor_f32(name) - ref) <= np.abs(ref).max() / 16), name


def edit_config(hf: Path, change) -> None:
    config = json.loads((hf / "config.json").read_text())
    change(config)
    (hf / "config.json").write_text(json.dumps(config))


def quant_config(**fields):
    return lambda c: c["quantization_config"].update(fields)


SUPPORTED = 'supported: quant_method "fp8" with fmt "e4m3" and weight_block_size [128, 128], or no quantization_config'


@pytest.mark.parametrize(
    "change, message",
    [
        (quant_config(quant_method="compressed-tensors"), f"quant_method 'compressed-tensors' is not supported ({SUPPORTED})"),
        (quant_config(quant_method="gptq"), "quant_method 'gptq' is not supported"),
        (quant_config(quant_method="awq"), "quant_method 'awq' is not supported"),
        (quant_config(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported"),
        (quant_config(fmt="e5m2"), "fmt 'e5m2' is not supported"),
        (quant_config(weight_block_size=[64, 64]), "weight_block_size [64, 64] is not supported"),
        (quant_config(weight_block_size=None), "weight_block_size None is not supported"),
        (lambda c: c.update(quantization_config="fp8"), "quantization_config must be an object"),
        (lambda c: c.pop("quantization_config"), "is F8_E4M3 but config.json has no quantization_config"),
        (quant_config(modules_to_not_convert=["self_attn.q_proj"]), "q_proj.weight is F8_E4M3 but config.json's modules_to_not_convert entry 'self_attn.q_proj' names its module"),
        (quant_config(ignored_layers="lm_head"), "ignored_layers must be a list of module names"),
        # a component run inside the path names a module too: 'experts' was matched only as a prefix or suffix;
        # and the error named modules_to_not_convert for an ignored_layers entry
        (quant_config(modules_to_not_convert=["experts"]), "experts.0.gate_proj.weight is F8_E4M3 but config.json's modules_to_not_convert entry 'experts' names its module"),
        (quant_config(ignored_layers=["self_attn"]), "self_attn.q_proj.weight is F8_E4M3 but config.json's ignored_layers entry 'self_attn' names its module"),
        (quant_config(modules_to_not_convert=""), "modules_to_not_convert must be a list of module names, got ''"),
        (quant_config(ignored_layers={}), "ignored_layers must be a list of module names, got {}"),
    ],
)  # fmt: skip
def test_refused_quantization_configs_are_one_line(tmp_path, capsys, change, message):
    write_fp8_checkpoint(tmp_path / "hf", tiny_hf_config("qwen3_moe"))
    edit_config(tmp_path / "hf", change)
    rc, out, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress")
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err


def rewrite(hf: Path, change) -> None:
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    tensors = load_torch(str(hf / "model.safetensors"))
    change(tensors)
    save_torch(tensors, str(hf / "model.safetensors"))


EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"


def nan_byte(t, name=EXPERT, byte=0x7F):
    t[name] = t[name].clone()
    t[name].view(dtype=__import__("torch").uint8)[3, 5] = byte


NORM = "model.layers.0.post_attention_layernorm.weight"
ROUTER = "model.layers.1.mlp.gate.weight"


def fp8_norm(t):
    """A vector stored fp8 with a one-block scale: block scales are defined for matrices only."""
    import torch

    q, scale = quant.quantize(t[NORM].float().numpy()[None, :], "float8_e4m3fn", quant.BLOCK128, NORM)
    t[NORM], t[NORM + "_scale_inv"] = torch.from_numpy(q[0]).view(torch.float8_e4m3fn), torch.from_numpy(scale[0])


@pytest.mark.parametrize(
    "change, message",
    [
        (fp8_norm, f"tensor {NORM} is F8_E4M3 [64]: only matrices are read block-quantized"),
        (lambda t: t.update({EXPERT + "_scale": t[EXPERT + "_scale_inv"] * 2}), f"tensor {EXPERT} has both {EXPERT}_scale_inv and {EXPERT}_scale"),
        (lambda t: t.update({ROUTER + "_scale_inv": t[EXPERT + "_scale_inv"].clone()}), f"tensor {ROUTER}_scale_inv: a scale for {ROUTER}, which is BF16, not F8_E4M3"),
        (lambda t: t.pop(EXPERT + "_scale_inv"), f"tensor {EXPERT} is F8_E4M3 but has no {EXPERT}_scale_inv (or _scale)"),
        (lambda t: t.update({EXPERT + "_scale_inv": t[EXPERT + "_scale_inv"].repeat(2, 1)}), f"{EXPERT}_scale_inv is F32 [2, 1], expected F32 or BF16 or F16 [1, 1]"),
        (lambda t: t.update({EXPERT + "_scale_inv": t[EXPERT + "_scale_inv"].double()}), f"{EXPERT}_scale_inv is F64 [1, 1], expected F32 or BF16 or F16 [1, 1]"),
        (lambda t: t[EXPERT + "_scale_inv"].fill_(float("nan")), f"tensor {EXPERT}_scale_inv: non-finite block scales"),
        (lambda t: t[EXPERT + "_scale_inv"].fill_(0.0), f"invalid scale in tensor {EXPERT}_scale_inv: 0.0 at [0, 0]"),
        (lambda t: t[EXPERT + "_scale_inv"].fill_(-2.0), f"invalid scale in tensor {EXPERT}_scale_inv: -2.0 at [0, 0]"),
        (nan_byte, f"tensor {EXPERT}: fp8 weights hold NaN bytes"),
        (lambda t: nan_byte(t, "model.layers.0.self_attn.q_proj.weight", 0xFF), "tensor model.layers.0.self_attn.q_proj.weight: fp8 weights hold NaN bytes"),
    ],
)  # fmt: skip
def test_broken_fp8_tensors_are_one_line(tmp_path, capsys, change, message):
    write_fp8_checkpoint(tmp_path / "hf", tiny_hf_config("qwen3_moe"))
    rewrite(tmp_path / "hf", change)
    rc, out, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress")
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    "name, flags",
    [(Q_PROJ, []), (EXPERT, ["--expert-dtype", "int8"]), (EXPERT, ["--expert-dtype", "bf16"])],
)
@pytest.mark.parametrize("value", [0.0, -2.0, 2.0**120])
def test_a_zero_or_negative_block_scale_is_refused_when_dequantised_too(tmp_path, capsys, name, flags, value):
    """Kept expert bytes were refused such a scale; a dense layer, or an expert another dtype was asked for,
    took it into its weights (zeroed or sign-flipped). A finite scale so large that 448 x it overflows float32
    was taken everywhere: its block's largest codes dequantised to infinity."""
    write_fp8_checkpoint(tmp_path / "hf", tiny_hf_config("qwen3_moe"))
    rewrite(tmp_path / "hf", lambda t: t[name + "_scale_inv"].fill_(value))
    rc, out, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", *flags)
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"invalid scale in tensor {name}_scale_inv: {value} at [0, 0]" in err


@pytest.mark.parametrize("flags", [[], ["--expert-dtype", "bf16"]])
def test_an_fp8_block_dequantised_past_bfloat16s_range_is_refused(tmp_path, capsys, flags):
    """The largest scale fp8 allows times the code 448 is float32's largest value, which rounds to bfloat16's
    infinity: the dense layer (or an expert converted to bf16) held inf for a finite weight."""
    write_fp8_checkpoint(tmp_path / "hf", tiny_hf_config("qwen3_moe"))
    name = Q_PROJ if not flags else EXPERT
    rewrite(tmp_path / "hf", lambda t: t[name + "_scale_inv"].fill_(float(quant.MAX_SCALE["float8_e4m3fn"])))
    rc, out, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", *flags)
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"tensor {name}: converting float32 to bfloat16 would overflow (|value| up to 3.40282e+38" in err


@pytest.mark.parametrize(
    "checkpoint, flags, named",
    [
        ("float32", ["--expert-dtype", "int8", "--fp8-scale", "channel"], "--expert-dtype int8"),
        ("float32", ["--fp8-scale", "block128"], "no --expert-dtype, and the checkpoint experts are not fp8"),
        ("fp8", ["--expert-dtype", "bf16", "--fp8-scale", "channel"], "--expert-dtype bf16"),
    ],
)
def test_an_fp8_scale_no_expert_takes_is_refused(tmp_path, capsys, checkpoint, flags, named):
    """--fp8-scale with no routed expert stored fp8 was dropped in silence; it is refused before anything is
    written, naming --fp8-scale and --expert-dtype."""
    if checkpoint == "fp8":
        write_fp8_checkpoint(tmp_path / "hf", tiny_hf_config("qwen3_moe"))
    else:
        write_tiny_checkpoint(tmp_path / "hf", "olmoe", seed=3)
    rc, _, err = run_cli(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", *flags)
    scale = flags[flags.index("--fp8-scale") + 1]
    assert rc == 2
    assert err.splitlines() == [
        f"colibri convert: error: --fp8-scale {scale}: no routed expert is stored fp8 ({named}), so it would be "
        "ignored; drop it or give --expert-dtype fp8"
    ]
    assert not (tmp_path / "m").exists()


def test_an_fp8_scale_of_the_expert_dtype_file_no_expert_takes_is_refused(tmp_path, capsys):
    """The file's fp8_scale, like the flag, was dropped in silence when no expert ends up fp8."""
    write_tiny_checkpoint(tmp_path / "hf", "olmoe", seed=3)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"default": "int8", "fp8_scale": "channel"}))
    args = ("convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--no-progress", "--expert-dtype-file", str(plan))
    rc, _, err = run_cli(capsys, *args)
    assert (rc, err.splitlines()) == (
        2,
        [
            f"colibri convert: error: {plan}: fp8_scale: no routed expert is stored fp8 (--expert-dtype-file {plan}), "
            "so it would be ignored; drop it or give --expert-dtype fp8"
        ],
    )
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("expert_dtype, fp8_scale", [("int8", None), ("fp8", "block128"), ("fp8", "channel")])
def test_quantizing_peak_memory_is_a_few_bytes_per_element_of_the_largest_tensor(tmp_path, expert_dtype, fp8_scale):
    """One expert matrix dominates (4 x 1024 x 520 floats); everything else is tiny. numpy reports its
    allocations to tracemalloc, so the peak is what the converter holds at once, not the model."""
    hf_config = {**tiny_hf_config("mixtral"), "hidden_size": 520, "intermediate_size": 1024, "num_attention_heads": 4}
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config))
    rng = np.random.default_rng(0)
    weights = {
        s.hf_name: rng.standard_normal(s.shape, dtype=np.float32) for s in tensor_specs(config_from_hf(hf_config))
    }
    save_file(weights, str(hf / "model.safetensors"))
    largest = max(w.size for w in weights.values())
    model_bytes = sum(w.nbytes for w in weights.values())
    tracemalloc.start()
    try:
        convert(hf, tmp_path / "m", progress=False, expert_dtype=expert_dtype, fp8_scale=fp8_scale)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_element = peak / largest
    print(
        f"{expert_dtype}/{fp8_scale}: peak {peak:,} bytes = {per_element:.1f} bytes per element of the largest tensor"
    )
    assert per_element <= 17 and peak < model_bytes / 2
