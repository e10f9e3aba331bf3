"""The 8-bit LM head in the model directory: where the head and its per-row scale lie, what `ModelDir.head_format`
and `tensor_f32` give, and every corruption of it refused in one line (each test fails if its check goes)."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from common import dtypes, quant
from common.errors import ChecksumError, ModelFormatError
from common.head_format import HEAD_SCHEME
from common.model_format import ModelDir
from common.model_manifest import DENSE_ALIGN, DENSE_FILE, MANIFEST
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import tiny_weights
from tests.common.test_model_format_quant import version_1_copy
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint

V, D = 259, 64


def converted(root: Path, tied: bool, head_dtype: str | None, dtype: str = "bfloat16", **flags) -> ModelDir:
    write_head_checkpoint(root / "hf", head_config("mixtral", tied), seed=3)
    return ModelDir.open(convert(root / "hf", root / "m", dtype, False, head_dtype=head_dtype, **flags))


@pytest.fixture(scope="module", params=[(t, h) for t in (False, True) for h in ("int8", "float8_e4m3fn")])
def head8(request, tmp_path_factory) -> ModelDir:
    tied, head_dtype = request.param
    return converted(tmp_path_factory.mktemp("head"), tied, head_dtype, expert_dtype="int8")


def test_the_head_and_its_scale_are_one_range_at_the_end_of_dense_bin(head8):
    fmt, head, scale = head8.head_format, head8.entries["lm_head"], head8.entries["lm_head_scale"]
    assert fmt is not None and fmt.dtype == head.dtype and fmt.scheme == HEAD_SCHEME == "channel"
    assert (fmt.file, fmt.offset, fmt.shape) == (DENSE_FILE, head.offset, (V, D))
    assert head.offset % DENSE_ALIGN == 0 and fmt.scale_offset % 16 == 0
    assert fmt.scale_offset == scale.offset - head.offset and fmt.nbytes == scale.offset + 4 * V - head.offset
    assert (scale.dtype, scale.shape, scale.file) == ("float32", (V,), DENSE_FILE)
    assert head.nbytes == V * D and scale.offset - (head.offset + head.nbytes) < DENSE_ALIGN  # right after it
    assert max(e.offset + e.nbytes for e in head8.entries.values() if e.file == DENSE_FILE) == scale.offset + 4 * V
    block = head8._map(DENSE_FILE)[fmt.offset : fmt.offset + fmt.nbytes]  # what a kernel views as one block
    assert block[: head.nbytes].tobytes() == head8.raw_bytes("lm_head").tobytes()
    assert block[fmt.scale_offset :].view("<f4").tolist() == head8.tensor("lm_head_scale").tolist()
    for name, entry in head8.entries.items():  # everything else as before: the dense dtype, experts int8
        if name not in ("lm_head", "lm_head_scale") and ".experts." not in name:
            assert entry.dtype == "bfloat16", name
    assert head8.expert_formats == ("int8",)


def test_tensor_f32_dequantises_the_head_exactly(head8):
    head = head8.tensor_f32("lm_head")
    scale = head8.tensor("lm_head_scale")
    raw = head8.tensor("lm_head")
    codes = quant.fp8_to_float32(raw) if head8.head_format.dtype == "float8_e4m3fn" else raw.astype(np.float32)
    assert head.dtype == np.float32 and head.shape == (V, D)
    assert np.array_equal(head, codes * scale[:, None])
    assert np.all(np.isfinite(scale) & (scale > 0))


def test_the_head_is_quantized_from_the_float32_head_or_tied_embedding(head8):
    assert "embed_tokens" in head8.entries and head8.entries["embed_tokens"].dtype == "bfloat16"
    weights = tiny_weights(head_config("mixtral", head8.config.tie_word_embeddings), seed=3)
    # tied: quantized from the embedding (its float32 values, not the bf16 the directory keeps)
    source = weights["model.embed_tokens.weight" if head8.config.tie_word_embeddings else "lm_head.weight"]
    tolerance = {"int8": 1 / 254, "float8_e4m3fn": 1 / 16}[head8.head_format.dtype]
    rows = np.abs(source).max(axis=1, keepdims=True)
    assert np.all(np.abs(head8.tensor_f32("lm_head") - source) <= tolerance * rows * 1.0001)


@pytest.mark.parametrize("tied", [False, True])
def test_a_dense_head_has_no_head_format(tmp_path, tied):
    model = converted(tmp_path, tied, None)
    assert model.head_format is None and "lm_head_scale" not in model.entries
    assert ("lm_head" in model.entries) is not tied


def edit(model: ModelDir, change) -> Path:
    manifest = json.loads((model.path / MANIFEST).read_text())
    change(manifest["tensors"])
    (model.path / MANIFEST).write_text(json.dumps(manifest))
    return model.path


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def broken(request, tmp_path) -> ModelDir:
    return converted(tmp_path, request.param, "int8")


S = "lm_head_scale"
CORRUPTIONS = [
    (lambda t: t.pop(S), rf"^tensor {S}: missing \(the scale of int8 tensor lm_head\)$"),
    (lambda t: t[S].update(shape=[7, 37]), rf"^tensor {S}: float32 \[7, 37\], expected float32 \[{V}\] \(one per row\)$"),
    (lambda t: t[S].update(dtype="float16", nbytes=2 * V), rf"^tensor {S}: float16 \[{V}\], expected float32 \[{V}\]"),
    (lambda t: t[S].update(offset=0), rf"^tensor {S}: stored in dense\.bin at byte 0; the format puts it in dense\.bin "
     r"right after lm_head, at byte \d+$"),
    (lambda t: t[S].update(offset=t[S]["offset"] - DENSE_ALIGN), rf"^tensor {S}: stored in dense\.bin at byte \d+; the"),
    (lambda t: t["lm_head"].update(shape=[D, V]), rf"^tensor lm_head: shape \[{D}, {V}\] in colibri\.json, config\.json "
     rf"implies \[{V}, {D}\]$"),
    (lambda t: t["lm_head"].update(dtype="int4"), r"^tensor lm_head: dtype 'int4' is not supported$"),
    (lambda t: t["layers.0.router"].update(dtype="int8", nbytes=4 * D),
     r"^tensor layers\.0\.router: dtype int8 is only for routed experts' matrices, attention projections and "
     r"lm_head$"),
    (lambda t: t["embed_tokens"].update(dtype="int8", nbytes=V * D),
     r"^tensor embed_tokens: dtype int8 is only for routed experts' matrices, attention projections and lm_head$"),
    (lambda t: t.update({"final_norm_scale": t[S]}), r"^tensor final_norm_scale: a scale for final_norm, which is not 8-bit$"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", CORRUPTIONS)
def test_a_broken_head_is_one_line(broken, change, message):
    with pytest.raises(ModelFormatError, match=message) as error:
        ModelDir.open(edit(broken, change), verify=False)
    assert "\n" not in str(error.value)


def test_a_tied_model_holds_no_dense_dtype_lm_head(tmp_path):
    """Only an 8-bit head may sit beside a tied embedding: a dense one is refused as today (which would the
    logits use?), as is a scale with no head."""
    model = converted(tmp_path, True, "int8")
    dense_head = edit(model, lambda t: (t.update(lm_head=dict(t["embed_tokens"])), t.pop(S)))
    with pytest.raises(ModelFormatError, match=r"^tensor lm_head: not part of a mixtral model of this config$"):
        ModelDir.open(dense_head, verify=False)
    model = converted(tmp_path / "again", True, "int8")
    with pytest.raises(ModelFormatError, match=rf"^tensor {S}: not part of a mixtral model of this config$"):
        ModelDir.open(edit(model, lambda t: t.pop("lm_head")), verify=False)


def test_a_scale_beside_a_dense_head_is_refused(tmp_path):
    model = converted(tmp_path, False, None)
    add = {"file": DENSE_FILE, "offset": 0, "nbytes": 4 * V, "dtype": "float32", "shape": [V], "crc32": 0}
    with pytest.raises(ModelFormatError, match=rf"^tensor {S}: a scale for lm_head, which is not 8-bit$"):
        ModelDir.open(edit(model, lambda t: t.update({S: add})), verify=False)


def test_a_dense_head_in_another_dtype_than_the_manifests_is_still_refused(tmp_path):
    model = converted(tmp_path, False, None)
    # the rule for the head, which may be 8-bit: not "every tensor other than routed experts'", which reads as if an
    # 8-bit head were refused too
    message = r"^tensor lm_head: dtype float16, but lm_head is the manifest's dtype bfloat16 or 8-bit \(int8, float8_e4m3fn\)$"
    with pytest.raises(ModelFormatError, match=message):
        ModelDir.open(edit(model, lambda t: t["lm_head"].update(dtype="float16")), verify=False)


def write_scale_value(model: ModelDir, index: int, value: float) -> Path:
    """Element `index` of the head's scale set to `value`, its crc32 recorded: only the value check can tell."""
    entry = model.entries[S]
    path = model.path / DENSE_FILE
    data = bytearray(path.read_bytes())
    data[entry.offset + 4 * index : entry.offset + 4 * index + 4] = np.float32(value).astype("<f4").tobytes()
    path.write_bytes(bytes(data))
    crc = zlib.crc32(data[entry.offset : entry.offset + entry.nbytes])
    return edit(model, lambda t: t[S].update(crc32=crc))


