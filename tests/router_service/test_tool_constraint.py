"""The constraint a forced tool choice puts on the reply: the generic format's JSON schema (checked with
jsonschema) and the hermes / mistral Lark grammars (checked with llguidance over a real tokenizer) accept
exactly the calls allowed, and what they accept parses as those calls."""

import json

import jsonschema
import llguidance
import pytest

from common.errors import InvalidRequestError
from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import EOS_ID, byte_tokenizer
from router_service.constraints import Constraint, ConstraintCompiler
from router_service.tool_calls import parse_tool_calls
from router_service.tool_constraint import attach_tool_constraint, tool_call_constraint
from tests.helpers import byte_ids

WEATHER = {
    "name": "get_weather",
    "description": "The weather now",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}
NOW = {"name": "now"}  # no parameters: any object
TOOLS = [WEATHER, ADD, NOW]
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
ONE = {"name": "add", "arguments": {"a": 1.5}}


def call_text(fmt, calls):
    if fmt == "generic":
        return json.dumps({"tool_calls": calls})
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    return "[TOOL_CALLS]" + json.dumps(calls)


# (choice, parallel, calls, accepted)
CASES = [
    ("required", True, [PARIS], True),
    ("required", True, [PARIS, ONE, {"name": "now", "arguments": {}}], True),
    ("required", True, [{"name": "now", "arguments": {"x": [1]}}], False),  # no parameters: {} only
    ("required", False, [PARIS, ONE], False),
    ("required", True, [], False),
    ("required", True, [{"name": "rm", "arguments": {}}], False),
    ("required", True, [{"name": "get_weather", "arguments": {"city": 3}}], False),
    ("required", True, [{"name": "get_weather", "arguments": {"days": 1}}], False),  # city required
    ("required", True, [{"name": "get_weather", "arguments": {"city": "x", "wind": 1}}], False),
    ("required", True, [{"name": "get_weather", "arguments": {"city": "x", "days": 0}}], False),
    ("required", True, [{"name": "add"}], False),  # arguments required
    ("required", True, [{"name": "add", "arguments": {"a": 1}, "extra": 1}], False),
    ("add", True, [ONE], True),
    ("add", True, [PARIS], False),
    ("add", False, [ONE, ONE], False),
    ("add", True, [ONE, ONE], False),  # a named function: exactly one call, parallel calls or not
]


@pytest.mark.parametrize("choice,parallel,calls,accepted", CASES)
def test_generic_schema(choice, parallel, calls, accepted):
    kind, spec = tool_call_constraint(TOOLS, choice, parallel, "generic")
    assert kind == "json_schema"
    validator = jsonschema.Draft202012Validator(json.loads(spec))
    assert validator.is_valid({"tool_calls": calls}) == accepted
    assert not validator.is_valid({"tool_calls": [PARIS], "note": "x"})
    if accepted:
        assert [
            c.name for c in parse_tool_calls(call_text("generic", calls), "generic", ["get_weather", "add", "now"])[1]
        ] == [c["name"] for c in calls]


@pytest.fixture(scope="module")
def ll_tokenizer():
    tok = byte_tokenizer()
    tok.add_special_tokens(["[TOOL_CALLS]"])
    return tok, llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=EOS_ID)


