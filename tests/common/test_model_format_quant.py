"""Model format version 2: per-tensor dtypes, 8-bit experts with their scales inside the expert's block,
per-layer strides; version-1 directories still load; corruption of any of it is a one-line error."""

from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from common import dtypes, quant
from common.errors import ChecksumError, ModelFormatError
from common.expert_layout import EXPERT_ALIGN, PROJECTIONS, TENSOR_ALIGN, align
from common.model_format import ModelDir
from common.model_manifest import MANIFEST, expert_file
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import tiny_hf_config, tiny_weights

# Odd sizes: no matrix or scale is a multiple of 256 bytes, so the in-block alignment shows.
HF_CONFIG = {**tiny_hf_config("qwen3_moe"), "moe_intermediate_size": 19, "num_experts": 5}
MIXED = {"default": "int8", "layers": {"1": "fp8"}, "experts": {"0.1": "bfloat16", "0.2": "fp8", "1.4": "float32"}}


def checkpoint(root: Path) -> Path:
    hf = root / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(tiny_weights(HF_CONFIG, seed=5), str(hf / "model.safetensors"))
    return hf


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> ModelDir:
    root = tmp_path_factory.mktemp("mixed")
    (root / "plan.json").write_text(json.dumps(MIXED))
    out = convert(checkpoint(root), root / "model", "bfloat16", False, expert_dtype_file=root / "plan.json")
    return ModelDir.open(out)


def expected_format(layer: int, expert: int) -> tuple[str, str | None]:
    special = {(0, 1): ("bfloat16", None), (0, 2): ("float8_e4m3fn", "block128"), (1, 4): ("float32", None)}
    return special.get((layer, expert), ("float8_e4m3fn", "block128") if layer == 1 else ("int8", "channel"))


def test_every_expert_has_the_format_asked_and_its_tensors_where_the_layout_says(mixed):
    F, D = 19, 64
    for layer in mixed.config.moe_layers:
        blocks = []
        for expert in range(5):
            layout = mixed.expert_layout(layer, expert)
            assert (layout.dtype, layout.scheme) == expected_format(layer, expert)
            assert layout.file == expert_file(layer) and layout.offset == expert * layout.stride
            assert layout.weight_shapes == ((F, D), (F, D), (D, F))
            offsets = layout.weight_offsets + layout.scale_offsets
            assert offsets[0] == 0 and all(o % TENSOR_ALIGN == 0 for o in offsets) and list(offsets) == sorted(offsets)
            prefix = f"layers.{layer}.experts.{expert}."
            names = [prefix + p for p in PROJECTIONS] + [prefix + p + "_scale" for p in PROJECTIONS if layout.scheme]
            block = mixed._map(layout.file)[layout.offset : layout.offset + layout.nbytes]
            for name, offset in zip(names, offsets):  # one copy of the block carries every tensor's bytes
                entry = mixed.entries[name]
                assert block[offset : offset + entry.nbytes].tobytes() == mixed.raw_bytes(name).tobytes()
            assert offsets[-1] + mixed.entries[names[-1]].nbytes == layout.nbytes
            if layout.scheme:
                assert layout.scale_shapes == tuple(quant.scale_shape(layout.scheme, s) for s in layout.weight_shapes)
            assert mixed.expert_block(layer, expert) == (layout.file, layout.offset, layout.nbytes)
            blocks.append(layout.nbytes)
        stride = mixed.expert_strides[layer]
        assert stride == align(max(blocks), EXPERT_ALIGN)  # the largest block of the layer, page-aligned
    assert mixed.expert_stride == max(mixed.expert_strides.values())
    assert mixed.max_expert_nbytes == max(mixed.expert_block(*k)[2] for k in mixed.expert_layouts)
    assert mixed.expert_formats == ("bfloat16", "float32", "float8_e4m3fn/block128", "int8")


