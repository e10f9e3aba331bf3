"""JSON files read strictly: values that would later overflow or recurse, and keys written twice, are refused
with a one-line error naming the file."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from common.files import read_regular
from common.unique_keys import DuplicateKeyError, unique_pairs

MAX_JSON_DEPTH = 64  # a model manifest is 4 levels deep
_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def load_json(path: Path, error: type[Exception]) -> object:
    """A JSON file as Python values, refusing what would later overflow or recurse: NaN/Infinity, numbers
    that do not fit a double (1e999), nesting deeper than a manifest ever needs; and a key repeated in one
    object, which would silently lose all but its last value."""
    return parse_json(read_regular(path), path, error)  # opened without blocking: a FIFO swapped in is refused


def parse_json(data: bytes, path: Path, error: type[Exception]) -> object:
    """`load_json` of bytes already read from `path` (the file its errors name)."""

    def reject_constant(name: str):
        raise error(f"{path}: {name} is not a valid JSON number here")

    def finite_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise error(f"{path}: number {text} is out of range")
        return value

    try:
        text = data.decode()
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
        return json.loads(
            text, parse_constant=reject_constant, parse_float=finite_float, object_pairs_hook=unique_pairs
        )
    except DuplicateKeyError as e:
        raise error(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
