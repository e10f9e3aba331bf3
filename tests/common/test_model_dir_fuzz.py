"""Mutation fuzzing of model directories: every config.json key and every manifest field set to boundary and
absurd values, files truncated, flipped, replaced by links and FIFOs. Opening the directory must either
succeed with a sane config or fail with one ColibriError line naming the file or field -- never another
exception (ZeroDivisionError, MemoryError, OverflowError, RecursionError, ...), never a hang."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from common.errors import ColibriError
from common.model_format import ModelDir
from common.model_manifest import MANIFEST

ABSURD = [0, -1, 1, 2**40, 2**63, -(2**63), 1e9, 0.5, True, None, "x", "", [], {}, [1, 2], {"a": 1}]
RAW_ABSURD = ["Infinity", "-Infinity", "NaN", "1e999", "-1e999", "[" * 5000 + "]" * 5000]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _open_outcome(path: Path) -> str:
    """'ok' or the one-line error; anything else fails the test."""
    try:
        model = ModelDir.open(path, verify=True)
    except ColibriError as e:
        message = str(e)
        assert message and "\n" not in message and "Traceback" not in message, message
        return message
    cfg = model.config
    assert cfg.vocab_size > 0 and cfg.num_hidden_layers > 0 and cfg.head_dim > 0
    return "ok"


def _write_manifest(path: Path, manifest: dict, raw_replace: tuple[str, str] | None = None) -> None:
    text = json.dumps(manifest)
    if raw_replace is not None:
        text = text.replace(*raw_replace, 1)
    (path / MANIFEST).write_text(text)


@pytest.fixture(scope="module")
def manifest(tiny_model) -> dict:
    return json.loads((tiny_model / MANIFEST).read_text())


def test_every_config_key_with_absurd_values(tiny_model, manifest, tmp_path):
    model = _copy(tiny_model, tmp_path / "m")
    tried = errors = 0
    for key in sorted(manifest["config"]):
        for value in ABSURD:
            mutated = json.loads(json.dumps(manifest))
            mutated["config"][key] = value
            _write_manifest(model, mutated)
            tried += 1
            errors += _open_outcome(model) != "ok"
        for raw in RAW_ABSURD:
            mutated = json.loads(json.dumps(manifest))
            mutated["config"][key] = "@@RAW@@"
            _write_manifest(model, mutated, ('"@@RAW@@"', raw))
            tried += 1
            errors += _open_outcome(model) != "ok"
    assert tried > 200 and errors > tried // 2


@pytest.mark.parametrize("field", ["file", "offset", "nbytes", "dtype", "shape", "crc32"])
def test_every_index_field_with_absurd_values(tiny_model, manifest, tmp_path, field):
    model = _copy(tiny_model, tmp_path / "m")
    names = list(manifest["tensors"])
    for name in (names[0], names[len(names) // 2], names[-1]):
        for value in ABSURD + ["../../etc/passwd", "/etc/passwd", "dense.bin\0x"]:
            mutated = json.loads(json.dumps(manifest))
            mutated["tensors"][name][field] = value
            _write_manifest(model, mutated)
            _open_outcome(model)
        for raw in RAW_ABSURD:
            mutated = json.loads(json.dumps(manifest))
            mutated["tensors"][name][field] = "@@RAW@@"
            _write_manifest(model, mutated, ('"@@RAW@@"', raw))
            assert _open_outcome(model) != "ok"


@pytest.mark.parametrize("key", ["format", "format_version", "dtype", "config", "tensors", "expert_stride"])
def test_top_level_keys(tiny_model, manifest, tmp_path, key):
    model = _copy(tiny_model, tmp_path / "m")
    for value in ABSURD:
        mutated = dict(manifest, **{key: value})
        _write_manifest(model, mutated)
        _open_outcome(model)
    mutated = {k: v for k, v in manifest.items() if k != key}
    _write_manifest(model, mutated)
    assert _open_outcome(model) != "ok"


def test_files_truncated_flipped_linked_and_fifo(tiny_model, tmp_path):
    data_files = sorted(p.name for p in tiny_model.iterdir() if p.suffix == ".bin")
    assert data_files
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * 1024)
    for name in data_files:
        for mutation in ("truncate", "flip", "empty", "symlink_out", "fifo", "directory", "missing"):
            model = _copy(tiny_model, tmp_path / f"{name}-{mutation}")
            target = model / name
            size = target.stat().st_size
            if mutation == "truncate":
                with open(target, "r+b") as f:
                    f.truncate(size // 2)
            elif mutation == "flip":
                with open(target, "r+b") as f:
                    f.seek(size // 3)
                    byte = f.read(1)
                    f.seek(size // 3)
                    f.write(bytes([byte[0] ^ 0xFF]))
            elif mutation == "empty":
                target.write_bytes(b"")
            elif mutation == "symlink_out":
                target.unlink()
                target.symlink_to(outside)
            elif mutation == "fifo":
                target.unlink()
                os.mkfifo(target)
            elif mutation == "directory":
                target.unlink()
                target.mkdir()
            else:
                target.unlink()
            message = _open_outcome(model)
            assert message != "ok" and name in message, (mutation, message)


def test_manifest_itself_broken(tiny_model, tmp_path):
    model = _copy(tiny_model, tmp_path / "m")
    for text in ["", "null", "[]", "{", "\xff\xfe", "{" * 100000, '{"format": "colibri"}']:
        (model / MANIFEST).write_bytes(
            text.encode("utf-8", "surrogateescape") if text != "\xff\xfe" else b"\xff\xfe\x00"
        )
        assert _open_outcome(model) != "ok"
