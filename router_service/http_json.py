"""A request body parsed as checked JSON (router_service/http_api.py parses with `parse_json`, on a thread for a
large body): JSON as the standard has it (router_service.json_text: no NaN, no integer past Python's digit limit),
nested at most MAX_JSON_DEPTH levels, holding no lone UTF-16 surrogate (`"\\ud800"` is valid JSON but not Unicode
text: protobuf, the tokenizer and every UTF-8 encoder refuse it later) and no key twice in one object; each a 400
naming where.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import time
from collections.abc import Iterator

from router_service.json_text import LONE_SURROGATE, SURROGATE_ESCAPE, encodes, strict_json
from router_service.openai_errors import ApiError

MAX_JSON_DEPTH = 64  # OpenAI bodies nest 4 deep (messages[i].content[j].text); chat_template_kwargs a few more
# A lone surrogate can only come from a \uD800-\uDFFF escape (json_text.SURROGATE_ESCAPE): the body is decoded
# strictly, so raw surrogate bytes fail to decode (json.loads would decode bytes with surrogatepass).


class RepeatedKey(dict):
    """A body's object that held `key` more than once (json keeps its last value): json_problem names where."""

    key: str = ""


def _object(pairs: list) -> dict:
    """json's object_pairs_hook: the object, marked when a key repeats."""
    value = dict(pairs)
    if len(value) == len(pairs):
        return value
    marked, seen = RepeatedKey(value), set()
    for key, _ in pairs:
        if key in seen:
            marked.key = key
            break
        seen.add(key)
    return marked


# A pause older than this takes no more parses: once those in it end, the collector runs again (its first young
# collection frees the cycles made meanwhile), however closely parses follow one another.
PAUSE_LIMIT_S = 2.0
_paused = 0  # parses running with the collector paused
_pause_began = 0.0
_was_enabled = False  # whether the collector ran before the pause
_pausing = threading.Lock()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The garbage collector off while a parse runs: json.loads holds the GIL throughout when it calls no Python
    code (arrays), and each list it made counted toward a collection rescanning those made so far: the event loop
    stalled 2.7 s on 15 MiB of `[[[1]]]`, 0.75 s without. A parsed body holds no reference cycle."""
    global _paused, _pause_began, _was_enabled
    with _pausing:
        joined = _paused == 0 or time.monotonic() - _pause_began < PAUSE_LIMIT_S
        if joined:
            if _paused == 0:
                _was_enabled, _pause_began = gc.isenabled(), time.monotonic()
                gc.disable()
            _paused += 1
    try:
        yield
    finally:
        if joined:
            with _pausing:
                _paused -= 1
                if _paused == 0 and _was_enabled:
                    gc.enable()


def parse_json(raw: bytes | bytearray):
    """A body as checked JSON (no I/O: a large one may be parsed on a thread); raises a 400 ApiError."""
    with collector_paused():
        return _parse(raw)


def _parse(raw: bytes | bytearray):
    repeated = False

    def objects(pairs: list) -> dict:
        nonlocal repeated
        value = _object(pairs)
        repeated = repeated or isinstance(value, RepeatedKey)
        return value

    try:
        text = raw.decode(json.detect_encoding(raw))  # UTF-8, or UTF-16/32 as JSON allows
        # NaN and Infinity are no JSON; a lone surrogate or a repeated key is found below, naming where it is
        value = strict_json(text, check_integers=False, check_surrogates=False, object_pairs_hook=objects)
    except RecursionError:
        raise ApiError(400, f"the body is not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    # Cheap tests on the text first: a large prompt of token ids is walked only when it could fail.
    if repeated or text.count("[") + text.count("{") > MAX_JSON_DEPTH or SURROGATE_ESCAPE.search(text):
        problem = json_problem(value)
        if problem is not None:
            path, what = problem
            raise ApiError(400, f"{path or 'the body'}: {what}", param=path.partition("[")[0].partition(".")[0] or None)
    return value


def json_problem(value) -> tuple[str, str] | None:
    """(path, what) of the first place, in document order, in a parsed JSON value nested past MAX_JSON_DEPTH,
    holding a lone surrogate (in a string or a key) or a repeated key; None when there is none. Iterative (a deep
    value cannot exhaust the stack), with one iterator per open container and a path built only for a problem: a
    stack of every waiting child with its path took ~40x a wide body's bytes, which the garbage collector rescanned
    over and over (seconds)."""
    open_: list = []  # an iterator over each open container's (key, child) pairs, outermost first
    keys: list = []  # the key (or list index) in its parent of each open container but the outermost
    item, key = value, None  # the item visited, and its key in the innermost open container (None: the root)
    while True:
        if isinstance(item, (dict, list)):
            problem = _container_problem(item, len(open_), keys, key)
            if problem is not None:
                return problem
            if item:  # an empty one has nothing more to check
                if open_:
                    keys.append(key)
                open_.append(iter(item.items()) if isinstance(item, dict) else enumerate(item))
        elif isinstance(item, str) and not encodes(item):
            return _path(keys, key), LONE_SURROGATE
        while open_:  # the next item: the innermost open container's next child, else its parent's
            pair = next(open_[-1], None)
            if pair is not None:
                key, item = pair
                break
            open_.pop()
            if keys:
                keys.pop()
        else:
            return None


def _container_problem(item: dict | list, depth: int, keys: list, key) -> tuple[str, str] | None:
    """What is wrong with a container itself, its children aside: too deep, a repeated key, a key with a lone
    surrogate."""
    if depth >= MAX_JSON_DEPTH:
        return _path(keys, key), f"nested deeper than {MAX_JSON_DEPTH} levels"
    if not item or isinstance(item, list):
        return None
    if isinstance(item, RepeatedKey):  # readers differ on which value counts (Python's json: the last)
        path = _path(keys, key)
        return (f"{path}.{item.key}" if path else item.key), "appears twice in one object"
    if not all(encodes(k) for k in item if isinstance(k, str)):
        return _path(keys, key) or "the body", "holds a key with a lone UTF-16 surrogate"
    return None


def _path(keys: list, key) -> str:
    """`messages[2].content`: the path of the item under `key` in the container that `keys` lead to."""
    path = ""
    for step in (*keys, key) if key is not None else keys:
        path = f"{path}[{step}]" if isinstance(step, int) else (f"{path}.{step}" if path else step)
    return path