BAD_SCALES = [
    *[
        (h, v, shown)
        for h in ("int8", "float8_e4m3fn")
        for v, shown in ((np.nan, "nan"), (np.inf, "inf"), (0.0, "0.0"))
    ],
    ("int8", -0.5, "-0.5"),
    ("float8_e4m3fn", -2.0, "-2.0"),
    # finite, but 127 (or 448) x the scale overflows float32: the head's codes would dequantise to infinity
    ("int8", 2.0**122, re.escape(str(2.0**122))),
    ("float8_e4m3fn", 2.0**120, re.escape(str(2.0**120))),
]


@pytest.mark.parametrize("head_dtype, value, shown", BAD_SCALES)
def test_a_scale_that_is_not_positive_and_finite_is_refused_on_open(tmp_path, head_dtype, value, shown):
    path = write_scale_value(converted(tmp_path, False, head_dtype), 5, value)
    limit = re.escape(f"{float(quant.MAX_SCALE[head_dtype]):g}")
    message = (
        rf"^dense\.bin: invalid scale in tensor {S}: {shown} at \[5\] \(scales are positive and finite, "
        rf"{head_dtype} ones at most {limit}; corrupted\?\)$"
    )
    for verify in (False, True):  # the worker may skip the checksums: the value check must not need them
        with pytest.raises(ModelFormatError, match=message):
            ModelDir.open(path, verify=verify)


