"""JSON text read as the standard has it. Python's json also takes NaN, Infinity and -Infinity, which no other
JSON reader does (a tool schema holding them is offered to the model as text no parser reads; the grammar engine
refuses them at a column of the router's own rewrite), and refuses an integer past Python's digit limit with
advice to call sys.set_int_max_str_digits, which is no client's to follow."""

from __future__ import annotations

import json
import sys
from typing import Any


def strict_json(text: str | bytes | bytearray, check_integers: bool = True) -> Any:
    """`text` parsed; ValueError naming the problem. check_integers=False leaves integers to json's own scanner (in
    C: a body of a million token ids would otherwise call back into Python for each) and only rewords its
    digit-limit error."""
    try:
        if check_integers:
            return json.loads(text, parse_constant=_not_json, parse_int=_integer)
        return json.loads(text, parse_constant=_not_json)
    except ValueError as e:
        if "set_int_max_str_digits" in str(e):
            raise ValueError(f"an integer has more than {sys.get_int_max_str_digits()} digits") from None
        raise


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _integer(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most {limit})")
    return int(digits)
