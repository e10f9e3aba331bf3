"""Token id lists as the command line gives them (`--tokens 1,2,3`)."""

from __future__ import annotations

import re

# ASCII decimal only: int() also reads "1_0" as 10 and other scripts' digits ("١٢" as 12) as ids.
_ID = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)


def parse_id_list(text: str) -> list[int]:
    """The comma-separated integers of `text` (spaces around the commas allowed, and one trailing comma). Anything
    else is a ValueError saying what: an empty item ("1,,2" lost an id), a word that is no decimal integer."""
    items = text.split(",")
    if len(items) > 1 and not items[-1].strip():
        items.pop()
    if len(items) == 1 and not items[0].strip():
        return []
    for i, item in enumerate(items):
        if not item.strip():
            raise ValueError(f"item {i} is empty in {text!r} (expected comma-separated integers)")
        if not _ID.fullmatch(item):
            raise ValueError(f"expected comma-separated integers, got {item.strip()!r} in {text!r}")
    return [int(item) for item in items]