@pytest.mark.parametrize("name", ["lm_head", S])
def test_a_flipped_byte_in_the_head_or_its_scale_fails_its_checksum(broken, name):
    entry = broken.entries[name]
    path = broken.path / DENSE_FILE
    data = bytearray(path.read_bytes())
    data[entry.offset + 3] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=rf"^dense\.bin: checksum mismatch in tensor {name} \(crc32 "):
        ModelDir.open(broken.path)


def test_an_int8_head_relabelled_fp8_is_refused_for_its_nan_bytes(broken):
    """int8 and fp8 heads have the same size and scale: the labels alone cannot tell them apart, the NaN bytes
    (0x7f/0xff: int8's 127 and -1) can, when the checksums are verified."""
    raw = broken.raw_bytes("lm_head")
    first = int(np.flatnonzero((raw & 0x7F) == 0x7F)[0])
    path = edit(broken, lambda t: t["lm_head"].update(dtype="float8_e4m3fn"))
    message = rf"^dense\.bin: tensor lm_head: NaN byte 0x{raw[first]:02x} at byte {first} \(float8_e4m3fn's NaN"
    with pytest.raises(ModelFormatError, match=message):
        ModelDir.open(path)
    assert ModelDir.open(path, verify=False).head_format.dtype == "float8_e4m3fn"


def test_a_version_1_directory_with_an_8bit_head_is_refused(tmp_path):
    model = converted(tmp_path, False, "int8")
    v1 = version_1_copy(model, tmp_path / "v1", lambda expert: expert)
    with pytest.raises(ModelFormatError, match=r"^tensor lm_head: dtype int8 in a version-1 directory, whose tensors "
                       r"are all bfloat16"):  # fmt: skip
        ModelDir.open(v1)


def test_crc_of_the_head_and_its_scale_are_recorded(head8):
    for name in ("lm_head", S):
        entry = head8.entries[name]
        assert entry.crc32 == zlib.crc32(head8.raw_bytes(name).tobytes())
        assert head8.tensor(name).dtype == dtypes.STORAGE[entry.dtype]