def test_dense_tensors_stay_in_the_dense_dtype_and_dequantised_experts_are_close(mixed, tmp_path):
    source = tiny_weights(HF_CONFIG, seed=5)
    hf_names = {f"layers.{i}.experts.{j}.{p}": f"model.layers.{i}.mlp.experts.{j}.{p}.weight" for i in (0, 1)
                for j in range(5) for p in PROJECTIONS}  # fmt: skip
    for name, entry in mixed.entries.items():
        if name.endswith("_scale"):
            assert entry.dtype == "float32"
        elif name not in hf_names:
            assert entry.dtype == "bfloat16", name
    for name, hf_name in hf_names.items():
        ours, ref = mixed.tensor_f32(name), source[hf_name]
        dtype = mixed.entries[name].dtype
        tolerance = {"int8": 1 / 254, "float8_e4m3fn": 1 / 16, "bfloat16": 1 / 256, "float32": 0}[dtype]
        assert ours.dtype == np.float32 and np.all(np.abs(ours - ref) <= tolerance * np.abs(ref).max()), name


def test_version_1_directories_still_load(tmp_path):
    """A version-1 directory as its writer made it: one dtype, one stride, matrices back to back."""
    out = convert(checkpoint(tmp_path), tmp_path / "v2", "bfloat16", False)
    v2 = ModelDir.open(out)
    expert_nbytes = 3 * 19 * 64 * 2
    stride = align(expert_nbytes, EXPERT_ALIGN)
    v1_dir = version_1_copy(v2, tmp_path / "v1", lambda expert: expert, stride)
    assert 19 * 64 * 2 % TENSOR_ALIGN  # the version-2 layout of this model has gaps; version 1 has none
    v1 = ModelDir.open(v1_dir)
    assert v1.version == 1 and v1.expert_formats == ("bfloat16",) and v1.expert_strides == {0: stride, 1: stride}
    for key, layout in v1.expert_layouts.items():
        assert layout.weight_offsets == (0, 2432, 4864) and layout.nbytes == expert_nbytes and not layout.scale_offsets
        for p in PROJECTIONS:
            name = f"layers.{key[0]}.experts.{key[1]}.{p}"
            assert np.array_equal(v1.tensor_f32(name), v2.tensor_f32(name))


def edit(model: ModelDir, change) -> Path:
    manifest = json.loads((model.path / MANIFEST).read_text())
    change(manifest)
    (model.path / MANIFEST).write_text(json.dumps(manifest))
    return model.path


@pytest.fixture
def broken(tmp_path) -> ModelDir:
    (tmp_path / "plan.json").write_text(json.dumps(MIXED))
    return ModelDir.open(
        convert(checkpoint(tmp_path), tmp_path / "m", "bfloat16", False, expert_dtype_file=tmp_path / "plan.json")
    )


def test_a_flipped_byte_in_a_scale_fails_its_checksum(broken):
    entry = broken.entries["layers.1.experts.3.down_proj_scale"]
    path = broken.path / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offset + 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(
        ChecksumError, match=r"^experts-L001\.bin: checksum mismatch in tensor layers\.1\.experts\.3\.down_proj_scale "
    ):
        ModelDir.open(broken.path)


def set_tensor(name, **fields):
    def change(m):
        m["tensors"][name].update(fields)

    return change


def drop(name):
    return lambda m: m["tensors"].pop(name)


