"""Chat templates with tools render as transformers' apply_chat_template(..., tools=...) renders them: Qwen2.5's
template (hermes calls), a Mistral-style one (9-character call ids) and the plain template of the default model,
from OpenAI-shaped requests (tools, an assistant's tool_calls with JSON-text arguments, tool results)."""

import copy
import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from common.errors import InvalidRequestError
from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import PLAIN_CHAT_TEMPLATE, byte_tokenizer
from router_service.chat import ChatTemplate, message_dicts
from router_service.tokenizer import Tokenizer
from router_service.tool_calls import detect_format, parse_tool_calls
from router_service.tool_request import from_openai, from_pb, mistral_ids

TEMPLATES = Path(__file__).parent / "templates"
ROOT = Path(__file__).resolve().parents[2]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time, ISO 8601"}},
]
CALL = {
    "id": "call_5f3a9e0b7c1d4e2fa6b8c0d1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "C"}'},
}
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": '{"temp": 21}'},
]


def hf_messages(messages):
    """The conversation as transformers' docs write it: arguments as dicts."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if m.get("content") is None:
            m.pop("content", None)
    return out


def hf_render(source, messages, tools):
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), bos_token="<s>", eos_token="</s>")
    tok.chat_template = source
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def ours(source, messages, body_extra=None, fmt=None):
    tools = from_openai({"tools": TOOLS, **(body_extra or {})})
    dicts = message_dicts(messages)
    if fmt == "mistral":
        dicts = mistral_ids(dicts)
    template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    return template.render(dicts, tools=tools.template_tools())


@pytest.mark.parametrize("name", ["qwen2_5.jinja", "plain"])
def test_tools_render_as_transformers_renders_them(name):
    source = PLAIN_CHAT_TEMPLATE.read_text() if name == "plain" else (TEMPLATES / name).read_text()
    want = hf_render(source, hf_messages(CONVERSATION), TOOLS)
    assert ours(source, CONVERSATION) == want
    assert '"name": "get_weather"' in want and "Zürich" in want and '{"temp": 21}' in want
    # tool_choice none: the tools are not shown (the calls in the history still are)
    assert ours(source, CONVERSATION, {"tool_choice": "none"}) == hf_render(source, hf_messages(CONVERSATION), None)


def test_mistral_style_template_gets_nine_character_ids():
    source = (TEMPLATES / "mistral_style.jinja").read_text()
    assert detect_format(source) == "mistral" and detect_format((TEMPLATES / "qwen2_5.jinja").read_text()) == "hermes"
    with pytest.raises(Exception, match="length 9"):  # the OpenAI id as it is: the template refuses it
        hf_render(source, hf_messages(CONVERSATION), TOOLS)
    mapped = mistral_ids(message_dicts(CONVERSATION))
    short = mapped[2]["tool_calls"][0]["id"]
    assert len(short) == 9 and short.isalnum() and mapped[3]["tool_call_id"] == short
    conversation = copy.deepcopy(CONVERSATION)
    conversation[2]["tool_calls"][0]["id"] = conversation[3]["tool_call_id"] = short
    assert ours(source, CONVERSATION, fmt="mistral") == hf_render(source, hf_messages(conversation), TOOLS)
    assert mistral_ids([{"role": "tool", "tool_call_id": "abcDEF123"}])[0]["tool_call_id"] == "abcDEF123"


def test_the_default_model_ships_the_plain_template():
    assert (ROOT / "training/default-model-hf/chat_template.jinja").read_text() == PLAIN_CHAT_TEMPLATE.read_text()
    template = ChatTemplate.load(ROOT / "training/default-model-hf")
    assert template is not None and detect_format(template.source) == "generic"
    text = template.render([{"role": "user", "content": "Who made the heavens?"}])
    assert text == "<s>User: Who made the heavens?\n\nAssistant:"


def test_grpc_messages_render_like_openai_ones():
    source = (TEMPLATES / "qwen2_5.jinja").read_text()
    request = rpb.ChatRequest(
        messages=[
            rpb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id", ""))
            for m in CONVERSATION
        ],
        tools=[rpb.Tool(name=t["function"]["name"], description=t["function"]["description"]) for t in TOOLS],
    )
    request.messages[2].tool_calls.append(
        rpb.ToolCall(id=CALL["id"], name="get_weather", arguments=CALL["function"]["arguments"])
    )
    request.tools[0].parameters_json = json.dumps(TOOLS[0]["function"]["parameters"])
    tools = from_pb(request)
    assert tools is not None and tools.choice == "auto" and tools.parallel
    template = ChatTemplate(source, {})
    assert template.render(message_dicts(request.messages), tools=tools.template_tools()) == ours(source, CONVERSATION)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"tools": {"x": 1}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools[0].function.colour"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ],
)
def test_bad_tools_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as e:
        from_openai(body)
    assert e.value.field == field


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array", "items": {}}, {"type": ["null"]}])
def test_parameters_that_cannot_be_an_object_are_refused_naming_the_tool(parameters):
    """A call's arguments are always an object (the parser takes nothing else): such a tool could never be called.
    Under auto it was accepted and never called; forced, its 400 named `tools` with the grammar engine's
    "Unsatisfiable schema: required property 'tool_calls' is unsatisfiable", which names neither tool nor cause."""
    for choice in ("auto", "required"):
        body = {"tools": [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": parameters}}]}
        with pytest.raises(InvalidRequestError) as e:
            from_openai({**body, "tool_choice": choice})
        assert e.value.field == "tools[1].function.parameters"
        assert 'type "object"' in str(e.value) and "\n" not in str(e.value)
        request = rpb.ChatRequest(tools=[rpb.Tool(name="f", parameters_json=json.dumps(parameters))])
        with pytest.raises(InvalidRequestError) as e:
            from_pb(request)
        assert e.value.field == "tools[0].parameters_json"  # the gRPC field the client wrote
    with pytest.raises(InvalidRequestError) as e:
        from_pb(rpb.ChatRequest(tools=[rpb.Tool(name="f", parameters_json="[]")]))
    assert e.value.field == "tools[0].parameters_json"
    for fine in ({"type": "object"}, {"type": ["object", "null"]}, {"properties": {"a": {}}}, {}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": fine}}]
        assert from_openai({"tools": tools}).tools[0]["parameters"] == fine


def test_grpc_json_text_nested_past_the_parser_names_the_field():
    deep = "[" * 10**5
    with pytest.raises(InvalidRequestError) as e:
        from_pb(rpb.ChatRequest(tools=[rpb.Tool(name="f", parameters_json=deep)]))
    assert e.value.field == "tools[0].parameters_json"
    message = rpb.ChatMessage(role="assistant", tool_calls=[rpb.ToolCall(id="x", name="f", arguments=deep)])
    with pytest.raises(InvalidRequestError) as e:
        message_dicts([message])
    assert e.value.field == "messages[0].tool_calls[0].function.arguments"


def test_grpc_json_text_escaping_a_lone_surrogate_names_the_field():
    """JSON text whose string escapes a lone surrogate ("\\ud800") parsed into a str UTF-8 cannot encode: the
    rendered prompt then failed to become a GenerateRequest, an internal error instead of the caller's 400."""
    lone = '{"type": "object", "description": "\\ud800"}'
    with pytest.raises(InvalidRequestError) as e:
        from_pb(rpb.ChatRequest(tools=[rpb.Tool(name="f", parameters_json=lone)]))
    assert e.value.field == "tools[0].parameters_json" and "surrogate" in str(e.value)
    message = rpb.ChatMessage(role="assistant", tool_calls=[rpb.ToolCall(id="x", name="f", arguments='{"\\udc00": 1}')])
    with pytest.raises(InvalidRequestError) as e:
        message_dicts([message])
    assert e.value.field == "messages[0].tool_calls[0].function.arguments"


