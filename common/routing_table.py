"""The static routing table (LUT) file, version 3: this docstring is the specification; writer and reader follow it.

    offset  bytes  field (all integers little-endian)
    0       4      magic b"CLRT"
    4       4      uint32 version         3 or 2 (the writer's choice, below; version 1 is still read: below)
    8       4      uint32 num_layers      the model's MoE layers only, in the order of ModelConfig.moe_layers
                                          (dense layers have no row: table layer l is model layer moe_layers[l])
    12      4      uint32 vocab_size      equals the model's vocab_size
    16      4      uint32 top_k           entries per token, 1 <= top_k <= num_experts (it may differ from the
                                          model's num_experts_per_tok)
    20      4      uint32 num_experts     equals the model's num_experts
    24      4      uint32 crc32           zlib.crc32 of the model digest, then the body
    28      32     model digest           SHA-256 of the colibri.json of the model the table was built for
                                          (common/model_identity.py: the HF config, the dtype and every
                                          tensor's crc32, so another checkpoint or conversion has another one)
    60      ...    body: uint16[num_layers][vocab_size][top_k], C order, nothing after it

Entry [l][t][j] is the j-th predicted expert of token id t at MoE layer l, most likely first, or NO_EXPERT
(0xFFFF): no prediction (`colibri router-gen --min-share` drops the predictions its corpus gave too small a
share). A token's row holds its predictions first, then NO_EXPERT to the end: a NO_EXPERT entry is never followed
by a real one, the real entries are < num_experts and distinct (a row may be all NO_EXPERT: the token predicts
nothing at that layer). num_experts <= 65535 (ModelConfig), so no expert id is NO_EXPERT. Readers do not rely on
the order of the real entries.

Version 2 is version 3 without NO_EXPERT: every entry < num_experts. The writer writes version 2 for a table with
every entry real (all that existed before --min-share, byte for byte as before, so a reader that knows versions 1
and 2 still loads it) and version 3 only for one with a NO_EXPERT entry.
Version 1 has no model digest: its body starts at 28 and its crc32 covers the body alone. It is read with every
check of version 2 but the model's identity (a table of another model of the same shape loads), and a warning
says so.

The reader checks every header field against the model, the body size (truncation or trailing bytes), the
crc32, the model digest (versions 2 and 3), the entries (range, NO_EXPERT only in version 3 and never before a
real entry, distinctness); each failure is one line naming the file, the field, the found and the expected value
(``RoutingTableError``, a ``ModelFormatError``, exit code 3).

Pure numpy (the router imports it and must never load numba).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from common.errors import InvalidRequestError, ModelFormatError
from common.files import create_new, open_regular
from common.model_config import ModelConfig
from common.model_identity import MANIFEST, file_digest
from common.routing_plan import NO_EXPERT, RoutingPlan  # NO_EXPERT: an entry that predicts nothing (version 3)

log = logging.getLogger("colibri.routing_table")
MAGIC = b"CLRT"
TABLE_FILE = "routing_table.bin"  # a model directory's own table (`colibri router-gen`'s default output)
VERSION = 3  # what the writer writes for a table with a NO_EXPERT entry (VERSION_COMPLETE for one without)
VERSION_COMPLETE = 2
READABLE_VERSIONS = (1, 2, 3)
COUNTS_SUFFIX = ".counts.npz"  # `router-gen --save-counts`: the table's counts, at <table><COUNTS_SUFFIX>
_HEADER = struct.Struct("<4s6I")  # magic, version, num_layers, vocab_size, top_k, num_experts, crc32
DIGEST_SIZE = 32  # the model digest's SHA-256 bytes, after _HEADER (versions 2 and 3)
HEADER_SIZES = {1: _HEADER.size, 2: _HEADER.size + DIGEST_SIZE, 3: _HEADER.size + DIGEST_SIZE}  # 28, 60, 60
HEADER_SIZE = HEADER_SIZES[VERSION]
ENTRY_DTYPE = np.dtype("<u2")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


class RoutingTableError(ModelFormatError):
    """A routing table file is malformed or does not belong to the model."""


def model_digest(model_dir: str | os.PathLike) -> str:
    """The identity a table records and is checked against: the "sha256:<hex>" digest of the model directory's
    colibri.json (the one Info reports as the worker's model_digest)."""
    manifest = Path(model_dir) / MANIFEST
    digest = file_digest(manifest)
    if not digest:  # the table is checked against this model: an unknown identity is no identity to pass
        raise RoutingTableError(f"{manifest}: cannot be read (a routing table is checked against its digest)")
    return digest


def write_routing_table(path: str | os.PathLike, table: np.ndarray, num_experts: int, model_digest: str) -> Path:
    """Writes `table` uint16 [num_layers, vocab_size, top_k] (the module docstring's entries: < num_experts or
    NO_EXPERT after a token's predictions), built for the model whose colibri.json has `model_digest`
    ("sha256:<hex>", `model_digest()`), atomically to `path`: through a new `<path>.tmp` (common.files: a link
    planted at that name is replaced, never written through), renamed. Version 2 when every entry is a
    prediction, else version 3."""
    table = np.asarray(table)
    if table.ndim != 3 or table.shape[2] < 1:
        raise ValueError(f"table must be [num_layers, vocab_size, top_k>=1], got shape {table.shape}")
    _check_entries(
        table, num_experts, lambda field, found, expected: ValueError(f"{field} is {found}, expected {expected}")
    )
    matched = _DIGEST.fullmatch(model_digest)
    if matched is None:
        raise ValueError(f"model_digest must be 'sha256:' and 64 lowercase hex digits, got {model_digest!r}")
    digest = bytes.fromhex(matched.group(1))
    body = np.ascontiguousarray(table, dtype=ENTRY_DTYPE).tobytes()
    num_layers, vocab_size, top_k = table.shape
    crc = zlib.crc32(body, zlib.crc32(digest))
    version = VERSION if (table == NO_EXPERT).any() else VERSION_COMPLETE
    header = _HEADER.pack(MAGIC, version, num_layers, vocab_size, top_k, num_experts, crc) + digest
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with os.fdopen(create_new(tmp), "wb") as f:
            f.write(header)
            f.write(body)
        tmp.replace(path)
    except BaseException as e:
        # A failed or interrupted write leaves no stray .tmp, and the error names the file asked for, not the .tmp.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    return path


class RoutingTable:
    """A loaded, validated table: token id -> predicted experts at every MoE layer of one model."""

    def __init__(self, table: np.ndarray, num_experts: int, moe_layers: list[int], model_digest: str = ""):
        self.table = table  # [L, V, k] uint16
        self.top_k = int(table.shape[2])
        self.num_experts = int(num_experts)
        self.moe_layers = list(moe_layers)  # table layer l is model layer moe_layers[l]
        self.vocab_size = int(table.shape[1])
        self.model_digest = model_digest  # "sha256:<hex>" of the model it was built for; "": version 1, unknown
        # every entry a prediction (no NO_EXPERT): each token predicts top_k experts at every layer, which
        # routing=lut needs (a plan that is the routing names the model's k experts for every token)
        self.complete = not bool((table == NO_EXPERT).any())

    @classmethod
    def load(cls, path: str | os.PathLike, config: ModelConfig, model_digest: str | None) -> RoutingTable:
        """The table at `path`, checked against the model of `config` whose colibri.json has `model_digest`
        (`model_digest()`): a version-2 table built for another model is refused. None checks the shape alone;
        only for a model with no colibri.json yet (convert's keep_hot reads a table of an earlier conversion)."""
        path = Path(path)
        with _open(path) as f:
            version, num_layers, vocab_size, top_k, num_experts, crc, digest = _checked_header(f, path, config)
            data = f.read(num_layers * vocab_size * top_k * ENTRY_DTYPE.itemsize)
        body = memoryview(data)
        if zlib.crc32(body, zlib.crc32(digest)) != crc:  # version 2's covers the digest: a flipped bit is no model
            what = "crc32 of the model digest and the body" if digest else "crc32 of the body"
            raise _fail(path, what, f"{zlib.crc32(body, zlib.crc32(digest)):#010x}", f"{crc:#010x} (from the header)")
        built_for = _check_identity(path, digest, model_digest)
        table = np.frombuffer(body, dtype=ENTRY_DTYPE).reshape(num_layers, vocab_size, top_k).astype(np.uint16)
        _check_entries(table, num_experts, lambda *a: _fail(path, *a), config.moe_layers, gaps=version >= 3)
        return cls(table, num_experts, config.moe_layers, built_for)

    @staticmethod
    def check(path: str | os.PathLike, config: ModelConfig, model_digest: str | None) -> None:
        """What `load` checks without reading the body: the file opens, its header fits the model (its identity
        too, for version 2), its size is the header's shape (a start-up check before a later `load`; the crc32
        and the entries are load's)."""
        path = Path(path)
        with _open(path) as f:
            digest = _checked_header(f, path, config)[-1]
        _check_identity(path, digest, model_digest, warn=False)

    def lookup(self, token_ids: np.ndarray) -> np.ndarray:
        """token_ids [T] -> predicted expert ids [L, T, k] uint16 (one fancy-indexing gather), NO_EXPERT where
        a token predicts nothing more."""
        ids = np.asarray(token_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
            raise InvalidRequestError("token_ids", f"token id {int(bad)} is outside [0, {self.vocab_size})")
        return np.take(self.table, ids, axis=1)  # contiguous [L, T, k] (plain indexing is not)

    def routing_plan(self, token_ids: np.ndarray) -> RoutingPlan:
        """The routing plan of a step whose tokens are `token_ids`: per MoE layer, expert -> indices into
        `token_ids` in CSR form (one gather, then a radix sort per layer); a NO_EXPERT entry lists no token."""
        return RoutingPlan.from_expert_ids(self.moe_layers, self.lookup(token_ids), self.num_experts)


def recorded_model_digest(path: str | os.PathLike) -> str | None:
    """The "sha256:<hex>" model a version-2 table file records, without a model to check it against (convert
    decides by it whether a table left in the directory fits what it wrote); None for a version-1 table or a file
    whose header is not a table's."""
    try:
        with _open(Path(path)) as f:  # a FIFO there is passed over, never waited on
            digest = _read_header(f, Path(path))[-1]
    except RoutingTableError:
        return None
    return _digest_name(digest) or None


def is_routing_table(path: str | os.PathLike) -> bool:
    """Whether the file at `path` begins as a routing table does (its magic), whatever its version or shape; False
    for anything else, a FIFO or a file that cannot be read included."""
    try:
        with _open(Path(path)) as f:
            return f.read(len(MAGIC)) == MAGIC
    except RoutingTableError:
        return False


def _fail(path: Path, field: str, found, expected) -> RoutingTableError:
    return RoutingTableError(f"{path}: {field} is {found}, expected {expected}")


def _open(path: Path) -> BinaryIO:
    try:  # a FIFO or device there is refused saying what it is, never read as missing nor waited on
        return open_regular(path)
    except (FileNotFoundError, IsADirectoryError):
        raise RoutingTableError(f"{path}: routing table not found (build one with `colibri router-gen`)") from None
    except OSError as e:  # unreadable (permissions, an I/O error): one line, as a malformed table is
        raise RoutingTableError(f"{path}: routing table cannot be read: {e.strerror or e}") from None


def _read_header(f: BinaryIO, path: Path) -> tuple[int, int, int, int, int, int, bytes]:
    """(version, num_layers, vocab_size, top_k, num_experts, crc32, model digest bytes: b"" for version 1) of the
    open file, its magic and version checked; the file is left at the body."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise _fail(path, "header size", f"{len(header)} bytes", f"{HEADER_SIZE} bytes (file truncated)")
    magic, version, num_layers, vocab_size, top_k, num_experts, crc = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise _fail(path, "magic", repr(magic), f"{MAGIC!r} (not a Colibri routing table)")
    if version not in READABLE_VERSIONS:
        *older, newest = map(str, READABLE_VERSIONS)
        raise _fail(path, "version", version, f"{', '.join(older)} or {newest}")
    header_size = HEADER_SIZES[version]
    digest = f.read(header_size - _HEADER.size)
    if len(digest) < header_size - _HEADER.size:
        raise _fail(path, "header size", f"{_HEADER.size + len(digest)} bytes", f"{header_size} bytes (truncated)")
    return version, num_layers, vocab_size, top_k, num_experts, crc, digest


def _checked_header(f: BinaryIO, path: Path, config: ModelConfig) -> tuple[int, int, int, int, int, int, bytes]:
    """(version, num_layers, vocab_size, top_k, num_experts, crc32, model digest bytes: b"" for version 1) of the
    open file (`_read_header`), each field checked against the model and the file's size against their shape; the file
    is left at the body. A wrong or oversized file is never read whole."""
    version, num_layers, vocab_size, top_k, num_experts, crc, digest = _read_header(f, path)
    if num_layers != len(config.moe_layers):
        raise _fail(path, "num_layers", num_layers, f"{len(config.moe_layers)} (the model's MoE layers)")
    if vocab_size != config.vocab_size:
        raise _fail(path, "vocab_size", vocab_size, f"{config.vocab_size} (the model's vocab_size)")
    if num_experts != config.num_experts:
        raise _fail(path, "num_experts", num_experts, f"{config.num_experts} (the model's num_experts)")
    if not 1 <= top_k <= num_experts:
        raise _fail(path, "top_k", top_k, f"1..{num_experts} (num_experts)")
    body_size = num_layers * vocab_size * top_k * ENTRY_DTYPE.itemsize
    found = os.fstat(f.fileno()).st_size - HEADER_SIZES[version]
    if found != body_size:
        raise _fail(path, "body size", f"{found} bytes", f"{body_size} bytes (num_layers x vocab_size x top_k x 2)")
    return version, num_layers, vocab_size, top_k, num_experts, crc, digest


def _check_identity(path: Path, digest: bytes, model_digest: str | None, warn: bool = True) -> str:
    """The "sha256:<hex>" model the table was built for ("" for version 1, which records none: warned about),
    refused when it is not `model_digest` (None: the shape alone is checked)."""
    built_for = _digest_name(digest)
    if not digest:
        if warn:
            log.warning(
                "%s: routing table version 1 records no model; checked on its shape alone (rebuild it "
                "with `colibri router-gen` to have it checked against the model)",
                path,
            )
    elif model_digest is not None and built_for != model_digest:
        raise _fail(
            path,
            "model digest",
            f"{_short(built_for)} (the model the table was built for)",
            f"{_short(model_digest)} (this model's colibri.json; another model or conversion: rebuild the "
            "table with `colibri router-gen`)",
        )
    return built_for


def _digest_name(digest: bytes) -> str:
    """A header's model digest as tables and Info name it ("sha256:<hex>"); "" for version 1's none."""
    return "sha256:" + digest.hex() if digest else ""


def _check_entries(table: np.ndarray, num_experts: int, fail, moe_layers: list[int] | None = None, gaps: bool = True):
    """The module docstring's entries: each < num_experts or (`gaps`: version 3) NO_EXPERT, never a real one after
    a NO_EXPERT, the real ones distinct within a token; `fail(field, found, expected)` of the first offender."""

    def row(l: int, t: int) -> str:
        layer = f"layer {l} (model layer {moe_layers[l]})" if moe_layers is not None else f"layer {l}"
        return f"{layer}, token {t}"

    real = table != NO_EXPERT if gaps else np.ones(table.shape, dtype=bool)
    bad = np.argwhere(((table >= num_experts) | (table < 0)) & real)  # < 0: a writer's int array
    if bad.size:
        l, t, j = (int(v) for v in bad[0])
        why = f" (NO_EXPERT={NO_EXPERT} needs version 3)" if table[l, t, j] == NO_EXPERT else ""
        raise fail(f"entry [{row(l, t)}, slot {j}]", int(table[l, t, j]), f"< num_experts={num_experts}{why}")
    if gaps and table.shape[2] > 1:
        after = np.argwhere((~real[:, :, :-1] & real[:, :, 1:]).any(axis=2))
        if after.size:
            l, t = (int(v) for v in after[0])
            raise fail(
                f"experts of [{row(l, t)}]", table[l, t].tolist(), f"predictions first, then NO_EXPERT={NO_EXPERT}"
            )
    if table.shape[2] > 1:
        ordered = np.sort(table, axis=2)  # NO_EXPERT sorts last: its repeats are no duplicates
        dup = np.argwhere(((ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, :-1] != NO_EXPERT)).any(axis=2))
        if dup.size:
            l, t = (int(v) for v in dup[0])
            raise fail(f"experts of [{row(l, t)}]", table[l, t].tolist(), "distinct expert ids")


def _short(digest: str) -> str:
    """A digest as a refusal quotes it: enough hex digits to tell two apart, the line kept short."""
    return digest[: len("sha256:") + 16] if digest.startswith("sha256:") else repr(digest)
