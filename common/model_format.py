"""Reads a Colibri model directory (the format is specified in ``common/model_manifest.py``) as ``ModelDir``:
checked on open, memory-mapped, its tensors zero-copy views.

The reader never trusts the manifest: it rejects paths that are absolute, contain ``..`` or resolve outside
the directory (symlinks), files too short for a tensor's range, ``nbytes`` that disagree with dtype x shape,
missing or unknown tensors, a tensor outside the file above that holds it (dense ones off a 64-byte
boundary), two tensors sharing a byte, 8-bit dtypes outside routed experts, attention projections and lm_head
(``common/attention_format.py``, ``common/head_format.py``), dense tensors in another dtype than "dtype" (version 1: any tensor), scales missing, of
the wrong shape or holding a value that is not positive and finite or so large that a code times it overflows
float32 (read on every open, one small range per expert and one per 8-bit head or projection), expert blocks off their planned
offsets, an expert_stride other than the largest of expert_strides, and (unless told to skip) any crc32 mismatch,
scales included, or a NaN byte (0x7f/0xff) in a float8_e4m3fn tensor; each is a one-line ``ModelFormatError``
(``ChecksumError`` for a mismatch).
"""

from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import BinaryIO

import numpy as np

from common import dtypes, quant
from common.attention_format import AttentionFormat, read_attention_format
from common.errors import ChecksumError, ConfigError, ModelFormatError
from common.expert_layout import PROJECTIONS, SCALE_SUFFIX, ExpertLayout, read_expert_layout, scale_name
from common.files import open_regular, read_regular, stat_regular
from common.head_format import HeadFormat, read_head_format
from common.model_config import ModelConfig
from common.model_identity import bytes_digest
from common.model_manifest import (
    ATTENTION_MATRIX,
    DENSE_ALIGN,
    DENSE_FILE,
    EXPERT_MATRIX,
    FORMAT_NAME,
    HEAD,
    MANIFEST,
    READABLE_VERSIONS,
    TensorEntry,
    byte_count,
    check_disjoint,
    expert_file,
    planned_file,
    tensor_entry,
)
from common.models import config_from_hf, tensor_specs
from common.strict_json import parse_json

VERIFY_CHUNK = 1 << 18  # verify reads a tensor in chunks this size: the crc and the fp8 NaN check share each in cache


