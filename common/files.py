"""Creating the files of a directory being written (a model directory): always a new file at the name, never
through whatever the name held."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from common.errors import ConfigError

COPY_CHUNK = 1 << 20


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """An OSError raised inside without a file name (a write, fsync or ftruncate on a full disk: 'No space left on
    device') gets `path` as its name, so the one-line error says which file."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def pwrite_all(fd: int, data: memoryview, offset: int, path: Path | str) -> None:
    """Writes all of `data` at `offset`. A write cut short (the disk filled up) is retried for the rest, whose
    error (ENOSPC) is raised naming `path`."""
    with naming(path):
        while data:
            written = os.pwrite(fd, data, offset)
            if written <= 0:  # a regular file never takes 0 bytes of a non-empty write but when it cannot
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data, offset = data[written:], offset + written


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _kind(mode: int) -> str:
    return "a directory" if stat.S_ISDIR(mode) else _KINDS.get(stat.S_IFMT(mode), "not a file")


def stat_regular(path: Path | str) -> os.stat_result:
    """os.stat of `path`, which must be a regular file (or a symlink to one), checked before anything opens it:
    opening a FIFO for reading waits for a writer for ever. FileNotFoundError when nothing is there, else an
    OSError whose strerror says what is (`not a regular file (a FIFO)`)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})", str(path))
    return st


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """The regular file at `path` opened for reading. Anything else is an OSError naming it: opening a FIFO waited
    for a writer for ever, holding a service's start-up and its stop signals, and a device such as /dev/zero never
    ends. Checked on the opened file, so a FIFO swapped in after a stat is refused too."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO opens at once
    f = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        f.close()
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        raise OSError(errno.EINVAL, f"not a regular file ({_kind(mode)})", str(path))
    return f


def read_regular(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file at `path` (at most max_bytes + 1 of them, for the caller to refuse); anything
    else is refused as open_regular does."""
    with open_regular(path) as f:
        return f.read(-1 if max_bytes is None else max_bytes + 1)


def read_setting_file(path: Path, setting: str) -> bytes:
    """read_regular(path) for a file a setting names, each failure one ConfigError line naming the setting and the
    file: not found, a directory, not a regular file (a FIFO is refused, never waited on), or the OS's reason."""
    try:
        return read_regular(path)
    except FileNotFoundError:
        raise ConfigError(f"{setting}: {path} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{setting}: {path} is not a file") from None
    except OSError as e:
        raise ConfigError(f"{setting}: {path}: {e.strerror or e}") from None


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
    with naming(path), os.fdopen(create_new(path), "wb") as f:
        f.write(data)


def copy_new(source: Path, path: Path) -> None:
    """`source`'s bytes as a new file at `path` (create_new); a symlink at `source` is followed (a Hugging Face
    cache's snapshot files are links into its blobs), a FIFO or device there refused (open_regular), never read."""
    with open_regular(source) as src, naming(path), os.fdopen(create_new(path), "wb") as dst:
        while True:
            with naming(source):  # a read error names the source, a write error (a full disk) the copy
                chunk = src.read(COPY_CHUNK)
            if not chunk:
                break
            dst.write(chunk)


@contextlib.contextmanager
def replaced_whole(path: Path | str) -> Iterator[BinaryIO]:
    """A binary file whose bytes replace `path` only once all of them are written: into a new hidden file beside it,
    renamed over it at the end. A failure or a Ctrl-C before then (a full disk) removes that file and leaves `path`
    as it was, rather than a truncated file in place of the old one; one a killed run left is removed by the next.
    The new file takes the old one's permission bits. A symlink at `path` is followed, as open()
    would; a name that is no regular file (/dev/stdout, a FIFO) cannot be renamed over and is written directly."""
    target = Path(os.path.realpath(path))
    try:
        mode: int | None = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if mode is not None and not stat.S_ISREG(mode):
        with naming(path), open(target, "wb") as f:
            yield f
        return
    _remove_stale_temps(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fd = create_new(tmp)
    except OSError as e:  # the folder is missing or not writable: named as the operator wrote it
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        if mode is not None:  # the old file's permission bits (an operator's 0600 stays unreadable to others)
            os.fchmod(fd, stat.S_IMODE(mode))
        with naming(path), os.fdopen(fd, "wb") as f:
            yield f
        with naming(path):
            os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _remove_stale_temps(target: Path) -> None:
    """Removes the temporary files replaced_whole left beside `target` in runs that were killed (SIGKILL runs no
    cleanup): those whose process id names no live process."""
    prefix = f".{target.name}."
    with contextlib.suppress(OSError):
        for p in target.parent.iterdir():
            pid = p.name[len(prefix) : -len(".tmp")]
            if p.name.startswith(prefix) and p.name.endswith(".tmp") and pid.isascii() and pid.isdigit():
                if int(pid) != os.getpid() and not _alive(int(pid)):
                    with contextlib.suppress(OSError):
                        p.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process (or no pid a process has): left alone
        return True
    return True