def test_strict_is_accepted_where_it_is_enforced():
    strict = [{"type": "function", "function": {"name": "f", "strict": True}}]
    assert from_openai({"tools": strict, "tool_choice": "required"}).is_forced
    assert from_openai({"tools": strict, "tool_choice": "none"}).template_tools() is None
    named = from_openai({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert named.choice == "now" and named.is_forced
    # "auto" with a strict tool constrains the reply (text, or calls that match) without forcing a call
    auto = from_openai({"tools": [{"type": "function", "function": {"name": "g"}}] + strict})
    assert auto.choice == "auto" and not auto.is_forced and auto.is_constrained
    assert auto.strict == {"f"} and auto.strict_field == "tools[1].function.strict"
    assert not from_openai({"tools": TOOLS}).is_constrained


@pytest.mark.parametrize(
    "message,field",
    [
        ({"role": "assistant", "tool_calls": {"id": "x"}}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "x"}]}, "messages[0].tool_calls[0].function"),
        (
            {"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "[1]"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (  # nested past Python's JSON parser
            {"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "[" * 10**5}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (  # a lone surrogate escape inside the JSON text: valid-looking, but no character
            {
                "role": "assistant",
                "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"role": "assistant", "tool_calls": [{"id": 3, "function": {"name": "f"}}]}, "messages[0].tool_calls[0].id"),
        ({"role": "tool", "tool_call_id": 7, "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "name": ["x"], "content": "x"}, "messages[0].name"),
    ],
)
def test_bad_tool_messages_name_the_field(message, field):
    with pytest.raises(InvalidRequestError) as e:
        message_dicts([message])
    assert e.value.field == field


def test_arguments_that_are_no_json_say_why():
    """The parser's reason follows the field: a lone surrogate, a position, NaN."""
    cases = {'{"a": "\\ud800"}': "surrogate", '{"a": 1': "line 1 column", '{"a": NaN}': "NaN is not a JSON number"}
    for arguments, reason in cases.items():
        call = {"id": "x", "function": {"name": "f", "arguments": arguments}}
        with pytest.raises(InvalidRequestError) as e:
            message_dicts([{"role": "assistant", "tool_calls": [call]}])
        assert "must be the JSON text of an object: " in str(e.value) and reason in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "reply",
    [
        " And God said, Let there be light.",  # the model's words follow "Assistant:" with their own space
        "\nIn the beginning",
        " two  spaces and a trailing newline\n",
        ' {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
    ],
)
def test_a_reply_as_generated_renders_back_after_the_generation_prompt(reply):
    """The next turn's prompt starts with this turn's prompt and the reply, text and token ids alike, so the
    prefix cache can serve the earlier turns whole."""
    template = ChatTemplate.load(ROOT / "training/default-model-hf")
    tokenizer = Tokenizer.from_model_dir(ROOT / "training/default-model-hf")
    conversation = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"}]
    content, calls = parse_tool_calls(reply, "generic", {"get_weather"})
    answer = {"role": "assistant", "content": content or None}
    if calls:
        answer["tool_calls"] = [{"id": c.id, "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    messages = message_dicts([*conversation, answer, {"role": "user", "content": "Thanks."}])
    prompt_and_reply = template.render(conversation) + reply
    text = template.render(messages)
    assert text[: len(prompt_and_reply)] == prompt_and_reply
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.encode(prompt_and_reply, add_special_tokens=False)
    assert ids[: len(expected)] == expected
