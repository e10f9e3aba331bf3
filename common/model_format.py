"""The Colibri model directory, version 1: this docstring is the specification; writer and reader follow it.

    MODEL_DIR/
      colibri.json          manifest (UTF-8 JSON, below)
      dense.bin             every non-expert tensor, each starting at a multiple of 64 bytes
      experts-L{i:03d}.bin  routed experts of MoE layer i: expert j occupies bytes
                            [j * expert_stride, j * expert_stride + expert_nbytes), expert_stride a multiple
                            of 4096; inside the block gate_proj [F, D], up_proj [F, D], down_proj [D, F]
                            lie back to back, so one expert is one contiguous range = one host-to-device copy
      tokenizer.json, ...   tokenizer files copied from the checkpoint (optional)

    colibri.json = {
      "format": "colibri", "format_version": 1,
      "family": "<HF model_type>",
      "dtype": "float32" | "float16" | "bfloat16",     # storage dtype of every tensor
      "config": {...},                                  # the HF config.json, keys unchanged
      "expert_stride": <bytes between experts in an experts file>,
      "tensors": {"<canonical name>": {"file": "<relative path>", "offset": <bytes>, "nbytes": <bytes>,
                                       "dtype": "<dtype>", "shape": [..], "crc32": <uint32 of the bytes>}},
      "tokenizer_files": ["tokenizer.json", ...]
    }

Canonical tensor names and shapes are listed in ``common.models``. Matrices are row-major [out, in].
bfloat16 is stored as raw 16-bit words. All integers little-endian (the arrays' native order on x86/ARM).

The reader never trusts the manifest: it rejects paths that are absolute, contain ``..`` or resolve outside
the directory (symlinks), files too short for a tensor's range, ``nbytes`` that disagree with dtype x shape,
missing tensors, and (unless told to skip) any crc32 mismatch; each is a one-line ``ModelFormatError``.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from common import dtypes
from common.errors import ChecksumError, ConfigError, ModelFormatError
from common.model_config import ModelConfig
from common.models import config_from_hf, tensor_specs

FORMAT_NAME = "colibri"
FORMAT_VERSION = 1
MANIFEST = "colibri.json"
DENSE_FILE = "dense.bin"
DENSE_ALIGN = 64
EXPERT_ALIGN = 4096
MAX_DIM = 1 << 31  # one tensor dimension
MAX_FILE_BYTES = 1 << 48  # offsets and sizes: far past any disk, far below int64 overflow
MAX_JSON_DEPTH = 64  # a manifest is 4 levels deep
_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def expert_file(layer: int) -> str:
    return f"experts-L{layer:03d}.bin"


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    crc32: int

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "crc32": self.crc32,
        }


def plan_layout(config: ModelConfig, dtype: str) -> tuple[dict[str, TensorEntry], int]:
    """Where every tensor goes (crc32 left 0), and the expert stride: a pure function of config and dtype."""
    size = dtypes.itemsize(dtype)
    specs = tensor_specs(config)
    expert_nbytes = 3 * config.moe_intermediate_size * config.hidden_size * size  # gate + up + down
    stride = _align(expert_nbytes, EXPERT_ALIGN)
    entries, dense_offset, inside_expert = {}, 0, 0
    for spec in specs:
        nbytes = int(np.prod(spec.shape)) * size
        if spec.expert is None:
            dense_offset = _align(dense_offset, DENSE_ALIGN)
            entries[spec.name] = TensorEntry(spec.name, DENSE_FILE, dense_offset, nbytes, dtype, spec.shape, 0)
            dense_offset += nbytes
        else:
            assert spec.layer is not None  # tensor_specs gives every expert matrix its layer
            inside_expert = 0 if spec.name.endswith("gate_proj") else inside_expert
            offset = spec.expert * stride + inside_expert
            entries[spec.name] = TensorEntry(spec.name, expert_file(spec.layer), offset, nbytes, dtype, spec.shape, 0)
            inside_expert += nbytes
    return entries, stride


class ModelWriter:
    """Writes a model directory tensor by tensor, in any order; memory stays at one tensor."""

    def __init__(self, out_dir: str | os.PathLike, hf_config: dict, dtype: str):
        self.out_dir = Path(out_dir)
        self.hf_config = hf_config
        self.config = config_from_hf(hf_config)
        self.dtype = dtype
        self.layout, self.expert_stride = plan_layout(self.config, dtype)
        self.written: dict[str, TensorEntry] = {}
        self.tokenizer_files: list[str] = []
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for entry in self.layout.values():
            sizes[entry.file] = max(sizes.get(entry.file, 0), entry.offset + entry.nbytes)
        for name, size in sizes.items():
            fd = os.open(self.out_dir / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, _align(size, EXPERT_ALIGN) if name != DENSE_FILE else size)
            self._files[name] = fd

    def write(self, name: str, array: np.ndarray) -> None:
        entry = self.layout.get(name)
        if entry is None:
            raise ModelFormatError(f"tensor {name}: not part of a {self.config.family} model of this config")
        data = np.ascontiguousarray(array)
        if data.dtype != dtypes.STORAGE[self.dtype] or tuple(data.shape) != entry.shape:
            raise ModelFormatError(
                f"tensor {name}: expected {self.dtype} {list(entry.shape)}, got {data.dtype} {list(data.shape)}"
            )
        view = data.data.cast("B")
        written = os.pwrite(self._files[entry.file], view, entry.offset)
        if written != entry.nbytes:
            raise ModelFormatError(f"{entry.file}: short write for tensor {name} ({written} of {entry.nbytes} bytes)")
        self.written[name] = TensorEntry(
            name, entry.file, entry.offset, entry.nbytes, entry.dtype, entry.shape, zlib.crc32(view)
        )

    def finish(self) -> Path:
        missing = [n for n in self.layout if n not in self.written]
        if missing:
            raise ModelFormatError(f"tensor {missing[0]}: never written ({len(missing)} tensors missing)")
        for fd in self._files.values():
            os.fsync(fd)
            os.close(fd)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "family": self.config.family,
            "dtype": self.dtype,
            "config": self.hf_config,
            "expert_stride": self.expert_stride,
            "tensors": {n: self.written[n].to_json() for n in self.layout},
            "tokenizer_files": self.tokenizer_files,
        }
        tmp = self.out_dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(self.out_dir / MANIFEST)
        return self.out_dir


class ModelDir:
    """A validated, memory-mapped model directory. Tensors are zero-copy read-only views."""

    def __init__(self, path: str | os.PathLike, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self.hf_config: dict = manifest["config"]
        self.config: ModelConfig = config_from_hf(self.hf_config)
        self.dtype: str = manifest["dtype"]
        self.expert_stride: int = int(manifest["expert_stride"])
        self.entries: dict[str, TensorEntry] = {}
        self._maps: dict[str, np.memmap] = {}

    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = True, progress: bool = False) -> ModelDir:
        root = Path(path)
        manifest_path = root / MANIFEST
        if not manifest_path.is_file():
            raise ModelFormatError(
                f"{manifest_path}: not found (is {root} a Colibri model directory? make one with `colibri convert`)"
            )
        manifest = load_json(manifest_path, ModelFormatError)
        if not isinstance(manifest, dict):
            raise ModelFormatError(f"{manifest_path}: expected a JSON object, got {type(manifest).__name__}")
        for key in ("format", "format_version", "dtype", "config", "tensors", "expert_stride"):
            if key not in manifest:
                raise ModelFormatError(f"{manifest_path}: missing key {key!r}")
        if manifest["format"] != FORMAT_NAME or manifest["format_version"] != FORMAT_VERSION:
            raise ModelFormatError(
                f"{manifest_path}: format {manifest['format']!r} version "
                f"{manifest['format_version']!r}, expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
            )
        try:
            model = cls(root, manifest)
        except ConfigError as e:
            raise ModelFormatError(f"{manifest_path}: {e}") from None
        except (TypeError, ValueError, AttributeError, OverflowError) as e:  # "config": [], "expert_stride": "x"
            raise ModelFormatError(f"{manifest_path}: malformed manifest ({e})") from None
        if not isinstance(manifest["tensors"], dict):
            raise ModelFormatError(f"{manifest_path}: 'tensors' must be an object of name -> entry")
        model._check_entries()
        if verify:
            model.verify(progress=progress)
        return model

    def _safe_path(self, name: str, tensor: str) -> Path:
        p = Path(name)
        if p.is_absolute() or ".." in p.parts or not name or "\0" in name:
            raise ModelFormatError(f"tensor {tensor}: file path {name!r} must be relative to the model directory")
        full = self.path / p
        root = self.path.resolve()
        if not full.resolve().is_relative_to(root):
            raise ModelFormatError(
                f"tensor {tensor}: file {name!r} resolves outside the model directory (symlink to {full.resolve()})"
            )
        return full

    def _check_entries(self) -> None:
        if not isinstance(self.dtype, str) or dtypes.ALIASES.get(self.dtype) != self.dtype:
            raise ModelFormatError(f"{MANIFEST}: dtype {self.dtype!r} is not supported")
        file_sizes: dict[str, int] = {}
        for name, raw in self.manifest["tensors"].items():
            entry = _entry(name, raw)
            if entry.dtype not in dtypes.STORAGE:
                raise ModelFormatError(f"tensor {name}: dtype {entry.dtype!r} is not supported")
            expected = math.prod(entry.shape) * dtypes.itemsize(entry.dtype)
            if entry.nbytes != expected:
                raise ModelFormatError(
                    f"tensor {name}: {entry.nbytes} bytes do not fit {entry.dtype} "
                    f"{list(entry.shape)} (expected {expected} bytes)"
                )
            path = self._safe_path(entry.file, name)
            if entry.file not in file_sizes:
                if not path.is_file():
                    raise ModelFormatError(f"tensor {name}: file {entry.file} not found in {self.path}")
                file_sizes[entry.file] = path.stat().st_size
            if entry.offset < 0 or entry.offset + entry.nbytes > file_sizes[entry.file]:
                what = "offset past the end of" if entry.offset >= file_sizes[entry.file] else "range past the end of"
                raise ModelFormatError(
                    f"tensor {name}: {what} {entry.file} (bytes {entry.offset}..."
                    f"{entry.offset + entry.nbytes} of a {file_sizes[entry.file]}-byte file; "
                    f"truncated?)"
                )
            self.entries[name] = entry
        for spec in tensor_specs(self.config):
            if spec.name not in self.entries:
                raise ModelFormatError(f"tensor {spec.name}: missing from {MANIFEST}")
            entry = self.entries[spec.name]
            if entry.shape != spec.shape:
                raise ModelFormatError(
                    f"tensor {spec.name}: shape {list(entry.shape)} in {MANIFEST}, "
                    f"config.json implies {list(spec.shape)}"
                )
        for layer in self.config.moe_layers:
            for expert in range(self.config.num_experts):
                self._check_expert_layout(layer, expert)

    def _check_expert_layout(self, layer: int, expert: int) -> None:
        """An expert must be one aligned contiguous range (gate, up, down back to back): it is copied as one."""
        prefix = f"layers.{layer}.experts.{expert}."
        gate, up, down = (self.entries[prefix + p] for p in ("gate_proj", "up_proj", "down_proj"))
        if (
            gate.offset % EXPERT_ALIGN
            or not (gate.file == up.file == down.file)
            or up.offset != gate.offset + gate.nbytes
            or down.offset != up.offset + up.nbytes
        ):
            raise ModelFormatError(
                f"tensor {prefix}gate_proj: expert {expert} of layer {layer} is not one "
                f"{EXPERT_ALIGN}-byte-aligned block of gate, up, down back to back"
            )

    def _map(self, file: str) -> np.memmap:
        if file not in self._maps:
            self._maps[file] = np.memmap(self.path / file, dtype=np.uint8, mode="r")
        return self._maps[file]

    def raw_bytes(self, name: str) -> np.ndarray:
        e = self.entries[name]
        return self._map(e.file)[e.offset : e.offset + e.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """Storage view (bfloat16 as uint16), read-only, zero-copy."""
        e = self.entries[name]
        return self.raw_bytes(name).view(dtypes.STORAGE[e.dtype]).reshape(e.shape)

    def tensor_f32(self, name: str) -> np.ndarray:
        e = self.entries[name]
        return np.ascontiguousarray(dtypes.to_float32(self.tensor(name), e.dtype), dtype=np.float32)

    def expert_block(self, layer: int, expert: int) -> tuple[str, int, int]:
        """(file, offset, nbytes) of expert `expert` of `layer`: its gate, up and down matrices."""
        first = self.entries[f"layers.{layer}.experts.{expert}.gate_proj"]
        last = self.entries[f"layers.{layer}.experts.{expert}.down_proj"]
        return first.file, first.offset, last.offset + last.nbytes - first.offset

    @cached_property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def verify(self, progress: bool = False, workers: int | None = None) -> None:
        """Re-checks every tensor's crc32 in parallel (zlib releases the GIL); raises on the first mismatch."""
        from tqdm import tqdm

        def check(entry: TensorEntry) -> int:
            if zlib.crc32(self.raw_bytes(entry.name).data) != entry.crc32:
                raise ChecksumError(
                    f"{entry.file}: checksum mismatch in tensor {entry.name} "
                    f"(crc32 {zlib.crc32(self.raw_bytes(entry.name).data):08x}, "
                    f"manifest says {entry.crc32:08x})"
                )
            return entry.nbytes

        entries = sorted(self.entries.values(), key=lambda e: (e.file, e.offset))
        with (
            ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool,
            tqdm(total=self.total_bytes, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar,
        ):
            for nbytes in pool.map(check, entries):
                bar.update(nbytes)

    def tokenizer_path(self) -> Path | None:
        p = self.path / "tokenizer.json"
        return p if p.is_file() else None


def load_json(path: Path, error: type[Exception]) -> object:
    """A JSON file as Python values, refusing what would later overflow or recurse: NaN/Infinity, numbers
    that do not fit a double (1e999), nesting deeper than a manifest ever needs."""

    def reject_constant(name: str):
        raise error(f"{path}: {name} is not a valid JSON number here")

    def finite_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise error(f"{path}: number {text} is out of range")
        return value

    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    # Checked before parsing: letting the parser hit Python's recursion limit leaves CPython 3.11's
    # recursion bookkeeping skewed for later code (seen as "AST constructor recursion depth mismatch").
    depth = deepest = 0
    for bracket in _BRACKETS.finditer(_JSON_STRINGS.sub('""', text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_JSON_DEPTH:
        raise error(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=reject_constant, parse_float=finite_float)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None


def _entry(name: str, raw: object) -> TensorEntry:
    """One manifest tensor entry, every field of the type and range the loader relies on."""

    if not isinstance(raw, dict):
        raise ModelFormatError(f"tensor {name}: manifest entry must be an object")

    def integer(key: str, hi: int) -> int:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
            raise ModelFormatError(f"tensor {name}: {key} must be an integer in [0, {hi}], got {value!r}")
        return value

    try:
        shape = raw["shape"]
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < MAX_DIM for d in shape)
        ):
            raise ModelFormatError(
                f"tensor {name}: shape must be a list of at most 8 sizes in [0, {MAX_DIM}), got {shape!r}"
            )
        if not isinstance(raw["file"], str) or not isinstance(raw["dtype"], str):
            raise ModelFormatError(f"tensor {name}: file and dtype must be strings")
        return TensorEntry(
            name,
            raw["file"],
            integer("offset", MAX_FILE_BYTES),
            integer("nbytes", MAX_FILE_BYTES),
            raw["dtype"],
            tuple(shape),
            integer("crc32", 0xFFFFFFFF),
        )
    except KeyError as e:
        raise ModelFormatError(f"tensor {name}: manifest entry lacks {e}") from None


def read_manifest_config(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """The model config without mapping weights (for processes that never touch them, like the router)."""
    model = ModelDir.open(path, verify=False)
    return model.config, model.manifest
