"""Tool calls parsed from generated text, per format: content and calls of whole replies (malformed, parallel,
text before and after), and the same reply streamed split at every point gives exactly the unary answer."""

import json
import random

import pytest

from router_service.tool_calls import (
    ToolCallDelta,
    ToolCallParser,
    detect_format,
    parse_tool_calls,
)

NAMES = ["get_weather", "add"]


def hermes(name, args, raw=None):
    return f"<tool_call>\n{raw or json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def calls_of(result):
    content, calls = result
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


# (format, reply, content, [(name, arguments)])
CASES = [
    ("hermes", hermes("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    (
        "hermes",
        "Let me look.\n\n" + hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("add", {"a": 1, "b": 2}),
        "Let me look.",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
    ),
    ("hermes", "plain text, no call\n", "plain text, no call\n", []),
    ("hermes", "  spaces kept  ", "  spaces kept  ", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", hermes("rm_rf", {}), hermes("rm_rf", {}), []),  # not one of the request's tools
    ("hermes", hermes("add", [1, 2]), hermes("add", [1, 2]), []),  # arguments not an object
    ("hermes", hermes("", None, '{"name": "add", "arguments": {}, "x": 1}'), None, []),  # an unknown key
    ("hermes", hermes("", None, '{"name": "add"}'), "", [("add", {})]),  # no arguments: {}
    ("hermes", hermes("", None, '{"name": "add", "arguments": "{\\"a\\": 1}"}'), "", [("add", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),  # unclosed, whole
    ("hermes", '<tool_call>\n{"name": "add", "argu', '<tool_call>\n{"name": "add", "argu', []),  # cut short
    ("hermes", "a <tool_ca", "a <tool_ca", []),  # a partial tag at the end is text
    ("hermes", hermes("add", {"a": 1}) + "\nDone.", "Done.", [("add", {"a": 1})]),
    (
        "hermes",
        "Look:\n" + hermes("add", {}) + "\n" + hermes("add", {}) + " \nDone. ",
        "Look:\nDone.",
        [("add", {})] * 2,
    ),
    ("hermes", "  \n" + hermes("add", {}) + "\n", "", [("add", {})]),
    # a closing tag inside an argument's string does not end the call (its JSON does); it did, leaving it content
    ("hermes", hermes("add", {"a": "</tool_call>"}), "", [("add", {"a": "</tool_call>"})]),
    (
        "hermes",
        hermes("add", {"a": "x</tool_call>\n<tool_call>y"}) + "ok",
        "ok",
        [("add", {"a": "x</tool_call>\n<tool_call>y"})],
    ),
    # a malformed body still ends at the first closing tag, and a call after it counts
    (
        "hermes",
        '<tool_call>{"a": 1 oops</tool_call><tool_call>{"name": "add"}</tool_call>',
        '<tool_call>{"a": 1 oops</tool_call>',
        [("add", {})],
    ),
    ("hermes", '<tool_call>{"a": "x</tool_call> text', '<tool_call>{"a": "x</tool_call> text', []),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]',
        "Sure.",
        [("add", {"a": 1}), ("get_weather", {})],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abcdefghi"}]', "", [("add", {"a": 1})]),
    ("mistral", "[TOOL_CALLS] not an array", "[TOOL_CALLS] not an array", []),
    ("mistral", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]', None, []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments": {}}, {"broken"',
        ', {"broken"',
        [("add", {})],
    ),
    ("mistral", 'x [TOOL_CALLS][{"name": "add", "arguments": {}}] after', "x after", [("add", {})]),
    ("mistral", "no calls at all", "no calls at all", []),
    ("generic", '{"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}', "", [("add", {"a": 1})]),
    (
        "generic",
        ' \n{"tool_calls": [{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]}',
        "",
        [("add", {}), ("get_weather", {"city": "Rome"})],
    ),
    ("generic", '{"answer": 42}', '{"answer": 42}', []),
    ("generic", '{"tool_calls": []}', '{"tool_calls": []}', []),
    ("generic", '{"tool_calls": [{"name": "add", "arguments": {}}]} and more', None, []),
    ("generic", "In the beginning", "In the beginning", []),
    ("generic", '{"tool_calls": [{"name": "add", "arguments": {}', None, []),
]


@pytest.mark.parametrize("fmt,reply,content,calls", CASES)
def test_whole_replies(fmt, reply, content, calls):
    got_content, got_calls = calls_of(parse_tool_calls(reply, fmt, NAMES))
    assert got_calls == calls
    assert got_content == (reply if content is None else content)


def stream(fmt, pieces, names=NAMES, parallel=True):
    parser = ToolCallParser(fmt, names, parallel)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return parser, events


def accumulate(events):
    """What an OpenAI client makes of the streamed deltas: content, and calls by index."""
    content, calls = "", {}
    for e in events:
        if isinstance(e, str):
            content += e
            continue
        assert isinstance(e, ToolCallDelta)
        if e.id:
            assert e.index == len(calls) and e.name and e.arguments == ""  # the first piece: id and name only
            calls[e.index] = {"id": e.id, "name": e.name, "arguments": ""}
        else:
            assert not e.name and e.index in calls
            calls[e.index]["arguments"] += e.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("fmt,reply,content,calls", CASES)
def test_streamed_at_every_split_point_equals_the_whole(fmt, reply, content, calls):
    whole, _ = stream(fmt, [reply])
    want = (whole.text, [(c.name, c.arguments) for c in whole.calls])
    splits = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)]
    splits.append(list(reply))  # one character at a time
    rng = random.Random(len(reply))
    for _ in range(5):  # random fragmentations
        cuts = sorted(rng.sample(range(len(reply) + 1), min(4, len(reply) + 1)))
        splits.append([reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])])
    for pieces in splits:
        parser, events = stream(fmt, pieces)
        got_content, got_calls = accumulate(events)
        assert (got_content, [(c["name"], c["arguments"]) for c in got_calls]) == want, pieces
        assert [c["id"] for c in got_calls] == [c.id for c in parser.calls]
        assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parser.calls)


