"""The converter: checkpoints from transformers' save_pretrained (fp32, bf16) and from make-tiny's generator,
sharded checkpoints, --dtype conversions and the checkpoints it must refuse."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from colibri.cli import main
from common.errors import ModelFormatError
from common.model_format import ModelDir
from common.models import FAMILIES, tensor_specs
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import tiny_hf_config, write_tiny_checkpoint
from tests.helpers import serve_env

# Sizes that are not multiples of 32 and expert counts that are not powers of two.
ODD_SIZES = dict(
    vocab_size=101,
    hidden_size=40,
    intermediate_size=56,
    num_attention_heads=4,
    num_key_value_heads=1,
    max_position_embeddings=256,
)
ODD_EXPERTS = {
    "mixtral": dict(num_local_experts=3, num_experts_per_tok=1),
    "qwen2_moe": dict(
        num_experts=5, moe_intermediate_size=24, shared_expert_intermediate_size=36, num_experts_per_tok=3
    ),
    "qwen3_moe": dict(num_experts=3, moe_intermediate_size=24, head_dim=12, num_experts_per_tok=2),
    "olmoe": dict(num_experts=6, num_experts_per_tok=4, clip_qkv=4.0),
}


def save_transformers(path: Path, family: str, dtype=torch.float32, **overrides) -> Path:
    """A tiny randomly initialised transformers model of `family`, saved with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = {**tiny_hf_config(family), **overrides}
    for key in ("model_type", "architectures", "dtype"):
        hf.pop(key)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **hf), dtype=dtype)
    with torch.no_grad():  # transformers initialises norms to exactly 1; make every tensor distinctive
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    return path


def source_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """HF name -> storage array (bfloat16 as uint16 words) read with the safetensors library."""
    out = {}
    for shard in hf_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
    return out


def assert_bitwise_equal(model: ModelDir, source: dict[str, np.ndarray]) -> None:
    specs = tensor_specs(model.config)
    assert set(model.entries) == {s.name for s in specs}
    for spec in specs:
        got, want = model.tensor(spec.name), source[spec.hf_name]
        assert got.dtype == want.dtype and got.shape == want.shape, spec.name
        assert got.tobytes() == want.tobytes(), spec.name


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what the test's setup printed (transformers' progress bars)
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("sizes", ["tiny", "odd"])
def test_transformers_checkpoint_round_trip(tmp_path, family, sizes):
    overrides = {**ODD_SIZES, **ODD_EXPERTS[family]} if sizes == "odd" else {}
    hf_dir = save_transformers(tmp_path / "hf", family, **overrides)
    model = ModelDir.open(convert(hf_dir, tmp_path / "model", progress=False))
    assert model.dtype == "float32"
    assert_bitwise_equal(model, source_tensors(hf_dir))


def test_bf16_checkpoint_stays_raw_bf16(tmp_path):
    hf_dir = save_transformers(tmp_path / "hf", "qwen3_moe", dtype=torch.bfloat16)
    model = ModelDir.open(convert(hf_dir, tmp_path / "model", progress=False))
    assert model.dtype == "bfloat16"
    assert all(e.dtype == "bfloat16" for e in model.entries.values())
    assert_bitwise_equal(model, source_tensors(hf_dir))


