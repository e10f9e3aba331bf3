"""The model directory format: round trip for every family, the layout rules, and the writer's checks.

Checkpoints come from make-tiny's generator here; tests/expert_service/tools/test_convert.py covers checkpoints
saved by transformers. The reader's one-line errors are exercised through the CLI in test_cli_offline.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from common.errors import ModelFormatError
from common.expert_layout import EXPERT_ALIGN
from common.model_format import ModelDir, read_manifest_config
from common.model_manifest import DENSE_ALIGN, DENSE_FILE, MANIFEST, expert_file, plan_layout
from common.model_writer import ModelWriter
from common.models import FAMILIES, config_from_hf, tensor_specs
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import tiny_hf_config, tiny_weights, write_tiny_checkpoint


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory):
    """(family, HF checkpoint dir, converted ModelDir) for each family."""
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = write_tiny_checkpoint(root / "hf", request.param, seed=7)
    return request.param, hf_dir, ModelDir.open(convert(hf_dir, root / "model", progress=False))


def test_round_trip_is_bitwise(converted):
    family, hf_dir, model = converted
    source = load_file(hf_dir / "model.safetensors")
    specs = tensor_specs(model.config)
    assert model.config.family == family and model.dtype == "float32"
    assert set(model.entries) == {s.name for s in specs} and len(source) == len(specs)
    for spec in specs:
        assert model.tensor(spec.name).tobytes() == source[spec.hf_name].tobytes(), spec.name
        assert np.array_equal(model.tensor_f32(spec.name), source[spec.hf_name])
    assert model.hf_config == json.loads((hf_dir / "config.json").read_text())


def test_expert_blocks_are_contiguous_and_aligned(converted):
    _, _, model = converted
    config = model.config
    F, D, size = config.moe_intermediate_size, config.hidden_size, 4
    assert model.expert_stride % EXPERT_ALIGN == 0 and model.expert_stride >= 3 * F * D * size
    for layer in config.moe_layers:
        for expert in range(config.num_experts):
            file, offset, nbytes = model.expert_block(layer, expert)
            assert file == expert_file(layer)
            assert offset % EXPERT_ALIGN == 0 and offset == expert * model.expert_stride
            assert nbytes == 3 * F * D * size
            prefix = f"layers.{layer}.experts.{expert}."
            gate, up, down = (model.entries[prefix + m] for m in ("gate_proj", "up_proj", "down_proj"))
            assert gate.offset == offset and up.offset == gate.offset + gate.nbytes
            assert down.offset == up.offset + up.nbytes and down.offset + down.nbytes == offset + nbytes
            # One block = one copy: its bytes are exactly the three matrices back to back.
            block = model._map(file)[offset : offset + nbytes]
            parts = [model.raw_bytes(prefix + m) for m in ("gate_proj", "up_proj", "down_proj")]
            assert block.tobytes() == b"".join(p.tobytes() for p in parts)


def test_dense_tensors_live_in_dense_file_aligned(converted):
    _, _, model = converted
    expert_names = {s.name for s in tensor_specs(model.config) if s.expert is not None}
    for name, entry in model.entries.items():
        if name in expert_names:
            continue
        assert entry.file == DENSE_FILE and entry.offset % DENSE_ALIGN == 0, name
    dense = sorted((e for e in model.entries.values() if e.file == DENSE_FILE), key=lambda e: e.offset)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(dense, dense[1:]))  # no overlap


def test_qwen2_dense_layer_has_no_expert_file(tmp_path):
    model = ModelDir.open(convert(write_tiny_checkpoint(tmp_path / "hf", "qwen2_moe"), tmp_path / "m", progress=False))
    assert model.config.sparse_layers == (True, False)
    assert (tmp_path / "m" / expert_file(0)).is_file() and not (tmp_path / "m" / expert_file(1)).exists()
    assert "layers.1.gate_proj" in model.entries and "layers.0.shared_expert_gate" in model.entries


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layout_is_a_pure_function_of_config_and_dtype(dtype):
    config = config_from_hf(tiny_hf_config("olmoe"))
    a, stride_a = plan_layout(config, dtype)
    b, stride_b = plan_layout(config, dtype)
    assert a == b and stride_a == stride_b and all(s % EXPERT_ALIGN == 0 for s in stride_a.values())
    assert all(e.dtype == dtype for e in a.values())


def test_writer_accepts_any_order(tmp_path):
    hf_config = tiny_hf_config("qwen3_moe")
    weights = tiny_weights(hf_config, seed=2)
    specs = tensor_specs(config_from_hf(hf_config))
    dirs = []
    for order in (specs, specs[::-1]):
        writer = ModelWriter(tmp_path / f"m{len(dirs)}", hf_config, "float32")
        for spec in order:
            writer.write(spec.name, weights[spec.hf_name])
        dirs.append(writer.finish())
    for file in [DENSE_FILE, expert_file(0), expert_file(1), MANIFEST]:
        assert (dirs[0] / file).read_bytes() == (dirs[1] / file).read_bytes(), file


def test_writer_rejects_wrong_tensors_and_unfinished_models(tmp_path):
    hf_config = tiny_hf_config("mixtral")
    writer = ModelWriter(tmp_path / "m", hf_config, "float16")
    with pytest.raises(ModelFormatError, match="tensor layers.9.q_proj: not part of a mixtral model"):
        writer.write("layers.9.q_proj", np.zeros((64, 64), np.float16))
    with pytest.raises(ModelFormatError, match=r"tensor final_norm: expected float16 \[64\], got float32 \[64\]"):
        writer.write("final_norm", np.zeros(64, np.float32))
    with pytest.raises(ModelFormatError, match=r"tensor final_norm: expected float16 \[64\], got float16 \[65\]"):
        writer.write("final_norm", np.zeros(65, np.float16))
    writer.write("final_norm", np.ones(64, np.float16))
    with pytest.raises(ModelFormatError, match="never written"):
        writer.finish()
    assert not (tmp_path / "m" / MANIFEST).exists()


def test_manifest_records_format_and_tokenizer(converted):
    _, hf_dir, model = converted
    manifest = json.loads((model.path / MANIFEST).read_text())
    assert manifest["format"] == "colibri" and manifest["format_version"] == 2
    assert manifest["tokenizer_files"] == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    config, read_back = read_manifest_config(model.path)
    assert config == model.config and read_back == manifest
    assert model.tokenizer_path() == model.path / "tokenizer.json"


def test_reader_rejects_an_expert_that_is_not_one_contiguous_block(tmp_path):
    """A manifest edited so an expert's matrices are no longer back to back is refused on load, since the
    worker copies each expert as one byte range."""
    import shutil

    src = convert(write_tiny_checkpoint(tmp_path / "hf"), tmp_path / "model", progress=False)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    manifest = json.loads((bad / MANIFEST).read_text())
    up = manifest["tensors"]["layers.1.experts.2.up_proj"]
    up["offset"] += 64
    (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ModelFormatError, match=r"layers\.1\.experts\.2\..*not one 4096-byte-aligned block"):
        ModelDir.open(bad, verify=False)


@pytest.mark.parametrize("seed", range(4))
def test_reader_rejects_a_tensor_whose_bytes_overlap_anothers(tmp_path, seed):
    """A manifest pointing a dense tensor into another one's bytes (its crc32 taken over those bytes, so every
    checksum matches) loaded: two tensors read one range, and the model ran weights its checkpoint never had."""
    import shutil
    import zlib

    rng = np.random.default_rng(seed)
    src = convert(write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=seed), tmp_path / "model", progress=False)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    manifest = json.loads((bad / MANIFEST).read_text())
    tensors = manifest["tensors"]
    dense = sorted((n for n, e in tensors.items() if e["file"] == DENSE_FILE), key=lambda n: tensors[n]["offset"])
    moved = dense[rng.integers(len(dense))]
    others = [n for n in dense if n != moved]
    into = others[rng.integers(len(others))]
    size = (bad / DENSE_FILE).stat().st_size
    nbytes, start, end = (
        tensors[moved]["nbytes"],
        tensors[into]["offset"],
        tensors[into]["offset"] + tensors[into]["nbytes"],
    )
    # a 64-byte-aligned start inside `into` from which `moved` still fits in the file
    candidates = [o for o in range(start, min(end, size - nbytes + 1), DENSE_ALIGN) if o != tensors[moved]["offset"]]
    offset = int(candidates[rng.integers(len(candidates))])
    tensors[moved].update(offset=offset, crc32=zlib.crc32((bad / DENSE_FILE).read_bytes()[offset : offset + nbytes]))
    (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        ModelFormatError, match=r"^tensor .*: bytes \d+\.\.\.\d+ of dense\.bin overlap tensor "
    ) as error:
        ModelDir.open(bad)
    assert moved in str(error.value) and "\n" not in str(error.value)


def test_a_model_path_that_is_a_file_is_named_as_no_directory(tmp_path):
    """A checkpoint file given as the model read '<file>/colibri.json: Not a directory', naming a path that
    cannot exist."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"weights")
    with pytest.raises(ModelFormatError) as error:
        ModelDir.open(path)
    assert str(error.value) == (f"{path} is not a directory (a Colibri model is one; make one with `colibri convert`)")
