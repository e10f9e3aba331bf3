"""The checkpoint's JSON files (`config.json`, `model.safetensors.index.json`) as something other than a regular
file, or as JSON the model directory's reader would refuse: one line naming the file and what is there, decided
before OUT_DIR changes, and never a wait on a FIFO."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from colibri.cli import main
from common.model_format import ModelDir
from expert_service.tools.tiny_model import write_tiny_checkpoint

INDEX = "model.safetensors.index.json"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def place(path: Path, kind: str) -> None:
    """Something that is no regular file at `path`: "a FIFO", "a directory" or a link to a character device."""
    path.unlink(missing_ok=True)
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/null")


@pytest.mark.timeout(120)  # reading the FIFO would wait for a writer for ever
@pytest.mark.parametrize("name", ["config.json", INDEX])
@pytest.mark.parametrize("kind", ["a FIFO", "a directory", "a character device"])
def test_a_checkpoint_json_that_is_no_regular_file_is_named_as_such(tmp_path, capsys, name, kind):
    """config.json was reported "not found"; the index was taken for absent and the shards read without it."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "qwen2_moe", seed=3)
    place(hf / name, kind)
    rc, out, err = run_cli(capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress")
    assert (rc, out) == (3, "") and err.count("\n") == 1, (rc, out, err)
    assert err.endswith(f"{hf / name}: not a regular file ({kind})\n"), err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_a_dangling_link_at_a_checkpoint_json_is_named(tmp_path, capsys, name):
    """A Hugging Face cache's snapshot links into blobs; one whose blob is gone is a broken download."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=4)
    (hf / name).unlink(missing_ok=True)
    (hf / name).symlink_to(tmp_path / "gone")
    rc, out, err = run_cli(capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress")
    assert (rc, out) == (3, "") and err == f"colibri convert: error: {hf / name}: not found\n", err


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_a_json_null_index_is_malformed_not_absent(tmp_path, capsys, name):
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=7)
    (hf / name).write_text("null")
    rc, out, err = run_cli(capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress")
    assert rc != 0 and out == "" and err.count("\n") == 1 and "not found" not in err, err


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_a_key_written_twice_in_a_checkpoint_json_is_refused(tmp_path, capsys, name):
    """json.loads kept the last of the two values in silence."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=5)
    if name == INDEX:
        text = '{"metadata": {}, "weight_map": {}, "weight_map": {}}'
    else:
        text = (hf / name).read_text().replace("{", '{"vocab_size": 7, ', 1)
    (hf / name).write_text(text)
    rc, out, err = run_cli(capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress")
    assert (rc, out) == (3, "") and err.count("\n") == 1 and err.startswith(f"colibri convert: error: {hf / name}: ")
    assert "twice" in err or "duplicate" in err.lower(), err


def test_a_regular_index_still_maps_the_tensors(tmp_path, capsys):
    hf = write_tiny_checkpoint(tmp_path / "hf", "olmoe", seed=6)
    from safetensors import safe_open

    with safe_open(hf / "model.safetensors", framework="numpy") as f:
        weight_map = {name: "model.safetensors" for name in f.keys()}
    (hf / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    rc, out, err = run_cli(capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress")
    assert rc == 0, err
    assert ModelDir.open(tmp_path / "m", verify=True).config.family == "olmoe"


@pytest.mark.timeout(120)  # copying from the FIFO would wait for a writer for ever
@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja"])
@pytest.mark.parametrize("kind", ["a FIFO", "a directory", "a character device"])
def test_a_tokenizer_file_that_is_no_regular_file_is_refused_before_out_dir_changes(tmp_path, capsys, name, kind):
    """It was taken for absent: the model lost its tokenizer without a word, and the earlier model's copy in
    OUT_DIR was removed with the rest of it."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", seed=8)
    out = tmp_path / "m"
    rc, _, err = run_cli(capsys, "convert", str(hf), str(out), "--no-progress")
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    place(hf / name, kind)
    rc, out_text, err = run_cli(capsys, "convert", str(hf), str(out), "--no-progress")
    assert (rc, out_text) == (3, "") and err.count("\n") == 1, (rc, out_text, err)
    assert err.endswith(f"{hf / name}: not a regular file ({kind})\n"), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    ModelDir.open(out, verify=True)


@pytest.mark.timeout(20)  # the copy opened a FIFO put there after the check with a blocking open()
def test_a_tokenizer_file_swapped_for_a_fifo_is_refused_by_the_copy_too(tmp_path):
    from common.files import copy_new

    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(OSError, match="not a regular file \\(a FIFO\\)"):
        copy_new(tmp_path / "tokenizer.json", tmp_path / "copy.json")