def split_into_shards(src: Path, dst: Path, with_index: bool = True) -> Path:
    """The single-file checkpoint at `src` as two shards (+ model.safetensors.index.json) in `dst`."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(src / name, dst / name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, dst / file, metadata={"format": "pt"})
    if with_index:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": {k: file for file, keys in halves.items() for k in keys},
        }
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_checkpoint_converts_to_identical_files(tmp_path, with_index):
    single = write_tiny_checkpoint(tmp_path / "single", "qwen2_moe", seed=3)
    sharded = split_into_shards(single, tmp_path / "sharded", with_index)
    a = convert(single, tmp_path / "a", progress=False)
    b = convert(sharded, tmp_path / "b", progress=False)
    for file in ["dense.bin", "experts-L000.bin", "tokenizer.json"]:
        assert (a / file).read_bytes() == (b / file).read_bytes(), file
    assert json.loads((a / "colibri.json").read_text()) == json.loads((b / "colibri.json").read_text())


def test_index_naming_a_missing_shard_is_refused(tmp_path):
    sharded = split_into_shards(write_tiny_checkpoint(tmp_path / "single"), tmp_path / "sharded")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="missing shard model-00002-of-00002.safetensors"):
        convert(sharded, tmp_path / "out", progress=False)


def test_index_naming_the_wrong_shard_is_one_line(tmp_path, capsys):
    sharded = split_into_shards(write_tiny_checkpoint(tmp_path / "single"), tmp_path / "sharded")
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    other = shards[1 - shards.index(index["weight_map"]["lm_head.weight"])]
    index["weight_map"]["lm_head.weight"] = other
    index_path.write_text(json.dumps(index))
    rc, out, err = run_cli(capsys, "convert", str(sharded), str(tmp_path / "out"), "--no-progress")
    assert rc == 3 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"tensor lm_head.weight maps to shard {other}, which does not hold it" in err


def test_a_tensor_in_two_shards_without_an_index_is_refused(tmp_path):
    sharded = split_into_shards(write_tiny_checkpoint(tmp_path / "single"), tmp_path / "sharded", with_index=False)
    name = "model.layers.0.self_attn.q_proj.weight"
    first = load_file(sharded / "model-00001-of-00002.safetensors")
    holder = "model-00001-of-00002.safetensors" if name in first else "model-00002-of-00002.safetensors"
    save_file({name: np.zeros_like(load_file(sharded / holder)[name])}, sharded / "model-extra.safetensors")
    with pytest.raises(ModelFormatError, match=f"tensor {name} is in both {holder} and model-extra.safetensors"):
        convert(sharded, tmp_path / "out", progress=False)


def test_truncated_shard_is_refused_naming_the_file(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    shard = hf_dir / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: not a valid safetensors file"):
        convert(hf_dir, tmp_path / "out", progress=False)


def test_dtype_conversions(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=1)
    source = load_file(hf_dir / "model.safetensors")
    bf16 = ModelDir.open(convert(hf_dir, tmp_path / "bf16", dtype="bfloat16", progress=False))
    fp16 = ModelDir.open(convert(hf_dir, tmp_path / "fp16", dtype="float16", progress=False))
    for spec in tensor_specs(bf16.config):
        want_bf16 = source[spec.hf_name].astype(ml_dtypes.bfloat16).view(np.uint16)
        assert np.array_equal(bf16.tensor(spec.name), want_bf16), spec.name
        assert np.array_equal(fp16.tensor(spec.name), source[spec.hf_name].astype(np.float16)), spec.name
    # Widening is exact: bf16 -> fp32 gives back the bf16 values.
    (tmp_path / "hf_bf16").mkdir()
    shutil.copyfile(hf_dir / "config.json", tmp_path / "hf_bf16" / "config.json")
    save_file(
        {s.hf_name: np.asarray(bf16.tensor(s.name)) for s in tensor_specs(bf16.config)},
        tmp_path / "hf_bf16" / "model.safetensors",
    )  # numpy has no bf16: fix the header below
    retag_as_bf16(tmp_path / "hf_bf16" / "model.safetensors")
    fp32 = ModelDir.open(convert(tmp_path / "hf_bf16", tmp_path / "fp32", dtype="float32", progress=False))
    name = "layers.0.experts.1.up_proj"
    assert np.array_equal(fp32.tensor(name), bf16.tensor_f32(name))


def retag_as_bf16(path: Path) -> None:
    """Rewrites the dtype of every U16 tensor in a safetensors header to BF16 (numpy cannot write bf16)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].decode().rstrip().replace('"U16"', '"BF16"').encode()
    header = header.ljust(-(-len(header) // 8) * 8)  # keep the data 8-byte aligned, as safetensors does
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])


