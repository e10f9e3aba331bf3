"""A conversion that fails, wherever it fails, leaves no file of the checkpoint or of OUT_DIR open or mapped: not
while the error is still held (a caller keeping it, a test's excinfo), and not after."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from common.errors import ModelFormatError
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import tiny_hf_config, write_tiny_checkpoint
from tests.expert_service.tools.fp8_checkpoint import write_fp8_checkpoint
from tests.expert_service.tools.test_convert_quant import EXPERT, nan_byte, rewrite


def open_under(directory: Path) -> list[str]:
    """The files under `directory` this process holds a descriptor of or has mapped."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used, closed by now
            pass
    with open("/proc/self/maps") as maps:
        held += [line.split(maxsplit=5)[-1].strip() for line in maps]
    return sorted(path for path in held if path.startswith(str(directory)))


def fail_after(monkeypatch, call: str, count: int) -> None:
    """A disk that fills up after `count` calls of os.`call` (pwrite: the tensors; ftruncate: sizing the files)."""
    real, calls = getattr(os, call), [0]

    def failing(*args):
        calls[0] += 1
        if calls[0] > count:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    monkeypatch.setattr(os, call, failing)


def second_shard_invalid(hf: Path) -> type[Exception]:
    (hf / "zz.safetensors").write_bytes(b"\x08" + bytes(7) + b"not json")  # opened after model.safetensors
    return ModelFormatError


def index_refused(hf: Path) -> type[Exception]:
    (hf / "model.safetensors.index.json").write_text('{"weight_map": {"x.weight": "gone.safetensors"}}')
    return ModelFormatError


def tensor_missing(hf: Path) -> type[Exception]:
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), "float32")}, hf / "model.safetensors")
    return ModelFormatError


@pytest.mark.parametrize("break_checkpoint", [second_shard_invalid, index_refused, tensor_missing])
def test_a_checkpoint_refused_before_writing_leaves_nothing_open(tmp_path, break_checkpoint):
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=1)
    error = break_checkpoint(hf)
    with pytest.raises(error) as failed:
        convert(hf, tmp_path / "m", progress=False)
    assert open_under(tmp_path) == [], failed.value


@pytest.mark.parametrize("call, count", [("ftruncate", 1), ("pwrite", 0), ("pwrite", 5), ("pwrite", 40)])
def test_a_write_failing_part_way_leaves_nothing_open(tmp_path, monkeypatch, call, count):
    """The shards' maps were closed only once every tensor was written, the model's files only by finish():
    a failure in between left both open until the error was dropped, the model's files for good."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "qwen2_moe", seed=2)
    fail_after(monkeypatch, call, count)
    with pytest.raises(OSError, match="No space left on device") as failed:
        convert(hf, tmp_path / "m", progress=False)
    assert open_under(tmp_path) == [], failed.value


def test_an_fp8_tensor_refused_while_writing_leaves_nothing_open(tmp_path):
    """Its block scales, read up front as views of the shard's map, kept it mapped."""
    write_fp8_checkpoint(tmp_path / "hf", tiny_hf_config("qwen3_moe"))
    rewrite(tmp_path / "hf", nan_byte)
    with pytest.raises(ModelFormatError, match=f"tensor {EXPERT}: fp8 weights hold NaN bytes") as failed:
        convert(tmp_path / "hf", tmp_path / "m", progress=False)
    assert open_under(tmp_path) == [], failed.value


def test_an_error_the_caller_was_handling_keeps_its_locals(tmp_path, monkeypatch):
    """The failed conversion clears the locals of the frames its error left, not those of an error raised before."""

    def fails_with_a_local():
        kept = "for a debugger"  # noqa: F841
        raise ValueError("the caller's")

    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=3)
    fail_after(monkeypatch, "pwrite", 3)
    try:
        fails_with_a_local()
    except ValueError as handled:
        with pytest.raises(OSError, match="No space left on device"):
            convert(hf, tmp_path / "m", progress=False)
        assert handled.__traceback__ is not None and handled.__traceback__.tb_next is not None
        assert handled.__traceback__.tb_next.tb_frame.f_locals == {"kept": "for a debugger"}
    assert open_under(tmp_path) == []