class ModelDir:
    """A validated, memory-mapped model directory. Tensors are zero-copy read-only views."""

    def __init__(self, path: str | os.PathLike, manifest: dict, digest: str):
        self.path = Path(path)
        self.manifest = manifest
        # "sha256:<hex>" of the colibri.json bytes parsed into `manifest`: the identity Info reports and routing
        # tables are checked against, taken from those bytes so it names the manifest this model was read from
        self.digest = digest
        self.version: int = manifest["format_version"]
        self.hf_config: dict = manifest["config"]
        self.config: ModelConfig = config_from_hf(self.hf_config)
        self.dtype: str = manifest["dtype"]  # the dense dtype (version 1: every tensor's)
        self.expert_stride: int = byte_count(manifest["expert_stride"], "expert_stride")  # the largest
        strides = manifest.get("expert_strides") if self.version >= 2 else None
        self.expert_strides: dict[int, int] = (
            {layer: self.expert_stride for layer in self.config.moe_layers}
            if strides is None
            else {
                layer: byte_count(strides[str(layer)], f"expert_strides[{layer}]") for layer in self.config.moe_layers
            }
        )
        largest = max(self.expert_strides.values(), default=0)
        if self.expert_stride != largest:  # what an expert cache sizes a slot by: never taken on the manifest's word
            raise ModelFormatError(
                f"{MANIFEST}: expert_stride is {self.expert_stride}, but the largest of expert_strides is {largest}"
            )
        self.entries: dict[str, TensorEntry] = {}
        self.expert_layouts: dict[tuple[int, int], ExpertLayout] = {}
        # an 8-bit lm_head's dtype, scale scheme and byte range in dense.bin; None: the head is in the dense dtype
        # (lm_head, or embed_tokens when tied)
        self.head_format: HeadFormat | None = None
        # 8-bit attention projections' dtype and each layer's qkv and o blocks in dense.bin; None: the dense dtype
        self.attention_format: AttentionFormat | None = None
        self._maps: dict[str, np.memmap] = {}
        self._sizes: dict[str, int] = {}  # each file's size when checked: one cut short since is refused

    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = True, progress: bool = False) -> ModelDir:
        root = Path(path)
        manifest_path = root / MANIFEST
        if root.exists() and not root.is_dir():  # its colibri.json would read "Not a directory", naming no real path
            raise ModelFormatError(
                f"{root} is not a directory (a Colibri model is one; make one with `colibri convert`)"
            )
        _regular_size(
            manifest_path,
            f"{manifest_path}: not found (is {root} a Colibri model directory? make one with `colibri convert`)",
        )
        data = read_regular(manifest_path)
        manifest = parse_json(data, manifest_path, ModelFormatError)
        if not isinstance(manifest, dict):
            raise ModelFormatError(f"{manifest_path}: expected a JSON object, got {type(manifest).__name__}")
        for key in ("format", "format_version", "dtype", "config", "tensors", "expert_stride"):
            if key not in manifest:
                raise ModelFormatError(f"{manifest_path}: missing key {key!r}")
        version = manifest["format_version"]
        if manifest["format"] != FORMAT_NAME or isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise ModelFormatError(
                f"{manifest_path}: format {manifest['format']!r} version {version!r}, expected "
                f"{FORMAT_NAME!r} version {' or '.join(map(str, READABLE_VERSIONS))}"
            )
        if version >= 2 and not isinstance(manifest.get("expert_strides"), dict):
            raise ModelFormatError(f"{manifest_path}: missing key 'expert_strides' (an object: MoE layer -> bytes)")
        try:
            model = cls(root, manifest, bytes_digest(data))
        except ConfigError as e:
            raise ModelFormatError(f"{manifest_path}: {e}") from None
        except KeyError as e:
            raise ModelFormatError(f"{manifest_path}: expert_strides lacks MoE layer {e}") from None
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
        file_sizes = self._sizes
        for name, raw in self.manifest["tensors"].items():
            entry = tensor_entry(name, raw)
            if entry.dtype not in dtypes.STORAGE:
                raise ModelFormatError(f"tensor {name}: dtype {entry.dtype!r} is not supported")
            eight_bit = entry.dtype in dtypes.QUANTIZED_DTYPES
            may_be_8bit = EXPERT_MATRIX.fullmatch(name) or ATTENTION_MATRIX.fullmatch(name) or name == HEAD
            if eight_bit and not may_be_8bit:
                raise ModelFormatError(
                    f"tensor {name}: dtype {entry.dtype} is only for routed experts' matrices, attention projections "
                    f"and {HEAD}"
                )
            expected = math.prod(entry.shape) * dtypes.itemsize(entry.dtype)
            if entry.nbytes != expected:
                raise ModelFormatError(
                    f"tensor {name}: {entry.nbytes} bytes do not fit {entry.dtype} "
                    f"{list(entry.shape)} (expected {expected} bytes)"
                )
            if self.version == 1 and entry.dtype != self.dtype:
                raise ModelFormatError(
                    f"tensor {name}: dtype {entry.dtype} in a version-1 directory, whose tensors are all "
                    f"{self.dtype} (version 2 holds 8-bit experts)"
                )
            # same-size dtypes (bf16 / fp16) cannot be told apart by nbytes: the dense ones must be the manifest's
            if (
                entry.dtype != self.dtype
                and not EXPERT_MATRIX.fullmatch(name)
                and not name.endswith(SCALE_SUFFIX)
                and not (may_be_8bit and eight_bit)
            ):
                rule = (
                    f"{name} is the manifest's dtype {self.dtype} or 8-bit ({', '.join(dtypes.QUANTIZED_DTYPES)})"
                    if may_be_8bit
                    else f"every tensor other than routed experts' is the manifest's dtype {self.dtype}"
                )
                raise ModelFormatError(f"tensor {name}: dtype {entry.dtype}, but {rule}")
            path = self._safe_path(entry.file, name)
            if entry.file not in file_sizes:
                missing = f"tensor {name}: file {entry.file} not found in {self.path}"
                file_sizes[entry.file] = _regular_size(path, missing, f"tensor {name}")
            if entry.offset < 0 or entry.offset + entry.nbytes > file_sizes[entry.file]:
                what = "offset past the end of" if entry.offset >= file_sizes[entry.file] else "range past the end of"
                raise ModelFormatError(
                    f"tensor {name}: {what} {entry.file} (bytes {entry.offset}..."
                    f"{entry.offset + entry.nbytes} of a {file_sizes[entry.file]}-byte file; "
                    f"truncated?)"
                )
            planned = planned_file(name)  # the cuda backend reads dense.bin and experts-L{i}.bin by these names
            if entry.file != planned or (planned == DENSE_FILE and entry.offset % DENSE_ALIGN):
                where = f"{planned} at a multiple of {DENSE_ALIGN} bytes" if planned == DENSE_FILE else planned
                raise ModelFormatError(
                    f"tensor {name}: stored in {entry.file} at byte {entry.offset}; the format puts it in {where}"
                )
            self.entries[name] = entry
        for layer, stride in self.expert_strides.items():
            size, need = file_sizes.get(expert_file(layer), 0), self.config.num_experts * stride
            if size < need:  # a slot copy moves whole strides
                raise ModelFormatError(
                    f"{expert_file(layer)}: {size} bytes, less than its {self.config.num_experts} experts of "
                    f"{stride} bytes (truncated?)"
                )
        specs = tensor_specs(self.config)
        for spec in specs:
            if spec.name not in self.entries:
                raise ModelFormatError(f"tensor {spec.name}: missing from {MANIFEST}")
            entry = self.entries[spec.name]
            if entry.shape != spec.shape:
                raise ModelFormatError(
                    f"tensor {spec.name}: shape {list(entry.shape)} in {MANIFEST}, "
                    f"config.json implies {list(spec.shape)}"
                )
        self.head_format = read_head_format(self.entries, self.config)
        self.attention_format = read_attention_format(self.entries, self.config)
        known = {s.name for s in specs} | ({HEAD} if self.head_format else set())  # tied: an 8-bit head beside
        for name in self.entries:
            if name not in known and not (name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in known):
                raise ModelFormatError(f"tensor {name}: not part of a {self.config.family} model of this config")
        for layer in self.config.moe_layers:
            for expert in range(self.config.num_experts):
                self.expert_layouts[layer, expert] = read_expert_layout(self, layer, expert)
        for name in self.entries:  # a scale whose matrix is not 8-bit belongs to no expert layout
            if (
                name.endswith(SCALE_SUFFIX)
                and self.entries[name[: -len(SCALE_SUFFIX)]].dtype not in dtypes.QUANTIZED_DTYPES
            ):
                raise ModelFormatError(f"tensor {name}: a scale for {name[: -len(SCALE_SUFFIX)]}, which is not 8-bit")
        check_disjoint(self.entries.values())
        self._check_scale_values()

    def _check_scale_values(self) -> None:
        """Every 8-bit matrix's scales hold positive finite values, whether or not checksums are verified: an
        8-bit head's and projections' (one small pread each), and each 8-bit expert's three, which end its block
        (one small pread per expert), never the weights' bytes."""
        fds: dict[str, BinaryIO] = {}

        def read(file: str, nbytes: int, offset: int) -> bytes:
            if file not in fds:
                fds[file] = self._open_checked(file)
            return os.pread(fds[file].fileno(), nbytes, offset)

        try:
            for name, entry in self.entries.items():  # the head and attention projections: per-row scales
                if entry.dtype in dtypes.QUANTIZED_DTYPES and not EXPERT_MATRIX.fullmatch(name):
                    row_scale = self.entries[scale_name(name)]
                    data = read(row_scale.file, row_scale.nbytes, row_scale.offset)
                    quant.check_scale_values(np.frombuffer(data, "<f4"), entry.dtype, row_scale.name, row_scale.file)
            for (layer, expert), layout in self.expert_layouts.items():
                if not layout.scale_offsets:
                    continue
                start = layout.offset + layout.scale_offsets[0]
                data = read(layout.file, layout.offset + layout.nbytes - start, start)
                for projection, shape, offset in zip(PROJECTIONS, layout.scale_shapes, layout.scale_offsets):
                    at = layout.offset + offset - start
                    scale = np.frombuffer(data, "<f4", math.prod(shape), at).reshape(shape)
                    name = scale_name(f"layers.{layer}.experts.{expert}.{projection}")
                    quant.check_scale_values(scale, layout.dtype, name, layout.file)
        finally:
            for f in fds.values():
                f.close()

    def _map(self, file: str) -> np.memmap:
        if file not in self._maps:
            with self._open_checked(file) as f:
                self._maps[file] = np.memmap(f, dtype=np.uint8, mode="r")
        return self._maps[file]

    def _open_checked(self, file: str) -> BinaryIO:
        """`file` opened as open() checked it: a FIFO renamed over it since is refused, never waited on, and a
        shorter file (replaced or cut short) is refused rather than read as tensors cut short."""
        path = self.path / file
        try:
            f = open_regular(path)
        except OSError as e:
            raise ModelFormatError(f"{path}: {e.strerror or e}") from None
        size, checked = os.fstat(f.fileno()).st_size, self._sizes.get(file, 0)
        if size < checked:
            f.close()
            raise ModelFormatError(f"{path}: {size} bytes, {checked} when the model was opened (replaced since?)")
        return f

    def raw_bytes(self, name: str) -> np.ndarray:
        e = self.entries[name]
        return self._map(e.file)[e.offset : e.offset + e.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """Storage view (bfloat16 as uint16), read-only, zero-copy."""
        e = self.entries[name]
        return self.raw_bytes(name).view(dtypes.STORAGE[e.dtype]).reshape(e.shape)

    def tensor_f32(self, name: str) -> np.ndarray:
        """float32 values; an 8-bit expert matrix, attention projection or lm_head comes back dequantised exactly
        (q * scale)."""
        e = self.entries[name]
        if e.dtype in dtypes.QUANTIZED_DTYPES:
            match = EXPERT_MATRIX.fullmatch(name)
            if match is None:  # lm_head or an attention projection: one scale per row, both formats' only scheme
                return quant.dequantize(self.tensor(name), self.tensor(scale_name(name)), e.dtype, quant.CHANNEL)
            layout = self.expert_layouts[int(match[1]), int(match[2])]
            assert layout.scheme is not None
            return quant.dequantize(self.tensor(name), self.tensor(scale_name(name)), e.dtype, layout.scheme)
        return np.ascontiguousarray(dtypes.to_float32(self.tensor(name), e.dtype), dtype=np.float32)

    def expert_layout(self, layer: int, expert: int) -> ExpertLayout:
        """Expert `expert` of MoE layer `layer`: dtype, scale scheme, block range and its tensors' offsets."""
        return self.expert_layouts[layer, expert]

    def expert_block(self, layer: int, expert: int) -> tuple[str, int, int]:
        """(file, offset, nbytes) of expert `expert` of `layer`: its matrices and scales, one range."""
        layout = self.expert_layouts[layer, expert]
        return layout.file, layout.offset, layout.nbytes

    @cached_property
    def max_expert_nbytes(self) -> int:
        """The largest expert block: what one slot of an expert cache must hold."""
        return max((layout.nbytes for layout in self.expert_layouts.values()), default=0)

    @cached_property
    def expert_formats(self) -> tuple[str, ...]:
        """The distinct expert storage labels ("bfloat16", "int8", "float8_e4m3fn/block128"), sorted."""
        return tuple(sorted({layout.format.label for layout in self.expert_layouts.values()}))

    @cached_property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def verify(self, progress: bool = False, workers: int | None = None) -> None:
        """Re-checks every tensor's crc32 in parallel (zlib releases the GIL), and that no float8_e4m3fn tensor holds
        a NaN byte; raises on the first failure."""
        from tqdm import tqdm

        def check(entry: TensorEntry) -> int:
            data, crc, nan_at = self.raw_bytes(entry.name), 0, None
            fp8 = entry.dtype == "float8_e4m3fn"
            for start in range(0, entry.nbytes, VERIFY_CHUNK):  # each chunk read once, then checked in cache
                chunk = data[start : start + VERIFY_CHUNK]
                crc = zlib.crc32(chunk.data, crc)
                if fp8 and nan_at is None and (at := dtypes.first_fp8_nan(chunk)) is not None:
                    nan_at = start + at
            if crc != entry.crc32:
                raise ChecksumError(
                    f"{entry.file}: checksum mismatch in tensor {entry.name} "
                    f"(crc32 {crc:08x}, manifest says {entry.crc32:08x})"
                )
            if nan_at is not None:  # written so (another dtype's bytes labelled fp8): the kernels would serve NaN
                raise ModelFormatError(
                    f"{entry.file}: tensor {entry.name}: NaN byte 0x{data[nan_at]:02x} at byte {nan_at} "
                    "(float8_e4m3fn's NaN encodings, which no converted weight holds; another dtype's bytes?)"
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
        """tokenizer.json, or None when the model has none; a FIFO, device or directory there is refused (a
        ModelFormatError saying what is there), not taken for a model without one."""
        p = self.path / "tokenizer.json"
        try:
            stat_regular(p)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ModelFormatError(f"{p}: {e.strerror or e}") from None
        return p


def _regular_size(path: Path, missing: str, what: str = "") -> int:
    """The size of the regular file at `path`, taken by stat: a FIFO there is never opened (that would wait for a
    writer for ever), and a FIFO, device or directory is refused saying what it is rather than as `missing`."""
    try:
        return stat_regular(path).st_size
    except FileNotFoundError:
        raise ModelFormatError(missing) from None
    except OSError as e:  # not a regular file; or a path component that is a file, a loop of links, no permission
        raise ModelFormatError(f"{what + ': ' if what else ''}{path}: {e.strerror or e}") from None


def read_manifest_config(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """The model config without mapping weights (for processes that never touch them, like the router)."""
    model = ModelDir.open(path, verify=False)
    return model.config, model.manifest
