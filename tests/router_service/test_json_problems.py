"""http_json.json_problem: the walk of a parsed body for nesting past MAX_JSON_DEPTH, lone surrogates and repeated
keys. Any body with more than MAX_JSON_DEPTH brackets is walked, so its cost must stay that of the parse: checked
against a plain recursive reference on random values, and in memory on a wide one."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import random
import time
import tracemalloc

from router_service import http_json
from router_service.http_json import MAX_JSON_DEPTH, RepeatedKey, json_problem, parse_json

LONE = "\ud800"


def problems(value, path: str = "", depth: int = 0) -> list[str]:
    """Every place json_problem may name (a plain recursion: the values drawn here are shallow enough)."""
    if isinstance(value, str):
        return [path] if LONE in value else []
    if not isinstance(value, (dict, list)):
        return []
    if depth >= MAX_JSON_DEPTH:
        return [path]
    found = []
    if isinstance(value, RepeatedKey):
        found.append(f"{path}.{value.key}" if path else value.key)
    if isinstance(value, dict):
        if any(LONE in key for key in value):
            found.append(path or "the body")
        children = [((f"{path}.{key}" if path else key), child) for key, child in value.items()]
    else:
        children = [(f"{path}[{i}]", child) for i, child in enumerate(value)]
    for where, child in children:
        found += problems(child, where, depth + 1)
    return found


def draw(rng: random.Random, depth: int, spoil: float):
    """A random JSON value, nested up to `depth`, its strings, keys and objects spoilt with probability `spoil`."""
    kind = rng.random()
    if depth <= 0 or kind < 0.3:
        return rng.choice([1, 2.5, None, True, "text", "a" + LONE if rng.random() < spoil else "b"])
    if kind < 0.65:
        return [draw(rng, depth - 1, spoil) for _ in range(rng.randrange(0, 4))]
    value = {
        (f"k{i}" + (LONE if rng.random() < spoil / 3 else "")): draw(rng, depth - 1, spoil)
        for i in range(rng.randrange(0, 4))
    }
    if value and rng.random() < spoil / 3:
        marked = RepeatedKey(value)
        marked.key = next(iter(value))
        return marked
    return value


def test_the_walk_names_a_problem_exactly_when_there_is_one():
    rng = random.Random()
    for _ in range(3000):
        depth = rng.choice([3, 6, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 2])
        value = draw(rng, depth, rng.choice([0.0, 0.02, 0.2]))
        for _ in range(rng.choice([0, 0, MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH + 1])):
            value = [value] if rng.random() < 0.5 else {"n": value}
        expected = problems(value)
        found = json_problem(value)
        if not expected:
            assert found is None, (found, value)
        else:
            assert found is not None and found[0] in expected, (found, expected)


def test_the_first_problem_is_named_in_document_order():
    value = json.loads('{"a": [1, "x"], "b": ["\\ud800"], "c": {"d": "\\udc00"}}')
    assert json_problem(value) == ("b[0]", json_problem(["\ud800"])[1])


def test_a_wide_body_is_walked_in_little_memory():
    """A body of a million empty containers: each used to wait on the walk's stack with its path, about 120 bytes
    apiece (40x the body; past the body budget's estimate), which the garbage collector scanned over and over (9 s
    of a thread for a 14 MiB body)."""
    raw = b'{"prompt": "x", "x": [' + b"[],{}," * 500_000 + b'"\\ud800"]}'
    value = json.loads(raw)
    tracemalloc.start()
    try:
        found = json_problem(value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found is not None and found[0] == "x[1000000]"
    assert peak < 64 * 1024, f"the walk took {peak} bytes at its peak"


def test_parse_json_still_refuses_what_the_walk_finds():
    for raw, where in [
        (
            b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
            "a" + "[0]" * (MAX_JSON_DEPTH - 1),
        ),
        (b'{"a": [{"b": 1, "b": 2}]}', "a[0].b"),
        (b'{"a": [{"\\ud800": 1}]}', "a[0]"),
    ]:
        try:
            parse_json(raw)
        except Exception as e:
            assert getattr(e, "message", "").startswith(f"{where}: "), (e, where)
        else:
            raise AssertionError(raw)


def collections_during(parse) -> int:
    """How many garbage collections start while `parse` runs."""
    started = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(note)
    try:
        parse()
    finally:
        gc.callbacks.remove(note)
    return len(started)


def test_a_body_of_many_containers_is_parsed_without_the_collector():
    """json.loads holds the GIL from start to end when it calls no Python code (arrays): every list it makes
    counted toward a garbage collection, which rescanned the millions made so far, and the event loop stalled for
    it (2.7 s for 15 MiB of `[[[1]]]`, 0.45 s without the collector). The body's objects hold no cycles."""
    rng = random.Random()
    raw = b'{"prompt": "x", "x": [' + b"[[[1]]]," * rng.randrange(100_000, 200_000) + b"[]]}"
    enabled = gc.isenabled()
    assert enabled  # the test process runs with the collector
    # one pass over what the parse made, once the collector is back on (610 before, one per 700 lists)
    assert collections_during(lambda: parse_json(raw)) <= 2
    assert gc.isenabled()
    gc.disable()  # a process that turned it off keeps it off
    try:
        parse_json(raw)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_parses_on_several_threads_turn_the_collector_back_on_once_all_end():
    raw = b'{"prompt": "x", "x": [' + b"[[1]]," * 20_000 + b"[]]}"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            list(pool.map(lambda _: parse_json(raw), range(8)))
            assert gc.isenabled()


def test_a_pause_takes_no_parse_past_its_limit(monkeypatch):
    """Parses that follow one another closely (a client sending body after body) cannot keep the collector off for
    good: a pause past PAUSE_LIMIT_S takes no more of them, and the collector runs once those in it end."""
    monkeypatch.setattr(http_json, "PAUSE_LIMIT_S", 0.05)
    first, second = http_json.collector_paused(), http_json.collector_paused()
    first.__enter__()
    assert not gc.isenabled()
    time.sleep(0.1)
    second.__enter__()
    first.__exit__(None, None, None)
    try:
        assert gc.isenabled()
    finally:
        second.__exit__(None, None, None)
    assert gc.isenabled()
