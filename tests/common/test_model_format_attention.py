"""8-bit attention projections in the model directory: where q|k|v, o_proj and their per-row scales lie, what
`ModelDir.attention_format` and `tensor_f32` give, and every corruption of them refused in one line (each test fails
if its check goes)."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from common import quant
from common.errors import ModelFormatError
from common.expert_layout import align
from common.model_format import ModelDir
from common.model_manifest import DENSE_ALIGN, DENSE_FILE, MANIFEST
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import tiny_weights
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def converted(root: Path, family: str, attention_dtype: str | None, **overrides) -> ModelDir:
    write_head_checkpoint(root / "hf", head_config(family, **overrides), seed=5)
    return ModelDir.open(convert(root / "hf", root / "m", "bfloat16", False, attention_dtype=attention_dtype))


@pytest.fixture(scope="module", params=[("mixtral", "int8"), ("qwen3_moe", "float8_e4m3fn")], ids=str)
def attn8(request, tmp_path_factory) -> ModelDir:
    family, dtype = request.param
    return converted(tmp_path_factory.mktemp(family), family, dtype)


def test_qkv_codes_and_scales_are_one_block_and_o_proj_another(attn8):
    fmt, config, dense = attn8.attention_format, attn8.config, attn8._map(DENSE_FILE)
    q, kv, D = config.q_size, config.kv_size, config.hidden_size
    assert fmt is not None and fmt.scheme == "channel" and fmt.file == DENSE_FILE
    assert fmt.qkv_shape == (q + 2 * kv, D) and fmt.o_shape == (D, q) and len(fmt.layers) == config.num_hidden_layers
    for i, blocks in enumerate(fmt.layers):
        e = {p: attn8.entries[f"layers.{i}.{p}"] for p in PROJECTIONS}
        s = {p: attn8.entries[f"layers.{i}.{p}_scale"] for p in PROJECTIONS}
        assert {x.dtype for x in e.values()} == {fmt.dtype} and {x.dtype for x in s.values()} == {"float32"}
        assert [s[p].shape for p in PROJECTIONS] == [(q,), (kv,), (kv,), (D,)]
        assert e["q_proj"].offset % DENSE_ALIGN == 0 and e["o_proj"].offset % DENSE_ALIGN == 0
        assert e["k_proj"].offset == e["q_proj"].offset + q * D and e["v_proj"].offset == e["k_proj"].offset + kv * D
        assert s["q_proj"].offset == align(e["v_proj"].offset + kv * D, DENSE_ALIGN)
        assert s["k_proj"].offset == s["q_proj"].offset + 4 * q and s["v_proj"].offset == s["k_proj"].offset + 4 * kv
        assert s["o_proj"].offset == align(e["o_proj"].offset + D * q, DENSE_ALIGN)
        # what a kernel views: q|k|v as one stacked matrix, then their stacked scales; o_proj then its scale
        qkv = dense[blocks.qkv_offset : blocks.qkv_offset + blocks.qkv_nbytes]
        codes = np.concatenate([attn8.tensor(f"layers.{i}.{p}") for p in PROJECTIONS[:3]]).view(np.uint8)
        assert np.array_equal(qkv[: (q + 2 * kv) * D].reshape(fmt.qkv_shape), codes)
        scales = np.concatenate([attn8.tensor(f"layers.{i}.{p}_scale") for p in PROJECTIONS[:3]])
        assert np.array_equal(qkv[blocks.qkv_scale_offset :].view("<f4"), scales)
        o = dense[blocks.o_offset : blocks.o_offset + blocks.o_nbytes]
        assert np.array_equal(o[: D * q].reshape(fmt.o_shape), attn8.tensor(f"layers.{i}.o_proj").view(np.uint8))
        assert np.array_equal(o[blocks.o_scale_offset :].view("<f4"), attn8.tensor(f"layers.{i}.o_proj_scale"))


def test_tensor_f32_dequantises_each_projection_exactly(attn8):
    weights = tiny_weights(head_config(attn8.config.family), seed=5)
    tolerance = {"int8": 1 / 254, "float8_e4m3fn": 1 / 16}[attn8.attention_format.dtype]
    for i in range(attn8.config.num_hidden_layers):
        for p in PROJECTIONS:
            name, raw = f"layers.{i}.{p}", attn8.tensor(f"layers.{i}.{p}")
            codes = quant.fp8_to_float32(raw) if raw.dtype == np.uint8 else raw.astype(np.float32)
            values = attn8.tensor_f32(name)
            assert values.dtype == np.float32 and np.array_equal(values, codes * attn8.tensor(name + "_scale")[:, None])
            source = weights[f"model.layers.{i}.self_attn.{p}.weight"]  # quantized from the float32 weights
            rows = np.abs(source).max(axis=1, keepdims=True)
            assert np.all(np.abs(values - source) <= tolerance * rows * 1.0001)


def test_crcs_of_the_projections_and_scales_are_recorded(attn8):
    for name, entry in attn8.entries.items():
        if re.fullmatch(r"layers\.\d+\.[qkvo]_proj(_scale)?", name):
            assert entry.crc32 == zlib.crc32(attn8.raw_bytes(name).tobytes()), name


def test_dense_projections_have_no_attention_format(tmp_path):
    model = converted(tmp_path, "mixtral", None)
    assert model.attention_format is None and "layers.0.q_proj_scale" not in model.entries


def edit(model: ModelDir, change) -> Path:
    manifest = json.loads((model.path / MANIFEST).read_text())
    change(manifest["tensors"])
    (model.path / MANIFEST).write_text(json.dumps(manifest))
    return model.path


@pytest.fixture
def broken(tmp_path) -> ModelDir:
    return converted(tmp_path, "mixtral", "int8")  # q 64, kv 32, hidden 64


def shift(name: str, by: int):
    return lambda t: t[name].update(offset=t[name]["offset"] + by)


CORRUPTIONS = [
    (lambda t: t.pop("layers.1.k_proj_scale"), r"^tensor layers\.1\.k_proj_scale: missing \(the scale of int8 tensor "
     r"layers\.1\.k_proj\)$"),
    (lambda t: t["layers.0.o_proj_scale"].update(shape=[32], nbytes=128), r"^tensor layers\.0\.o_proj_scale: float32 \[32\], "
     r"expected float32 \[64\] \(one per row\)$"),
    (lambda t: t["layers.0.v_proj_scale"].update(dtype="float16", nbytes=64), r"^tensor layers\.0\.v_proj_scale: "
     r"float16 \[32\], expected float32 \[32\]"),
    (shift("layers.1.k_proj", 64), r"^tensor layers\.1\.k_proj: stored in dense\.bin at byte \d+; the format puts it "
     r"in dense\.bin right where layers\.1\.q_proj ends, at byte \d+$"),
    (shift("layers.0.v_proj", -64), r"^tensor layers\.0\.v_proj: stored in dense\.bin at byte \d+; the format puts it "
     r"in dense\.bin right where layers\.0\.k_proj ends"),
    (shift("layers.0.q_proj_scale", 64), r"^tensor layers\.0\.q_proj_scale: stored in dense\.bin at byte \d+; the "
     r"format puts it in dense\.bin at the first 64-byte boundary after layers\.0\.v_proj, at byte \d+$"),
    (shift("layers.1.k_proj_scale", 64), r"^tensor layers\.1\.k_proj_scale: stored in dense\.bin at byte \d+; the "
     r"format puts it in dense\.bin right where layers\.1\.q_proj_scale ends"),
    (shift("layers.1.v_proj_scale", 64), r"^tensor layers\.1\.v_proj_scale: stored in dense\.bin at byte \d+; the "
     r"format puts it in dense\.bin right where layers\.1\.k_proj_scale ends"),
    (shift("layers.0.o_proj_scale", -64), r"^tensor layers\.0\.o_proj_scale: stored in dense\.bin at byte \d+; the "
     r"format puts it in dense\.bin at the first 64-byte boundary after layers\.0\.o_proj"),
    (lambda t: t["layers.1.o_proj"].update(dtype="float8_e4m3fn"), r"^tensor layers\.1\.o_proj: dtype float8_e4m3fn, "
     r"but layers\.0\.q_proj is int8: the attention projections of every layer share one dtype$"),
    (lambda t: t["layers.0.q_proj"].update(shape=[32, 64], nbytes=32 * 64), r"^tensor layers\.0\.q_proj: shape "
     r"\[32, 64\] in colibri\.json, config\.json implies \[64, 64\]$"),
    (lambda t: t["layers.0.input_norm"].update(dtype="int8", nbytes=64),
     r"^tensor layers\.0\.input_norm: dtype int8 is only for routed experts' matrices, attention projections and "
     r"lm_head$"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", CORRUPTIONS)
def test_broken_8bit_projections_are_one_line(broken, change, message):
    with pytest.raises(ModelFormatError, match=message) as error:
        ModelDir.open(edit(broken, change), verify=False)
    assert "\n" not in str(error.value)


def test_one_8bit_projection_among_dense_ones_is_refused(tmp_path):
    model = converted(tmp_path, "mixtral", None)
    message = (
        r"^tensor layers\.0\.k_proj: dtype bfloat16, but layers\.0\.q_proj is int8: the attention projections of "
        r"every layer share one dtype$"
    )
    with pytest.raises(ModelFormatError, match=message):
        ModelDir.open(edit(model, lambda t: t["layers.0.q_proj"].update(dtype="int8", nbytes=64 * 64)), verify=False)


def test_a_dense_projection_in_another_dtype_than_the_manifests_is_refused(tmp_path):
    model = converted(tmp_path, "mixtral", None)
    message = (
        r"^tensor layers\.1\.o_proj: dtype float16, but layers\.1\.o_proj is the manifest's dtype bfloat16 or 8-bit "
        r"\(int8, float8_e4m3fn\)$"
    )
    with pytest.raises(ModelFormatError, match=message):
        ModelDir.open(edit(model, lambda t: t["layers.1.o_proj"].update(dtype="float16")), verify=False)


def test_a_scale_beside_a_dense_projection_is_refused(tmp_path):
    model = converted(tmp_path, "mixtral", None)
    add = {"file": DENSE_FILE, "offset": 0, "nbytes": 4 * 64, "dtype": "float32", "shape": [64], "crc32": 0}
    message = r"^tensor layers\.0\.q_proj_scale: a scale for layers\.0\.q_proj, which is not 8-bit$"
    with pytest.raises(ModelFormatError, match=message):
        ModelDir.open(edit(model, lambda t: t.update({"layers.0.q_proj_scale": add})), verify=False)


def test_8bit_projections_of_sizes_the_layout_cannot_stack_are_refused(tmp_path):
    """hidden_size 40: q|k|v rows of 40 bytes would leave gaps at 64-byte boundaries. Relabelled int8 (the converter
    refuses to write such a model), the reader names the sizes."""
    model = converted(tmp_path, "mixtral", None, hidden_size=40, num_attention_heads=4, num_key_value_heads=2)

    def relabel(t):
        for i in range(2):
            for p in PROJECTIONS:
                t[f"layers.{i}.{p}"].update(dtype="int8", nbytes=t[f"layers.{i}.{p}"]["nbytes"] // 2)

    message = (
        r"^tensor layers\.0\.q_proj: 8-bit attention projections need hidden_size a multiple of 64 and the q and kv "
        r"projection sizes multiples of 16; this model has hidden_size 40, q 40, kv 20$"
    )
    with pytest.raises(ModelFormatError, match=message):
        ModelDir.open(edit(model, relabel), verify=False)


def write_scale_value(model: ModelDir, name: str, index: int, value: float) -> Path:
    """Element `index` of scale `name` set to `value`, its crc32 recorded: only the value check can tell."""
    entry = model.entries[name]
    path = model.path / DENSE_FILE
    data = bytearray(path.read_bytes())
    data[entry.offset + 4 * index : entry.offset + 4 * index + 4] = np.float32(value).astype("<f4").tobytes()
    path.write_bytes(bytes(data))
    crc = zlib.crc32(data[entry.offset : entry.offset + entry.nbytes])
    return edit(model, lambda t: t[name].update(crc32=crc))


@pytest.mark.parametrize(
    "dtype, name, value, shown",
    [
        ("int8", "layers.1.k_proj_scale", np.nan, "nan"),
        ("float8_e4m3fn", "layers.0.q_proj_scale", np.inf, "inf"),
        ("int8", "layers.0.o_proj_scale", 0.0, "0.0"),
        ("float8_e4m3fn", "layers.1.v_proj_scale", -2.0, "-2.0"),
        ("int8", "layers.1.o_proj_scale", 2.0**122, re.escape(str(2.0**122))),  # 127 x it overflows float32
        ("float8_e4m3fn", "layers.0.k_proj_scale", 2.0**120, re.escape(str(2.0**120))),
    ],
)
def test_a_scale_that_is_not_positive_and_finite_is_refused_on_open(tmp_path, dtype, name, value, shown):
    path = write_scale_value(converted(tmp_path, "mixtral", dtype), name, 5, value)
    limit = re.escape(f"{float(quant.MAX_SCALE[dtype]):g}")
    message = (
        rf"^dense\.bin: invalid scale in tensor {re.escape(name)}: {shown} at \[5\] \(scales are positive and finite, "
        rf"{dtype} ones at most {limit}; corrupted\?\)$"
    )
    for verify in (False, True):  # the worker may skip the checksums: the value check must not need them
        with pytest.raises(ModelFormatError, match=message):
            ModelDir.open(path, verify=verify)


def test_the_layout_plan_takes_only_an_8bit_dtype_and_stackable_sizes():
    from common.model_manifest import plan_layout
    from common.models import config_from_hf

    config = config_from_hf(head_config("mixtral"))
    with pytest.raises(ValueError, match=r"^attention dtype 'bfloat16': an 8-bit dtype, or None for the dense dtype$"):
        plan_layout(config, "bfloat16", attention_dtype="bfloat16")
    odd = config_from_hf(head_config("mixtral", hidden_size=40, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"^8-bit attention projections: hidden_size 40, q 40, kv 20 leave gaps"):
        plan_layout(odd, "bfloat16", attention_dtype="int8")
    entries, _ = plan_layout(config, "bfloat16", attention_dtype="int8")
    assert entries["layers.0.q_proj"].dtype == "int8" and entries["layers.0.q_proj_scale"].shape == (64,)