DEEP = "[" * 5000  # past the recursion limit of Python's JSON parser


@pytest.mark.parametrize(
    "fmt,reply",
    [
        ("hermes", "<tool_call>\n" + DEEP + "\n</tool_call>"),
        ("hermes", "<tool_call>\n" + DEEP),  # unclosed: parsed at the end
        ("hermes", hermes("", None, '{"name": "add", "arguments": "' + DEEP + '"}')),  # arguments as JSON text
        ("mistral", "[TOOL_CALLS][" + DEEP),
        ("generic", '{"tool_calls": ' + DEEP),
    ],
)
def test_json_nested_past_the_parser_is_content(fmt, reply):
    """A degenerate model may write brackets without end: its reply is text, whole or streamed."""
    assert parse_tool_calls(reply, fmt, NAMES) == (reply, [])
    _, events = stream(fmt, [reply[:20], reply[20:-5], reply[-5:]])
    assert accumulate(events) == (reply, [])


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", '"\\ud800"'])
@pytest.mark.parametrize("fmt", ["hermes", "mistral", "generic"])
def test_arguments_that_would_not_be_json_are_content(fmt, number):
    """Python's json reads NaN and Infinity, and 1e999 as infinity, then writes them back as NaN / Infinity: the
    call went out with arguments no other JSON reader takes, and this router refused them (400) when the
    conversation sent the call back. Such a call is invalid, as one with malformed JSON is: content."""
    for arguments in (f'{{"a": {number}}}', json.dumps(f'{{"a": {number}}}')):  # an object, or its JSON text
        call = f'{{"name": "add", "arguments": {arguments}}}'
        reply = {"hermes": f"<tool_call>\n{call}\n</tool_call>", "mistral": f"[TOOL_CALLS][{call}]"}.get(
            fmt, f'{{"tool_calls": [{call}]}}'
        )
        assert parse_tool_calls(reply, fmt, NAMES) == (reply, [])
        _, events = stream(fmt, [reply[:20], reply[20:-5], reply[-5:]])
        assert accumulate(events) == (reply, [])
    fine = hermes("add", {"a": 1.5e300, "b": -0.0, "c": 10**30})
    assert json.loads(parse_tool_calls(fine, "hermes", NAMES)[1][0].arguments) == {"a": 1.5e300, "b": -0.0, "c": 10**30}


def test_parallel_false_keeps_the_first_call_and_the_rest_is_content():
    reply = hermes("add", {"a": 1}) + hermes("add", {"a": 2})
    content, calls = calls_of(parse_tool_calls(reply, "hermes", NAMES, parallel=False))
    assert calls == [("add", {"a": 1})] and content == hermes("add", {"a": 2})
    generic = '{"tool_calls": [{"name": "add", "arguments": {}}, {"name": "add", "arguments": {}}]}'
    assert parse_tool_calls(generic, "generic", NAMES, parallel=False) == (generic, [])


def test_without_names_any_function_name_is_a_call():
    assert calls_of(parse_tool_calls(hermes("anything", {}), "hermes")) == ("", [("anything", {})])


def test_ids_are_fresh():
    ids = {c.id for _ in range(50) for c in parse_tool_calls(hermes("add", {}), "hermes", NAMES)[1]}
    assert len(ids) == 50


def test_format_detection_and_errors():
    assert detect_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_format("[TOOL_CALLS] {{ x }}") == "mistral"
    assert detect_format("{{ messages }}") == detect_format(None) == "generic"
    with pytest.raises(ValueError, match="hermes, mistral, generic"):
        ToolCallParser("xml")
    parser = ToolCallParser("hermes")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
    assert parser.finish() == []