def accepts(ll_tok, grammar: str, ids: list[int]) -> bool:
    matcher = llguidance.LLMatcher(ll_tok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
@pytest.mark.parametrize("choice,parallel,calls,accepted", CASES)
def test_grammars(ll_tokenizer, fmt, choice, parallel, calls, accepted):
    tok, ll_tok = ll_tokenizer
    marker = tok.token_to_id("[TOOL_CALLS]")
    kind, grammar = tool_call_constraint(TOOLS, choice, parallel, fmt, marker)
    assert kind == "lark"
    text = call_text(fmt, calls)
    if fmt == "mistral":
        ids = [marker] + ll_tok.tokenize_str(text[len("[TOOL_CALLS]") :])
        # The marker's text spelled out in bytes is not the special token: refused.
        assert not accepts(ll_tok, grammar, byte_ids(text))
    else:
        ids = ll_tok.tokenize_str(text)
    assert accepts(ll_tok, grammar, ids) == accepted, text
    if accepted:
        assert len(parse_tool_calls(text, fmt, ["get_weather", "add", "now"])[1]) == len(calls)


def test_hermes_grammar_refuses_text_before_the_call(ll_tokenizer):
    _, ll_tok = ll_tokenizer
    _, grammar = tool_call_constraint(TOOLS, "required", True, "hermes")
    assert not accepts(ll_tok, grammar, ll_tok.tokenize_str("Sure! " + call_text("hermes", [PARIS])))


def test_auto_and_none_force_nothing_and_the_hook_sets_the_request_constraint():
    assert tool_call_constraint(TOOLS, "auto", True, "hermes") is None
    assert tool_call_constraint(TOOLS, "none", True, "generic") is None
    with pytest.raises(InvalidRequestError, match="tokenizer has no \\[TOOL_CALLS\\]") as e:
        tool_call_constraint(TOOLS, "required", True, "mistral", None)
    assert e.value.field == "tool_choice"
    params = rpb.SamplingParameters()
    attach_tool_constraint(params, ("lark", 'start: "x"'))
    assert params.constraint.grammar == 'start: "x"'
    with pytest.raises(InvalidRequestError) as e:  # a request that brought its own constraint
        attach_tool_constraint(params, ("json_schema", "{}"))
    assert e.value.field == "tool_choice"
    params = rpb.SamplingParameters()
    attach_tool_constraint(params, ("json_schema", "{}"))
    assert params.constraint.json_schema == "{}"


# tool_choice "auto" with strict tools: text, or text then calls whose strict arguments match
STRICT = frozenset({"get_weather"})


def auto_grammar(fmt, ll_tokenizer, parallel=True):
    tok, _ = ll_tokenizer
    kind, grammar = tool_call_constraint(TOOLS, "auto", parallel, fmt, tok.token_to_id("[TOOL_CALLS]"), STRICT)
    assert kind == "lark"
    return grammar


def reply_ids(ll_tokenizer, fmt, text, calls):
    tok, ll_tok = ll_tokenizer
    if not calls:
        return ll_tok.tokenize_str(text)
    if fmt == "mistral":
        return ll_tok.tokenize_str(text) + [tok.token_to_id("[TOOL_CALLS]")] + ll_tok.tokenize_str(json.dumps(calls))
    return ll_tok.tokenize_str(text + call_text(fmt, calls))


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
@pytest.mark.parametrize(
    "text,calls,accepted",
    [
        ("", [], True),
        ("It is sunny in Paris.", [], True),
        ("Line one\nline two <tool_ and [1, 2]", [], True),
        ('{"city": "Paris"}', [], True),  # JSON as text is text here
        ("", [PARIS], True),
        ("Let me check. ", [PARIS], True),
        ("", [PARIS, ONE, {"name": "now", "arguments": {"anything": [1]}}], True),  # add, now: not strict
        ("", [{"name": "get_weather", "arguments": {"city": 3}}], False),  # strict: breaks its schema
        ("", [{"name": "get_weather", "arguments": {"city": "x", "wind": 1}}], False),
        ("", [{"name": "get_weather", "arguments": {"days": 2}}], False),
        ("", [{"name": "rm", "arguments": {}}], False),  # not a tool
        ("", [{"name": "add", "arguments": []}], False),  # arguments: an object
    ],
)
def test_auto_with_strict_tools_takes_text_or_calls_that_match(ll_tokenizer, fmt, text, calls, accepted):
    _, ll_tok = ll_tokenizer
    grammar = auto_grammar(fmt, ll_tokenizer)
    assert accepts(ll_tok, grammar, reply_ids(ll_tokenizer, fmt, text, calls)) == accepted, (text, calls)
    if accepted:
        reply = text + (call_text(fmt, calls) if calls else "")
        content, parsed = parse_tool_calls(reply, fmt, ["get_weather", "add", "now"])
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]


def test_auto_hermes_text_cannot_hold_a_call_that_escapes_the_grammar(ll_tokenizer):
    _, ll_tok = ll_tokenizer
    grammar = auto_grammar("hermes", ll_tokenizer)
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>'
    for reply in ("Sure " + bad, "x <tool_call>\n" + call_text("hermes", [PARIS]), "a <tool_call> b", bad + " after"):
        assert not accepts(ll_tok, grammar, ll_tok.tokenize_str(reply)), reply
    # without parallel calls, one call only
    one = auto_grammar("hermes", ll_tokenizer, parallel=False)
    assert accepts(ll_tok, one, ll_tok.tokenize_str(call_text("hermes", [PARIS])))
    assert not accepts(ll_tok, one, ll_tok.tokenize_str(call_text("hermes", [PARIS, ONE])))


def test_auto_mistral_text_never_spells_the_marker(ll_tokenizer):
    # The parser reads text, where the marker spelled out in bytes looks like the token: text must not hold it,
    # or a call breaking the schema could pass as text and then parse.
    _, ll_tok = ll_tokenizer
    grammar = auto_grammar("mistral", ll_tokenizer)
    spelled = "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": {"city": 3}}])
    assert parse_tool_calls(spelled, "mistral", ["get_weather"])[1]  # what the parser would make of it
    for reply in (spelled, "ok " + spelled, "[TOOL_CALLS]"):
        assert not accepts(ll_tok, grammar, byte_ids(reply)), reply
    assert accepts(ll_tok, grammar, byte_ids("[TOOL_CALL] is not the marker"))


def test_auto_with_strict_tools_is_refused_in_the_generic_format_naming_the_flag():
    with pytest.raises(InvalidRequestError) as e:
        tool_call_constraint(TOOLS, "auto", True, "generic", None, STRICT, "tools[0].function.strict")
    assert e.value.field == "tools[0].function.strict" and "hermes or mistral" in str(e.value)
    assert "\n" not in str(e.value)
    assert tool_call_constraint(TOOLS, "auto", True, "generic") is None  # no strict tool: nothing forced
    with pytest.raises(InvalidRequestError, match="TOOL_CALLS"):
        tool_call_constraint(TOOLS, "auto", True, "mistral", None, STRICT)


