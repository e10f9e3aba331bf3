"""JSON text read as the standard has it. Python's json also takes NaN, Infinity and -Infinity, which no other
JSON reader does (a tool schema holding them is offered to the model as text no parser reads; the grammar engine
refuses them at a column of the router's own rewrite), reads a lone UTF-16 surrogate escape ("\\ud800", no
character) into a str that UTF-8 cannot encode, and refuses an integer past Python's digit limit with advice to
call sys.set_int_max_str_digits, which is no client's to follow."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

# A lone surrogate can only come from an escape of one; text without such an escape is not walked.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
LONE_SURROGATE = "holds a lone UTF-16 surrogate (\\ud800-\\udfff escapes must form pairs)"


def strict_json(
    text: str | bytes | bytearray, check_integers: bool = True, check_surrogates: bool = True, object_pairs_hook=None
) -> Any:
    """`text` parsed; ValueError naming the problem. check_integers=False leaves integers to json's own scanner (in
    C: a body of a million token ids would otherwise call back into Python for each) and only rewords its
    digit-limit error. check_surrogates=False leaves lone surrogates to the caller (the HTTP body's check names
    where one is). object_pairs_hook: as json.loads's."""
    try:
        value = json.loads(
            text,
            parse_constant=_not_json,
            parse_int=_integer if check_integers else None,
            object_pairs_hook=object_pairs_hook,
        )
    except ValueError as e:
        if "set_int_max_str_digits" in str(e):
            raise ValueError(f"an integer has more than {sys.get_int_max_str_digits()} digits") from None
        raise
    if check_surrogates and _may_escape_a_surrogate(text) and has_lone_surrogate(value):
        raise ValueError(f"a string {LONE_SURROGATE}")
    return value


def has_lone_surrogate(value: Any) -> bool:
    """Whether a parsed JSON value holds a lone surrogate in a string or a key. Iterative: a deep value cannot
    exhaust the stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not encodes(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _may_escape_a_surrogate(text: str | bytes | bytearray) -> bool:
    # bytes may be UTF-16 or UTF-32 (json.loads detects it), which the pattern would not see: always walked
    return not isinstance(text, str) or SURROGATE_ESCAPE.search(text) is not None


def encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _integer(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most {limit})")
    return int(digits)
