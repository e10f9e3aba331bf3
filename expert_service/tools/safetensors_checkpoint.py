"""Reading a Hugging Face safetensors checkpoint for `colibri convert`: its shard files (memory-mapped, one tensor
at a time), the index that says which shard holds each tensor, and its other files as bytes. Pickle checkpoints
(.bin/.pt) are never loaded."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import struct
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
from safetensors import SafetensorError, safe_open

from common import dtypes
from common.errors import ModelFormatError
from common.files import open_regular, read_regular
from common.strict_json import parse_json
from expert_service.tools import hf_fp8

# F8_E4M3 only with its block scales (hf_fp8.py); safetensors' numpy loader cannot read it, our mmap can.
SOURCE_DTYPES = {**dtypes.SAFETENSORS_NAMES, hf_fp8.FP8: "float8_e4m3fn"}
GIT_LFS_POINTER = b"version https://git-lfs.github.com/spec/"
T = TypeVar("T")


def _open_shard(path: Path) -> BinaryIO:
    """The shard at `path` opened for reading, refused in one line unless it is a regular file holding more than a
    Git LFS pointer (which safe_open calls 'header too large'). A FIFO is named, never waited on: safe_open blocked
    for ever on one (holding the GIL), and of a directory said 'No such device', naming no file."""
    why = "every *.safetensors here is read as a shard"
    try:
        file = open_regular(path)
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: {'a link to nothing' if path.is_symlink() else 'not found'}; {why}") from None
    except IsADirectoryError:
        raise ModelFormatError(f"{path}: not a regular file (a directory); {why}") from None
    except OSError as e:
        raise ModelFormatError(f"{path}: {e.strerror or e}; {why}") from None
    if file.read(len(GIT_LFS_POINTER)) == GIT_LFS_POINTER:
        file.close()
        raise ModelFormatError(
            f"{path}: a Git LFS pointer, not the weights (run `git lfs pull` in the checkpoint's clone)"
        )
    return file


class SafetensorsShard:
    """One checkpoint file. `safetensors.safe_open` parses and validates the header (names, dtypes, shapes,
    offsets that tile the data inside the file); tensors are read as views of our own read-only mmap at the
    header's offsets, because safe_open hands numpy a copy of each tensor (and has no numpy bfloat16). The file
    is opened once, checked, and everything is read from that opening: a FIFO swapped in at its name since is
    never opened."""

    def __init__(self, path: Path):
        self.path = path
        with _open_shard(path) as file:
            # safe_open opens a name itself, with a blocking open: it gets this opening's own name
            try:
                with safe_open(f"/proc/self/fd/{file.fileno()}", framework="numpy") as f:
                    self.tensors = {
                        name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()
                    }
            except SafetensorError as e:
                raise ModelFormatError(f"{path}: not a valid safetensors file ({e})") from None
            file.seek(0)  # safe_open does not expose offsets: read them from the checked header
            (header_len,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_len))
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._begin = {name: 8 + header_len + int(header[name]["data_offsets"][0]) for name in self.tensors}

    def read(self, name: str) -> tuple[np.ndarray, str]:
        """(storage array view, dtype name) of one tensor."""
        safetensors_dtype, shape = self.tensors[name]
        dtype = SOURCE_DTYPES.get(safetensors_dtype)
        if dtype is None:
            raise ModelFormatError(
                f"{self.path}: tensor {name} has dtype {safetensors_dtype}, supported: {', '.join(SOURCE_DTYPES)}"
            )
        raw = np.frombuffer(
            self._map, dtype=np.uint8, count=math.prod(shape) * dtypes.itemsize(dtype), offset=self._begin[name]
        )
        return raw.view(dtypes.STORAGE[dtype]).reshape(shape), dtype

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> SafetensorsShard:
        return self

    def __exit__(self, error_type: object, error: BaseException | None, frames: object) -> None:
        if error is None:
            self.close()
            return
        _clear_left_frames(error)
        with contextlib.suppress(BufferError):  # a view a frame still running holds: the map goes with that view
            self.close()


def _clear_left_frames(error: BaseException) -> None:
    """The frames an error left keep their locals as long as the error is held, views into a shard's map among them
    (the tensor being written): they are cleared, the error keeping its message and lines, so that the map can close
    now. So are those of the errors it was raised from or while handling, when they were caught in one of its frames
    (an error a caller was handling when it converted is left as it is)."""
    frames, tb = set(), error.__traceback__
    while tb is not None:
        frames.add(tb.tb_frame)
        tb = tb.tb_next
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if id(current) in seen or current.__traceback__ is None:
            continue
        seen.add(id(current))
        if current is error or current.__traceback__.tb_frame in frames:
            traceback.clear_frames(current.__traceback__)  # a frame still running is left as it is
            pending += [e for e in (current.__cause__, current.__context__) if e is not None]


@contextlib.contextmanager
def open_checkpoint(hf_dir: Path) -> Iterator[dict[str, SafetensorsShard]]:
    """Tensor name -> the shard holding it, from `model.safetensors.index.json` or the shard files. The shards'
    maps are closed on leaving, however it is left: a conversion that fails part-way leaves none open."""
    shards = sorted(hf_dir.glob("*.safetensors"))
    if not shards:
        pickles = [p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = f" (found pickle checkpoints {pickles}: these are never loaded; save as safetensors)" if pickles else ""
        raise ModelFormatError(f"{hf_dir}: no .safetensors files{hint}")
    with contextlib.ExitStack() as opened_shards:
        opened = {p.name: opened_shards.enter_context(SafetensorsShard(p)) for p in shards}
        yield _tensor_shards(hf_dir, opened)


def _tensor_shards(hf_dir: Path, opened: dict[str, SafetensorsShard]) -> dict[str, SafetensorsShard]:
    """Tensor name -> the shard holding it among the `opened` shards (file name -> shard) of `hf_dir`."""
    index_path = hf_dir / "model.safetensors.index.json"
    where: dict[str, SafetensorsShard] = {}
    index_bytes = read_checkpoint_file(index_path)
    if index_bytes is not None:
        index: Any = parse_json(index_bytes, index_path, ModelFormatError)
        try:
            weight_map = dict(index["weight_map"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{index_path}: malformed index ({type(e).__name__}: {e})") from None
        for name, file in weight_map.items():
            if file not in opened:
                raise ModelFormatError(f"{index_path}: tensor {name} maps to missing shard {file}")
            if name not in opened[file].tensors:
                raise ModelFormatError(f"{index_path}: tensor {name} maps to shard {file}, which does not hold it")
            where[name] = opened[file]
    else:
        for shard in opened.values():
            for name in shard.tensors:
                if name in where:  # no index to say which copy is meant: never keep one silently
                    raise ModelFormatError(
                        f"{hf_dir}: tensor {name} is in both {where[name].path.name} and {shard.path.name} "
                        f"and there is no model.safetensors.index.json"
                    )
                where[name] = shard
    return where


def read_checkpoint_file(path: Path) -> bytes | None:
    """The bytes of the checkpoint's file at `path`, None when nothing is there (checkpoint_file)."""
    return checkpoint_file(path, read_regular)


def checkpoint_file(path: Path, get: Callable[[Path], T]) -> T | None:
    """get(path) (read_regular, stat_regular) for a file of the checkpoint, None when nothing is there. A FIFO or
    device is refused, named as what it is, never waited on; a link to nothing is a broken download, not an absent
    file; each failure is one ModelFormatError line naming the file."""
    try:
        return get(path)
    except FileNotFoundError:
        if path.is_symlink():  # a link into a cache's blob that is gone
            raise ModelFormatError(f"{path}: not found") from None
        return None
    except IsADirectoryError:
        raise ModelFormatError(f"{path}: not a regular file (a directory)") from None
    except OSError as e:
        raise ModelFormatError(f"{path}: {e.strerror or e}") from None
