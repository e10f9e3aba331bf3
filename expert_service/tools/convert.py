"""`colibri convert HF_DIR OUT_DIR`: a Hugging Face safetensors checkpoint -> a Colibri model directory.

Streams one tensor at a time from memory-mapped shards, so peak memory is bounded by the largest single
tensor (times ~3 while changing dtype: the source view, a float32 copy and the result), not by the model.
Pickle checkpoints (.bin/.pt) are never loaded.
"""

from __future__ import annotations

import json
import math
import mmap
import shutil
import struct
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from common import dtypes
from common.errors import ModelFormatError
from common.model_format import ModelWriter
from common.models import config_from_hf, tensor_specs

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class SafetensorsShard:
    """One checkpoint file. `safetensors.safe_open` parses and validates the header (names, dtypes, shapes,
    offsets that tile the data inside the file); tensors are read as views of our own read-only mmap at the
    header's offsets, because safe_open hands numpy a copy of each tensor (and has no numpy bfloat16)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with safe_open(path, framework="numpy") as f:
                self.tensors = {
                    name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()
                }
        except SafetensorError as e:
            raise ModelFormatError(f"{path}: not a valid safetensors file ({e})") from None
        with open(path, "rb") as file:  # safe_open does not expose offsets: read them from the checked header
            (header_len,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_len))
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._begin = {name: 8 + header_len + int(header[name]["data_offsets"][0]) for name in self.tensors}

    def read(self, name: str) -> tuple[np.ndarray, str]:
        """(storage array view, dtype name) of one tensor."""
        safetensors_dtype, shape = self.tensors[name]
        dtype = dtypes.SAFETENSORS_NAMES.get(safetensors_dtype)
        if dtype is None:
            raise ModelFormatError(
                f"{self.path}: tensor {name} has dtype {safetensors_dtype}, "
                f"supported: {', '.join(dtypes.SAFETENSORS_NAMES)}"
            )
        raw = np.frombuffer(
            self._map, dtype=np.uint8, count=math.prod(shape) * dtypes.itemsize(dtype), offset=self._begin[name]
        )
        return raw.view(dtypes.STORAGE[dtype]).reshape(shape), dtype

    def close(self):
        self._map.close()


def open_checkpoint(hf_dir: Path) -> dict[str, SafetensorsShard]:
    """Tensor name -> the shard holding it, from `model.safetensors.index.json` or the shard files."""
    shards = sorted(hf_dir.glob("*.safetensors"))
    if not shards:
        pickles = [p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = f" (found pickle checkpoints {pickles}: these are never loaded; save as safetensors)" if pickles else ""
        raise ModelFormatError(f"{hf_dir}: no .safetensors files{hint}")
    opened = {p.name: SafetensorsShard(p) for p in shards}
    index_path = hf_dir / "model.safetensors.index.json"
    where: dict[str, SafetensorsShard] = {}
    if index_path.is_file():
        try:
            weight_map = dict(json.loads(index_path.read_text())["weight_map"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{index_path}: malformed index ({type(e).__name__}: {e})") from None
        for name, file in weight_map.items():
            if file not in opened:
                raise ModelFormatError(f"{index_path}: tensor {name} maps to missing shard {file}")
            where[name] = opened[file]
    else:
        for shard in opened.values():
            for name in shard.tensors:
                where[name] = shard
    return where


def convert(hf_dir: str | Path, out_dir: str | Path, dtype: str | None = None, progress: bool = True) -> Path:
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{config_path}: not found")
    try:
        hf_config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{config_path}: not valid JSON ({e})") from None
    config = config_from_hf(hf_config)
    where = open_checkpoint(hf_dir)
    specs = tensor_specs(config)
    missing = [s.hf_name for s in specs if s.hf_name not in where]
    if missing:
        raise ModelFormatError(
            f"{hf_dir}: checkpoint lacks tensor {missing[0]} "
            f"({len(missing)} missing for a {config.family} model of this config)"
        )
    first_dtype = where[specs[0].hf_name].read(specs[0].hf_name)[1]
    target = dtypes.canonical_dtype(dtype) if dtype else first_dtype
    writer = ModelWriter(out_dir, hf_config, target)
    total = sum(int(np.prod(s.shape)) for s in specs)
    with tqdm(total=total, unit=" params", unit_scale=True, desc="convert", disable=not progress) as bar:
        for spec in specs:
            raw, src_dtype = where[spec.hf_name].read(spec.hf_name)
            if raw.shape != spec.shape:
                raise ModelFormatError(
                    f"{hf_dir}: tensor {spec.hf_name} has shape {list(raw.shape)}, "
                    f"config.json implies {list(spec.shape)}"
                )
            writer.write(spec.name, dtypes.convert(raw, src_dtype, target, spec.hf_name))
            bar.update(raw.size)
    del raw  # the last view into a shard's mmap must go before the mmap can close
    for shard in set(where.values()):
        shard.close()
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)
            writer.tokenizer_files.append(name)
    return writer.finish()
