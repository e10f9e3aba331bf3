"""Confidence-gated routing tables (`colibri router-gen --min-share F`) and the counts file they are cut from.

A token's share of an expert at a MoE layer is the fraction of the token's occurrences in the traced corpus whose
exact top-k at that layer included the expert: count(token, expert) / occurrences(token), in [0, 1] (the k shares
of a token sum to at most the model's k). It is the prediction's precision on the corpus: a share of 0.3 means
the expert was used at 30 % of the token's occurrences, so prefetching it for that token copies a block used
about that often. Measured per occurrence rather than per routing (count / (k x occurrences)), it reads the same
whatever the model's k, and F spans [0, 1).

`gate_by_share` keeps a table entry only where its share is >= F and writes NO_EXPERT (common/routing_table.py,
version 3) elsewhere. A table ranks each token's experts most counted first, so the shares fall along a row and
the kept entries are its first ones (the format's "predictions first"). F = 0 keeps every entry: the table as
router-gen always built it. A token id the corpus never holds has no share: its fallback ranking (the gate on its
embedding) is a guess at chance level past the first MoE layer (docs/routing.md), so any F > 0 drops it whole.
The same goes for a seen token's entries past its counted experts (the fallback filled them: share 0).

`router-gen --save-counts` writes `<table>.counts.npz` beside the table: `counts` uint32 [L, V, k] (each
entry's count; 0 for NO_EXPERT), `occurrences` uint32 [V], `table_crc32` (zlib.crc32 of the table's uint16
entries, so a counts file is never applied to another table) and `min_share` (the F the table was built with; absent
from older files: 0). A benchmark cuts the table at any F at or above that with it (`bench/offload_plan.py`) without
tracing the corpus again, and gets exactly `router-gen --min-share F`'s table; below it the predictions the gate
dropped are gone, and such a cut is refused.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.files import write_new
from common.routing_table import COUNTS_SUFFIX, NO_EXPERT


@dataclass(frozen=True)
class TableCounts:
    """What `--save-counts` writes beside the table (module docstring)."""

    counts: np.ndarray  # int64 [L, V, k]: how often each table entry's expert was chosen for its token
    occurrences: np.ndarray  # int64 [V]: each token id's occurrences in the traced training part


def shares(counts: np.ndarray, occurrences: np.ndarray) -> np.ndarray:
    """counts [L, V, k] of a table's entries, occurrences [V] -> each entry's share, float64 (0 for a token
    never seen)."""
    return counts / np.maximum(occurrences, 1).astype(np.float64)[None, :, None]


def check_min_share(value: float, flag: str = "--min-share") -> float:
    """F in [0, 1): 1 or more would drop every prediction (a share is at most 1)."""
    if not (np.isfinite(value) and 0 <= value < 1):
        raise ConfigError(f"{flag}: must be in [0, 1), got {value}")
    return float(value)


def gate_by_share(table: np.ndarray, counts: np.ndarray, occurrences: np.ndarray, min_share: float) -> np.ndarray:
    """A copy of `table` [L, V, k] with NO_EXPERT wherever the entry's share is < min_share (module docstring);
    min_share 0: the table unchanged."""
    out = np.array(table, dtype=np.uint16, copy=True)
    if min_share > 0:
        out[shares(counts, occurrences) < min_share] = NO_EXPERT
    return out


def counts_path_for(table_path: Path) -> Path:
    return table_path.with_name(table_path.name + COUNTS_SUFFIX)


def write_counts(
    table_path: Path, table: np.ndarray, counts: np.ndarray, occurrences: np.ndarray, min_share: float = 0.0
) -> Path:
    """`<table_path>.counts.npz` (module docstring) of a table gated at `min_share`, created new at its name (a link
    there is replaced)."""
    buffer = io.BytesIO()
    crc = zlib.crc32(np.ascontiguousarray(table, dtype="<u2").tobytes())
    np.savez(
        buffer,
        counts=counts.astype(np.uint32),
        occurrences=occurrences.astype(np.uint32),
        table_crc32=np.uint32(crc),
        min_share=np.float64(min_share),
    )
    path = counts_path_for(table_path)
    write_new(path, buffer.getvalue())
    return path


def read_counts(table_path: Path, table: np.ndarray, cuts: Iterable[float] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(counts [L, V, k], occurrences [V]) of the table at `table_path` (its entries `table`), from the counts file
    beside it, to cut the table at each share of `cuts`; one line naming the file when it is missing, belongs to
    another table or was gated above a cut."""
    path = counts_path_for(Path(table_path))
    try:
        with np.load(path, allow_pickle=False) as data:
            counts, occurrences, crc = data["counts"], data["occurrences"], int(data["table_crc32"])
            built_at = float(data["min_share"]) if "min_share" in data.files else 0.0
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: not found (build the table with `colibri router-gen --save-counts` to cut it by share)"
        ) from None
    # not an .npz, cut short, or a field of another shape (TypeError: an array where a number belongs)
    except (OSError, ValueError, TypeError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{path}: not a router-gen counts file ({e})") from None
    if crc != zlib.crc32(np.ascontiguousarray(table, dtype="<u2").tobytes()) or counts.shape != table.shape:
        raise ConfigError(f"{path}: the counts of another table than {table_path} (rebuild both with router-gen)")
    if occurrences.shape != (table.shape[1],):
        raise ConfigError(f"{path}: occurrences has shape {occurrences.shape}, expected ({table.shape[1]},)")
    if not 0 <= built_at < 1:  # NaN too: no cut compares below it, so the check below would pass every cut
        raise ConfigError(f"{path}: min_share is {built_at}, expected a share in [0, 1) (rebuild it with router-gen)")
    # a table gated at F0 lost the predictions whose share is below F0: cut lower, it would still be the F0 table
    if below := sorted(f for f in cuts if f < built_at):
        raise ConfigError(
            f"{path}: {table_path} was built with --min-share {built_at:g}, so it cannot be cut at a share below that "
            f"({', '.join(f'{f:g}' for f in below)}; build it with --min-share 0 --save-counts to cut it anywhere)"
        )
    return counts, occurrences
