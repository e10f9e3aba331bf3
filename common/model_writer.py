"""Writes a Colibri model directory (the format is specified in ``common/model_manifest.py``): tensors into
their planned places, one at a time, then the manifest, atomically and last."""

from __future__ import annotations

import errno
import json
import os
import zlib
from pathlib import Path

import numpy as np

from common import dtypes
from common.errors import ModelFormatError
from common.expert_layout import EXPERT_ALIGN, align
from common.files import create_new, naming, pwrite_all, write_new
from common.model_manifest import (
    DENSE_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    ExpertFormats,
    TensorEntry,
    expert_file,
    plan_layout,
)
from common.models import config_from_hf


class ModelWriter:
    """Writes a model directory tensor by tensor, in any order; memory stays at one tensor. Its files stay open
    until finish(); a writer left before (an error) is closed by `with` or close().
    `expert_formats(layer, expert)` picks each routed expert's storage (default: the dense dtype), `head_dtype`
    an 8-bit LM head's (None: the dense dtype; 8-bit: "lm_head" and "lm_head_scale" are written, tied or not),
    `attention_dtype` the attention projections' (None: the dense dtype; 8-bit: each with its "<name>_scale")."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        hf_config: dict,
        dtype: str,
        expert_formats: ExpertFormats | None = None,
        head_dtype: str | None = None,
        attention_dtype: str | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.hf_config = hf_config
        self.config = config_from_hf(hf_config)
        self.dtype = dtype
        self.layout, self.expert_strides = plan_layout(self.config, dtype, expert_formats, head_dtype, attention_dtype)
        self.written: dict[str, TensorEntry] = {}
        self.tokenizer_files: list[str] = []
        if self.out_dir.exists() and not self.out_dir.is_dir():  # mkdir would say only "File exists"
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(self.out_dir))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # An earlier model's manifest would vouch for the files truncated below if this write stopped halfway.
        (self.out_dir / MANIFEST).unlink(missing_ok=True)
        self._files: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for entry in self.layout.values():
            sizes[entry.file] = max(sizes.get(entry.file, 0), entry.offset + entry.nbytes)
        for layer, stride in self.expert_strides.items():  # whole strides, so a copy of any expert's slot stays
            sizes[expert_file(layer)] = self.config.num_experts * stride  # inside the file (the last one's too)
        try:
            for name, size in sizes.items():
                fd = create_new(self.out_dir / name)  # a new file: a link there is replaced, never written through
                self._files[name] = fd
                with naming(self.out_dir / name):
                    os.ftruncate(fd, align(size, EXPERT_ALIGN) if name != DENSE_FILE else size)
        except BaseException:  # a full disk: no caller holds the writer to close them
            self.close()
            raise

    def __enter__(self) -> ModelWriter:
        return self

    def __exit__(self, *error: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the model's files still open: all of them when the write stopped before finish()."""
        while self._files:
            os.close(self._files.popitem()[1])

    def write(self, name: str, array: np.ndarray) -> None:
        entry = self.layout.get(name)
        if entry is None:
            raise ModelFormatError(f"tensor {name}: not part of a {self.config.family} model of this config")
        data = np.ascontiguousarray(array)
        if data.dtype != dtypes.STORAGE[entry.dtype] or tuple(data.shape) != entry.shape:
            raise ModelFormatError(
                f"tensor {name}: expected {entry.dtype} {list(entry.shape)}, got {data.dtype} {list(data.shape)}"
            )
        view = data.data.cast("B")
        pwrite_all(self._files[entry.file], view, entry.offset, self.out_dir / entry.file)
        self.written[name] = TensorEntry(
            name, entry.file, entry.offset, entry.nbytes, entry.dtype, entry.shape, zlib.crc32(view)
        )

    def finish(self) -> Path:
        missing = [n for n in self.layout if n not in self.written]
        if missing:
            raise ModelFormatError(f"tensor {missing[0]}: never written ({len(missing)} tensors missing)")
        for name, fd in self._files.items():
            with naming(self.out_dir / name):  # a full disk can show first here
                os.fsync(fd)
        self.close()
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "family": self.config.family,
            "dtype": self.dtype,
            "config": self.hf_config,
            "expert_stride": max(self.expert_strides.values(), default=0),
            "expert_strides": {str(layer): stride for layer, stride in self.expert_strides.items()},
            "tensors": {n: self.written[n].to_json() for n in self.layout},
            "tokenizer_files": self.tokenizer_files,
        }
        tmp = self.out_dir / (MANIFEST + ".tmp")
        try:
            write_new(tmp, json.dumps(manifest, indent=1).encode())
        except OSError as e:  # a full disk: no half manifest left behind, and the error names the manifest
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, e.strerror, str(self.out_dir / MANIFEST)) from None
        tmp.replace(self.out_dir / MANIFEST)
        return self.out_dir