G = "layers.0.experts.0.gate_proj"
CORRUPTIONS = [
    (drop(G + "_scale"), rf"^tensor {G}_scale: missing \(the scale of int8 tensor {G}\)$"),
    (set_tensor(G + "_scale", shape=[4, 4], nbytes=64), rf"^tensor {G}_scale: float32 \[4, 4\], expected float32 \[19\]"),
    (set_tensor(G + "_scale", dtype="float16", nbytes=38), rf"^tensor {G}_scale: float16 \[19\], expected float32"),
    (set_tensor("layers.0.q_proj", dtype="int8", nbytes=6144), r"^tensor layers\.0\.k_proj: dtype \w+, but layers\.0\.q_proj "
     r"is int8: the attention projections of every layer share one dtype$"),
    (set_tensor("layers.0.router", dtype="int8", nbytes=5 * 64), r"^tensor layers\.0\.router: dtype int8 is only for routed"),
    (set_tensor(G, dtype="float8_e4m3fn"), rf"^tensor layers\.0\.experts\.0\.up_proj: dtype int8 differs from {G}'s float8"),
    (set_tensor(G, offset=256), rf"^tensor {G}: expert 0 of layer 0 is not one 4096-byte-aligned block"),
    (set_tensor(G + "_scale", offset=4096 - 76), rf"^tensor {G}: expert 0 of layer 0 is not one"),
    (lambda m: m["expert_strides"].update({"0": 4096 + 256}), r"is not one 4096-byte-aligned block"),
    (lambda m: m["tensors"].update({"layers.0.experts.1.up_proj_scale": m["tensors"][G + "_scale"]}),
     r"^tensor layers\.0\.experts\.1\.up_proj_scale: a scale for layers\.0\.experts\.1\.up_proj, which is not 8-bit"),
    (lambda m: m["tensors"].update({"layers.0.extra": m["tensors"]["final_norm"]}), r"^tensor layers\.0\.extra: not part of"),
    (lambda m: m["tensors"][G].update(dtype="int4"), rf"^tensor {G}: dtype 'int4' is not supported$"),
    # what an expert cache sizes a slot by: a smaller one would have it copy past its slots
    (lambda m: m.update(expert_stride=4096), r"^colibri\.json: expert_stride is 4096, but the largest of expert_strides is \d+$"),
    (lambda m: m.update(expert_stride=m["expert_stride"] + 4096), r"^colibri\.json: expert_stride is \d+, but the largest"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", CORRUPTIONS)
def test_structural_corruption_is_one_line(broken, change, message):
    with pytest.raises(ModelFormatError, match=message) as error:
        ModelDir.open(edit(broken, change), verify=False)
    assert "\n" not in str(error.value)


def test_scale_nbytes_are_checked_against_dtype_and_shape(broken):
    with pytest.raises(ModelFormatError, match=rf"^tensor {G}_scale: 80 bytes do not fit float32 \[19\]"):
        ModelDir.open(edit(broken, set_tensor(G + "_scale", nbytes=80)), verify=False)


def test_crc_of_every_scale_is_recorded(broken):
    for name, entry in broken.entries.items():
        if name.endswith("_scale"):
            assert entry.crc32 == zlib.crc32(broken.raw_bytes(name).tobytes()) and entry.nbytes == 4 * math.prod(
                entry.shape
            )
            assert dtypes.STORAGE[entry.dtype] == np.float32


def version_1_copy(v2: ModelDir, v1_dir: Path, slot_of_expert, stride: int | None = None) -> Path:
    """A version-1 directory of v2's tensors: each expert's tensors (scales too, if any) back to back from
    byte slot_of_expert(expert) x stride, one stride for the model (default v2's)."""
    v1_dir.mkdir()
    manifest = json.loads((v2.path / MANIFEST).read_text())
    (v1_dir / "dense.bin").write_bytes((v2.path / "dense.bin").read_bytes())
    stride = stride or v2.expert_stride
    for layer in v2.config.moe_layers:
        data = bytearray(v2.config.num_experts * stride)
        for expert in range(v2.config.num_experts):
            at = slot_of_expert(expert) * stride
            names = [f"layers.{layer}.experts.{expert}.{p}" for p in PROJECTIONS]
            for name in names + [n + "_scale" for n in names if n + "_scale" in manifest["tensors"]]:
                raw = v2.raw_bytes(name).tobytes()
                data[at : at + len(raw)] = raw
                manifest["tensors"][name]["offset"] = at
                at += len(raw)
        (v1_dir / expert_file(layer)).write_bytes(bytes(data))
    manifest.update(format_version=1, expert_stride=stride)
    del manifest["expert_strides"]
    (v1_dir / MANIFEST).write_text(json.dumps(manifest))
    return v1_dir


def test_a_version_1_directory_with_8bit_experts_is_refused(tmp_path):
    """Version 1 has one dtype for every tensor and no scales: 8-bit experts in it mix the two versions."""
    v2 = ModelDir.open(convert(checkpoint(tmp_path), tmp_path / "v2", "bfloat16", False, expert_dtype="int8"))
    v1_dir = version_1_copy(v2, tmp_path / "v1", lambda expert: expert)
    with pytest.raises(ModelFormatError, match=r"^tensor layers\.0\.experts\.0\.gate_proj: dtype int8 in a version-1 "
                       r"directory, whose tensors are all bfloat16 \(version 2 holds 8-bit experts\)$"):  # fmt: skip
        ModelDir.open(v1_dir)


def test_a_version_1_expert_off_its_slot_is_refused(tmp_path):
    """Expert j of a version-1 file lies at j x expert_stride: the cuda backend reads it there, whatever the
    manifest's offsets say, so a manifest that swaps two experts would give the cpu and cuda backends
    different weights."""
    v2 = ModelDir.open(convert(checkpoint(tmp_path), tmp_path / "v2", "bfloat16", False))
    swapped = version_1_copy(v2, tmp_path / "v1", lambda expert: {3: 4, 4: 3}.get(expert, expert))
    with pytest.raises(ModelFormatError, match=r"^tensor layers\.0\.experts\.3\.gate_proj: expert 3 of layer 0 is not"):
        ModelDir.open(swapped)
    in_place = ModelDir.open(version_1_copy(v2, tmp_path / "v1-ok", lambda expert: expert))
    assert [in_place.expert_layout(0, j).offset for j in range(5)] == [j * v2.expert_stride for j in range(5)]


def test_a_dense_tensor_in_another_dtype_than_the_manifests_is_refused(broken):
    """Only routed experts may differ from the dense dtype: a float16 label on a bfloat16 norm (same byte
    size, so nbytes cannot tell) would be read as other values."""
    change = set_tensor("final_norm", dtype="float16")
    with pytest.raises(ModelFormatError, match=r"^tensor final_norm: dtype float16, but every tensor other than routed "
                       r"experts' is the manifest's dtype bfloat16$"):  # fmt: skip
        ModelDir.open(edit(broken, change), verify=False)


def test_expert_tensors_in_another_file_than_their_layers_are_refused(broken):
    """The cuda backend uploads experts-L001.bin for layer 1 whatever the manifest says: experts moved (with
    their checksums) into another file were verified there, and the GPU then served the stale bytes the
    verified manifest no longer covers (zeros here)."""
    stride = broken.expert_strides[1]
    original = broken.path / "experts-L001.bin"
    data = original.read_bytes()
    (broken.path / "x.bin").write_bytes(data)
    original.write_bytes(data[:stride] + bytes(len(data) - stride))  # expert 0 stays, the rest is stale

    def move(m):
        for name, entry in m["tensors"].items():
            if name.startswith("layers.1.experts.") and not name.startswith("layers.1.experts.0."):
                entry["file"] = "x.bin"

    with pytest.raises(ModelFormatError, match=r"^tensor layers\.1\.experts\.1\.gate_proj: stored in x\.bin at "
                       r"byte \d+; the format puts it in experts-L001\.bin$"):  # fmt: skip
        ModelDir.open(edit(broken, move))


def test_a_dense_tensor_off_its_64_byte_boundary_is_refused(broken):
    """Every writer put dense tensors at multiples of 64 bytes; the cuda backend views them in place, so one at
    an odd byte (its bytes and checksum intact) would be a misaligned device read."""
    entry = broken.entries["final_norm"]
    dense = broken.path / "dense.bin"
    size = dense.stat().st_size
    with dense.open("ab") as f:
        f.write(b"\0" + broken.raw_bytes("final_norm").tobytes())
    with pytest.raises(ModelFormatError, match=rf"^tensor final_norm: stored in dense\.bin at byte {size + 1}; the "
                       r"format puts it in dense\.bin at a multiple of 64 bytes$"):  # fmt: skip
        ModelDir.open(edit(broken, set_tensor("final_norm", offset=size + 1)))
    assert entry.offset % 64 == 0


def write_scale_value(model: ModelDir, name: str, index: int, value: float) -> Path:
    """Overwrites element `index` (flat) of scale tensor `name` and records the new crc32, so only a check of
    the scale's value can tell."""
    entry = model.entries[name]
    path = model.path / entry.file
    data = bytearray(path.read_bytes())
    at = entry.offset + 4 * index
    data[at : at + 4] = np.float32(value).astype("<f4").tobytes()
    path.write_bytes(bytes(data))
    return edit(model, set_tensor(name, crc32=zlib.crc32(data[entry.offset : entry.offset + entry.nbytes])))


INT8_SCALE = "layers.0.experts.0.gate_proj_scale"  # int8, per channel: [19]
FP8_SCALE = "layers.1.experts.3.down_proj_scale"  # float8_e4m3fn, 128x128 blocks: [1, 1]
BAD_SCALES = [
    (INT8_SCALE, 3, float("nan"), "nan", r"\[3\]"),
    (INT8_SCALE, 7, float("inf"), "inf", r"\[7\]"),
    (INT8_SCALE, 18, 0.0, "0.0", r"\[18\]"),
    (INT8_SCALE, 0, -0.25, "-0.25", r"\[0\]"),
    (FP8_SCALE, 0, float("nan"), "nan", r"\[0, 0\]"),
    (FP8_SCALE, 0, float("inf"), "inf", r"\[0, 0\]"),
    (FP8_SCALE, 0, 0.0, "0.0", r"\[0, 0\]"),
    (FP8_SCALE, 0, -0.25, "-0.25", r"\[0, 0\]"),
    # finite, but 127 (or 448) x the scale overflows float32: the cpu backend dequantised the codes to infinity
    (INT8_SCALE, 4, 2.0**122, re.escape(str(2.0**122)), r"\[4\]"),
    (FP8_SCALE, 0, 2.0**120, re.escape(str(2.0**120)), r"\[0, 0\]"),
]


@pytest.mark.parametrize("name, index, value, shown, at", BAD_SCALES)
def test_a_scale_that_is_not_positive_and_finite_is_refused_on_open(broken, name, index, value, shown, at):
    file = broken.entries[name].file
    path = write_scale_value(broken, name, index, value)
    message = rf"^{re.escape(file)}: invalid scale in tensor {re.escape(name)}: {shown} at {at} \(scales are positive and finite"
    for verify in (False, True):  # the worker opens without the checksum pass: the value check must not need it
        with pytest.raises(ModelFormatError, match=message) as error:
            ModelDir.open(path, verify=verify)
        assert "\n" not in str(error.value)


def test_the_first_bad_scale_is_named(broken):
    write_scale_value(broken, INT8_SCALE, 11, float("nan"))
    path = write_scale_value(broken, INT8_SCALE, 5, -1.0)
    with pytest.raises(ModelFormatError, match=r": -1\.0 at \[5\] "):
        ModelDir.open(path, verify=False)


def test_converted_scales_are_positive_and_finite_and_the_directory_opens(mixed):
    scales = [name for name in mixed.entries if name.endswith("_scale")]
    assert scales and all(np.all(np.isfinite(mixed.tensor(n)) & (mixed.tensor(n) > 0)) for n in scales)
    ModelDir.open(mixed.path, verify=False)
    ModelDir.open(mixed.path)


def test_an_int8_expert_relabelled_fp8_is_refused_for_its_nan_bytes(broken):
    """int8 and per-channel fp8 have the same layout and nbytes, so a manifest naming an int8 expert's matrices
    float8_e4m3fn (checksums unchanged) loaded: its 127s and -1s are e4m3fn's NaN bytes (0x7f/0xff), served as NaN.
    The checksum pass, which reads every byte anyway, refuses them naming the tensor."""
    relabel = [set_tensor(f"layers.0.experts.0.{p}", dtype="float8_e4m3fn") for p in PROJECTIONS]
    path = edit(broken, lambda m: [change(m) for change in relabel])
    raw = broken.raw_bytes(G)
    first = int(np.flatnonzero((raw & 0x7F) == 0x7F)[0])
    message = rf"^experts-L000\.bin: tensor {G}: NaN byte 0x{raw[first]:02x} at byte {first} \(float8_e4m3fn's "
    with pytest.raises(ModelFormatError, match=message) as error:
        ModelDir.open(path)
    assert "\n" not in str(error.value)
    assert ModelDir.open(path, verify=False).tensor(G).dtype == np.uint8  # as checksums, only when verifying