def test_bf16_to_fp16_overflow_is_refused_naming_the_tensor(tmp_path, capsys):
    hf_dir = save_transformers(tmp_path / "hf", "olmoe", dtype=torch.bfloat16)
    tensors = source_tensors(hf_dir)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][0, 3] = np.array([1.0e5], dtype=ml_dtypes.bfloat16).view(np.uint16)[0]
    save_file(tensors, hf_dir / "model.safetensors")
    retag_as_bf16(hf_dir / "model.safetensors")
    rc, out, err = run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--dtype", "float16", "--no-progress")
    assert rc == 3 and err.count("\n") == 1 and "Traceback" not in err
    assert name in err and "overflow" in err and "65504" in err
    # Keeping bf16 (or bf16 -> fp32) is fine.
    assert run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "ok"), "--no-progress")[0] == 0


def test_pickle_only_checkpoint_is_refused(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(tiny_hf_config("mixtral")))
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, hf_dir / "pytorch_model.bin")
    rc, out, err = run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--no-progress")
    assert rc == 3 and err.count("\n") == 1 and "Traceback" not in err
    assert "pytorch_model.bin" in err and "never loaded" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config_text, expected",
    [
        (None, "config.json: not found"),
        ("{not json", "config.json: not valid JSON"),
        (
            json.dumps({**tiny_hf_config("mixtral"), "model_type": "llama"}),
            "model_type 'llama' is not supported (supported: mixtral, olmoe, qwen2_moe, qwen3_moe)",
        ),
    ],
)
def test_bad_config_json_is_one_line(tmp_path, capsys, config_text, expected):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    if config_text is None:
        (hf_dir / "config.json").unlink()
    else:
        (hf_dir / "config.json").write_text(config_text)
    rc, out, err = run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--no-progress")
    assert rc != 0 and err.count("\n") == 1 and expected in err and "Traceback" not in err


def test_missing_checkpoint_tensor_is_named(tmp_path, capsys):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, hf_dir / "model.safetensors")
    rc, out, err = run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--no-progress")
    assert rc == 3 and "model.layers.1.block_sparse_moe.experts.3.w2.weight" in err


def test_a_checkpoint_refused_for_its_shapes_leaves_the_existing_model_dir_alone(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    convert(hf_dir, tmp_path / "out", progress=False)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :10].copy()  # the last tensor written
    save_file(tensors, hf_dir / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"tensor lm_head.weight has shape \[259, 10\], config.json implies"):
        convert(hf_dir, tmp_path / "out", progress=False)
    ModelDir.open(tmp_path / "out")  # checksums included: nothing of it was touched


