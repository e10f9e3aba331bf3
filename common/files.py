"""Creating the files of a directory being written (a model directory): always a new file at the name, never
through whatever the name held."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def create_new(path: Path) -> int:
    """A file descriptor (read-write) of a new, empty file at `path`. Whatever `path` held is unlinked first, so a
    symlink there (into another model, at /etc/...) or a hard link shared with another directory is replaced, never
    written through; and a reader that mapped the old file keeps its bytes. O_EXCL | O_NOFOLLOW: a link placed
    there between the unlink and the open is refused (FileExistsError naming the path), not followed."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)


def write_new(path: Path, data: bytes) -> None:
    """`data` as a new file at `path` (create_new)."""
    with os.fdopen(create_new(path), "wb") as f:
        f.write(data)


def copy_new(source: Path, path: Path) -> None:
    """`source`'s bytes as a new file at `path` (create_new); a symlink at `source` is followed (a Hugging Face
    cache's snapshot files are links into its blobs)."""
    with open(source, "rb") as src, os.fdopen(create_new(path), "wb") as dst:
        shutil.copyfileobj(src, dst)