# A tool's parameters schema is its own document: its `$ref`s ("#/$defs/...", "#") point into it, not into the call
# schema the router wraps it in, and a call's arguments are an object whatever the schema leaves open.
NESTED = {  # as openai.pydantic_function_tool writes a model with a nested model
    "name": "book",
    "parameters": {
        "type": "object",
        "properties": {"guest": {"$ref": "#/$defs/Guest"}},
        "required": ["guest"],
        "additionalProperties": False,
        "$defs": {
            "Guest": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
    },
}
TREE = {  # recursive: "#" is the tool's parameters
    "name": "tree",
    "parameters": {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "additionalProperties": False,
    },
}
UNTYPED = {"name": "loose", "parameters": {"properties": {"city": {"type": "string"}}}}  # no "type": any value
OWN_REFS = [
    ({"name": "book", "arguments": {"guest": {"name": "Ada"}}}, True),
    ({"name": "book", "arguments": {"guest": {"name": 1}}}, False),
    ({"name": "tree", "arguments": {"v": 1, "kids": [{"v": 2, "kids": []}]}}, True),
    ({"name": "tree", "arguments": {"kids": [{"name": "tree", "arguments": {}}]}}, False),  # "#" is not the call
    ({"name": "loose", "arguments": {"city": "Paris"}}, True),
    ({"name": "loose", "arguments": 5}, False),  # would parse as content, not as the forced call
    ({"name": "loose", "arguments": None}, False),
]


@pytest.mark.parametrize("fmt", ["generic", "hermes", "mistral"])
@pytest.mark.parametrize("call,accepted", OWN_REFS)
def test_a_tools_refs_resolve_in_its_own_schema_and_its_arguments_are_an_object(ll_tokenizer, fmt, call, accepted):
    tok, ll_tok = ll_tokenizer
    marker = tok.token_to_id("[TOOL_CALLS]")
    kind, spec = tool_call_constraint([NESTED, TREE, UNTYPED], "required", True, fmt, marker)
    text = call_text(fmt, [call])
    if fmt == "generic":
        assert jsonschema.Draft202012Validator(json.loads(spec)).is_valid({"tool_calls": [call]}) == accepted
        spec = llguidance.LLMatcher.grammar_from_json_schema(spec)
        ids = ll_tok.tokenize_str(text)
    elif fmt == "mistral":
        ids = [marker] + ll_tok.tokenize_str(text[len("[TOOL_CALLS]") :])
    else:
        ids = ll_tok.tokenize_str(text)
    assert accepts(ll_tok, spec, ids) == accepted, text
    if accepted:
        assert len(parse_tool_calls(text, fmt, ["book", "tree", "loose"])[1]) == 1


def test_a_tool_whose_parameters_cannot_be_an_object_is_refused_at_compile(ll_tokenizer):
    tok, _ = ll_tokenizer
    compiler = ConstraintCompiler(tok.to_str(), tok.get_vocab_size(), [EOS_ID])
    _, grammar = tool_call_constraint([{"name": "s", "parameters": {"type": "string"}}], "s", True, "hermes")
    with pytest.raises(InvalidRequestError, match="nsatisfiable"):
        compiler.matcher(Constraint("grammar", grammar))


@pytest.mark.parametrize("fmt", ["generic", "hermes", "mistral"])
def test_a_tool_schema_is_prepared_alike_in_every_format(ll_tokenizer, fmt):
    """The hermes and mistral grammars embed the call schema as Lark %json, which skipped what a json_schema
    constraint gets: a bound llguidance would round was refused in the generic format only, and dates took
    February 29th of any year there."""
    tok, ll_tok = ll_tokenizer
    marker = tok.token_to_id("[TOOL_CALLS]")
    huge = dict(WEATHER, parameters={"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**53 + 1}}})
    with pytest.raises(InvalidRequestError, match=r"maximum 9007199254740993 is beyond ±2\^53"):
        kind, spec = tool_call_constraint([huge], "required", False, fmt, marker)
        Constraint(kind, spec).grammar()  # the generic format's schema is checked where it compiles
    day = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}
    dated = dict(WEATHER, parameters=day)
    if fmt != "generic":
        _, grammar = tool_call_constraint([dated], "required", False, fmt, marker)
        for date, valid in (("2024-02-29", True), ("2023-02-29", False)):
            text = call_text(fmt, [{"name": "get_weather", "arguments": {"d": date}}])
            ids = (
                [marker] + ll_tok.tokenize_str(text[len("[TOOL_CALLS]") :])
                if fmt == "mistral"
                else ll_tok.tokenize_str(text)
            )
            assert accepts(ll_tok, grammar, ids) == valid, (fmt, date)