def test_a_conversion_failing_halfway_leaves_no_manifest_of_an_earlier_model(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    convert(hf_dir, tmp_path / "out", dtype="float16", progress=False)  # the same layout as the failing one
    tensors = load_file(hf_dir / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    tensors[name][0, 0] = 1e5  # refused while converting, after the earlier tensors were written
    save_file(tensors, hf_dir / "model.safetensors")
    with pytest.raises(ModelFormatError, match=f"tensor {name}: converting float32 to float16 would overflow"):
        convert(hf_dir, tmp_path / "out", dtype="float16", progress=False)
    with pytest.raises(ModelFormatError, match="colibri.json: not found"):
        ModelDir.open(tmp_path / "out", verify=False)


@pytest.mark.parametrize(
    "family, change, named",
    [
        ("mixtral", {"num_hidden_layers": 1}, "model.layers.1.block_sparse_moe.experts.0.w1.weight"),
        ("qwen2_moe", {"qkv_bias": False}, "model.layers.0.self_attn.k_proj.bias"),
        ("mixtral", {"tie_word_embeddings": True}, "lm_head.weight"),
    ],
)  # fmt: skip
def test_checkpoint_tensors_this_config_would_drop_are_refused(tmp_path, capsys, family, change, named):
    """A config.json that says fewer layers, no biases or tied embeddings where the checkpoint holds them
    would convert another model than the checkpoint's."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", family)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    rc, out, err = run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--no-progress")
    assert rc == 3 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"checkpoint tensor {named} is not part of the {family} model config.json describes" in err


def test_tensors_the_family_does_not_name_and_a_tied_copy_of_the_embedding_are_ignored(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "mixtral")
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, dtype=np.float32)
    save_file(tensors, hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = ModelDir.open(convert(hf_dir, tmp_path / "out", progress=False))
    assert "lm_head" not in model.entries and model.config.tie_word_embeddings


def test_convert_cli_summary_and_tokenizer_files(tmp_path, capsys):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "qwen3_moe")
    rc, out, err = run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--dtype", "bfloat16")
    assert rc == 0 and out.count("\n") == 1
    assert "qwen3_moe" in out and "45 tensors" in out and "bfloat16" in out
    model = ModelDir.open(tmp_path / "out")
    assert model.manifest["tokenizer_files"] == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()


def test_reconverting_leaves_no_tokenizer_file_of_the_earlier_model(tmp_path):
    """The router and worker read tokenizer.json, the chat template and generation defaults from the model
    directory by name: a checkpoint without them converted over another model served the other's."""
    earlier = write_tiny_checkpoint(tmp_path / "earlier", "mixtral")
    (earlier / "generation_config.json").write_text('{"temperature": 0.6}')
    bare = write_tiny_checkpoint(tmp_path / "bare", "olmoe", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bare / name).unlink()
    convert(earlier, tmp_path / "m", progress=False)
    kept = convert(bare, tmp_path / "m", progress=False)
    model = ModelDir.open(kept)
    assert model.manifest["tokenizer_files"] == [] and model.tokenizer_path() is None
    files = ["colibri.json", "dense.bin", "experts-L000.bin", "experts-L001.bin"]
    assert sorted(p.name for p in kept.iterdir()) == files


def test_converting_into_the_checkpoint_directory_is_refused_before_writing(tmp_path, capsys):
    """It failed on copying config.json onto itself, after writing dense.bin and the expert files beside the
    checkpoint's own."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    before = sorted(p.name for p in hf_dir.iterdir())
    rc, out, err = run_cli(capsys, "convert", str(hf_dir), str(hf_dir / "."), "--no-progress")
    assert rc != 0 and err.count("\n") == 1 and "the output directory is the checkpoint's" in err, err
    assert sorted(p.name for p in hf_dir.iterdir()) == before


@pytest.mark.parametrize("link", ["symlink", "hard link"])
@pytest.mark.parametrize(
    "name", ["dense.bin", "experts-L001.bin", "tokenizer.json", "colibri.json.tmp", "colibri.json"]
)
def test_a_link_in_the_output_directory_is_replaced_not_written_through(tmp_path, link, name):
    """Every file went through os.open(O_TRUNC) or shutil.copyfile, which follow a symlink (and write into a hard
    link's shared file): OUT_DIR/dense.bin -> /etc/something, or into another model, was overwritten."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    outside = tmp_path / "elsewhere" / "precious"
    outside.parent.mkdir()
    outside.write_bytes(b"not the converter's")
    out = tmp_path / "out"
    out.mkdir()
    if link == "symlink":
        (out / name).symlink_to(outside)
    else:
        (out / name).hardlink_to(outside)
    ModelDir.open(convert(hf_dir, out, progress=False))  # checksums included
    assert outside.read_bytes() == b"not the converter's"
    assert not (out / name).is_symlink() and (name == "colibri.json.tmp") != (out / name).exists()
    if name == "tokenizer.json":
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes()


def test_an_empty_out_dir_is_refused_in_one_line_instead_of_converting_into_the_working_directory(
    tmp_path, capsys, monkeypatch
):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "mixtral")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rc, out, err = run_cli(capsys, "convert", str(hf_dir), "", "--no-progress")
    assert (rc, out, err) == (2, "", "colibri convert: error: OUT_DIR: empty (name the model directory to write)\n")
    assert list(work.iterdir()) == []


class FullDisk:
    """A disk with `free` bytes left: a write beyond them is cut short, and the next one fails with ENOSPC, as
    the kernel does. It counts pwrite (the tensors) and the file objects' writes (tokenizer copies, manifest)."""

    def __init__(self, monkeypatch, free: int):
        self.free = free
        real_pwrite, real_fdopen = os.pwrite, os.fdopen

        def pwrite(fd, data, offset):
            return real_pwrite(fd, memoryview(data)[: self.take(len(data))], offset)

        disk = self

        class File(io.RawIOBase):
            def __init__(self, fd):
                self.real = real_fdopen(fd, "wb", buffering=0)

            def writable(self):
                return True

            def write(self, data):
                return self.real.write(memoryview(data)[: disk.take(len(data))])

            def close(self):
                self.real.close()
                super().close()

        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(  # writes only: the checkpoint's files are read through os.fdopen too
            os,
            "fdopen",
            lambda fd, mode="r", *a, **k: (
                io.BufferedWriter(File(fd)) if "w" in mode else real_fdopen(fd, mode, *a, **k)
            ),
        )

    def take(self, n: int) -> int:
        if self.free == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = min(n, self.free)
        self.free -= n
        return n


@pytest.mark.parametrize(
    "free, named",
    # the tiny float32 model writes dense tensors from byte 0, expert 0 of layer 0 from 116,992, 824,064 in all,
    # then tokenizer.json (5,395 bytes), tokenizer_config.json and chat_template.jinja (2,281), the manifest
    [(1000, "dense.bin"), (120_000, "experts-L000.bin"), (824_064 + 1000, "tokenizer.json"),
     (824_064 + 7_676 + 1000, "colibri.json")],
)  # fmt: skip
def test_a_full_disk_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, free, named):
    """A tensor write cut short by a full disk was refused as a malformed model ('short write', exit 3), and a
    full disk under a tokenizer copy or the manifest said only 'No space left on device'. Either way nothing
    loads: no manifest is left, not even a half-written one."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    out = tmp_path / "out"
    FullDisk(monkeypatch, free)
    rc, _, err = run_cli(capsys, "convert", str(hf_dir), str(out), "--no-progress")
    monkeypatch.undo()
    assert (rc, err) == (1, f"colibri convert: error: {out / named}: No space left on device\n")
    assert not (out / "colibri.json").exists() and not (out / "colibri.json.tmp").exists()
    rc, _, err = run_cli(capsys, "convert", str(hf_dir), str(out), "--no-progress")  # space again: a rerun works
    assert rc == 0, err
    ModelDir.open(out)


def test_an_out_dir_that_is_a_file_is_named_as_such(tmp_path, capsys):
    """mkdir's error said only 'File exists'."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    (tmp_path / "out").write_text("a file")
    rc, _, err = run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--no-progress")
    assert (rc, err) == (1, f"colibri convert: error: {tmp_path / 'out'}: exists and is not a directory\n")
    assert (tmp_path / "out").read_text() == "a file"


@pytest.mark.parametrize("kind", ["directory", "fifo", "dangling link"])
def test_a_shard_name_that_is_no_file_is_one_line_not_a_hang(tmp_path, kind):
    """safe_open blocked for ever on a FIFO named *.safetensors (holding the GIL: a subprocess, so the test can end
    it), and of a directory said 'No such device (os error 19)', naming no file."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    odd = hf_dir / "extra.safetensors"
    {"directory": odd.mkdir, "fifo": lambda: os.mkfifo(odd), "dangling link": lambda: odd.symlink_to("gone")}[kind]()
    command = [sys.executable, "-m", "colibri.cli", "convert", str(hf_dir), str(tmp_path / "out"), "--no-progress"]
    try:
        done = subprocess.run(command, capture_output=True, timeout=60, env=serve_env())
    except subprocess.TimeoutExpired:
        pytest.fail("a FIFO shard blocked the conversion")
    what = {"directory": "not a regular file (a directory)", "fifo": "not a regular file (a FIFO)"}
    message = f"colibri convert: error: {odd}: {what.get(kind, 'a link to nothing')}; every *.safetensors here is "
    message += "read as a shard\n"
    assert (done.returncode, done.stderr.decode()) == (ModelFormatError.exit_code, message)


def test_a_git_lfs_pointer_is_named_as_such(tmp_path, capsys):
    """A hub repository cloned without git-lfs holds pointers: 'header too large' said nothing of it."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    (hf_dir / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 828624\n"
    )
    rc, _, err = run_cli(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--no-progress")
    assert (rc, err) == (
        ModelFormatError.exit_code,
        f"colibri convert: error: {hf_dir / 'model.safetensors'}: a Git LFS pointer, not the weights "
        "(run `git lfs pull` in the checkpoint's clone)\n",
    )
