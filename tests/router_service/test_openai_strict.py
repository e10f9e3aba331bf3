"""Strict requests on the OpenAI-compatible HTTP API: every field of OpenAI's and vLLM's completions and chat
schemas is implemented (and acts), refused with a 400 naming it, or on the documented list of fields that cannot
change the output; a field in neither schema is refused too."""

import asyncio
import re
from pathlib import Path

import pytest

from router_service import openai_fields
from router_service.openai_errors import ApiError
from router_service.openai_request import parse_request
from tests.helpers import byte_ids
from tests.router_service.test_openai_http import http_router

openai = pytest.importorskip("openai", reason="the HTTP tests drive the router with the test extra's openai client")

BASE = {"completion": {"prompt": "x"}, "chat": {"messages": [{"role": "user", "content": "x"}]}}
BOTH = ("completion", "chat")

# (field, value, other fields the value needs, what must follow from it); the kinds it applies to.
IMPLEMENTED = [
    (BOTH, "model", "m", {}, lambda p: p.kind in BOTH),
    (BOTH, "max_tokens", 7, {}, lambda p: p.parameters.max_new_tokens == 7),
    (BOTH, "max_completion_tokens", 7, {}, lambda p: p.parameters.max_new_tokens == 7),
    (BOTH, "temperature", 0.5, {}, lambda p: p.parameters.temperature == 0.5),
    (BOTH, "top_p", 0.5, {}, lambda p: p.parameters.top_p == 0.5),
    (BOTH, "seed", 3, {}, lambda p: p.parameters.seed == 3),
    (BOTH, "stop", ["END"], {}, lambda p: list(p.parameters.stop_sequences) == ["END"]),
    (BOTH, "stream", True, {}, lambda p: p.stream),
    (BOTH, "stream_options", {"include_usage": True}, {"stream": True}, lambda p: p.include_usage),
    (BOTH, "presence_penalty", 0.5, {}, lambda p: p.parameters.presence_penalty == 0.5),
    (BOTH, "frequency_penalty", 0.5, {}, lambda p: p.parameters.frequency_penalty == 0.5),
    (("completion",), "logprobs", 2, {}, lambda p: p.parameters.logprobs and p.parameters.top_logprobs == 2),
    (("chat",), "logprobs", True, {}, lambda p: p.parameters.logprobs),
    (("chat",), "top_logprobs", 3, {"logprobs": True}, lambda p: p.parameters.top_logprobs == 3),
    (BOTH, "top_k", 5, {}, lambda p: p.parameters.top_k == 5),
    (BOTH, "min_tokens", 2, {}, lambda p: p.parameters.min_new_tokens == 2),
    (BOTH, "stop_token_ids", [3], {}, lambda p: list(p.parameters.stop_token_ids) == [3]),
    (BOTH, "ignore_eos", True, {}, lambda p: p.parameters.ignore_eos),
    (BOTH, "repetition_penalty", 1.5, {}, lambda p: p.parameters.repetition_penalty == 1.5),
    (BOTH, "prompt_logprobs", 2, {}, lambda p: p.parameters.prompt_logprobs == 2 and p.prompt_logprobs),
    (BOTH, "truncate_prompt_tokens", 5, {}, lambda p: p.parameters.truncate_input_tokens == 5),
    (BOTH, "min_p", 0.25, {}, lambda p: p.parameters.min_p == 0.25),
    (BOTH, "logit_bias", {"5": 100, "7": -2.5}, {}, lambda p: dict(p.parameters.logit_bias) == {5: 100.0, 7: -2.5}),
    (BOTH, "response_format", {"type": "json_object"}, {}, lambda p: p.parameters.constraint.HasField("json_schema")),
    (BOTH, "guided_json", {"type": "object"}, {}, lambda p: '"object"' in p.parameters.constraint.json_schema),
    (BOTH, "guided_regex", "[a-z]+", {}, lambda p: p.parameters.constraint.regex == "[a-z]+"),
    (BOTH, "guided_choice", ["yes", "no"], {}, lambda p: list(p.parameters.constraint.choice.choices) == ["yes", "no"]),
    (BOTH, "guided_grammar", 'root ::= "a"', {}, lambda p: p.parameters.constraint.grammar == 'root ::= "a"'),
    (BOTH, "structured_outputs", {"regex": "a"}, {}, lambda p: p.parameters.constraint.regex == "a"),
    (("completion",), "prompt", "hello", {}, lambda p: p.prompt == "hello"),
    (("chat",), "messages", [{"role": "user", "content": "hi"}], {}, lambda p: p.messages[0]["content"] == "hi"),
    (("chat",), "add_generation_prompt", False, {}, lambda p: not p.chat_options.add_generation_prompt),
    (("chat",), "continue_final_message", True, {}, lambda p: p.chat_options.continue_final_message),
    (("chat",), "chat_template_kwargs", {"a": 1}, {}, lambda p: p.chat_options.template_kwargs == {"a": 1}),
    (
        ("chat",),
        "tools",
        [{"type": "function", "function": {"name": "f"}}],
        {},
        lambda p: p.chat_options.tools.names == ["f"],
    ),
    (
        ("chat",),
        "tool_choice",
        "none",
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        lambda p: p.chat_options.tools.choice == "none",
    ),
    (
        ("chat",),
        "parallel_tool_calls",
        False,
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        lambda p: not p.chat_options.tools.parallel,
    ),
    (BOTH, "n", 3, {}, lambda p: p.n == 3),
    (BOTH, "cache_salt", "tenant", {}, lambda p: p.cache_salt == "tenant"),
    (("completion",), "best_of", 3, {"n": 2}, lambda p: p.best_of == 3 and p.n == 2),
    (("completion",), "echo", True, {"logprobs": 2}, lambda p: p.echo and p.parameters.prompt_logprobs == 2),
]
# (field, a value asking for something the router does not do, a value asking for nothing or None)
REFUSED = [
    (("chat",), "best_of", 3, 1),
    (BOTH, "use_beam_search", True, False),
    (BOTH, "length_penalty", 0.5, 1.0),
    (BOTH, "include_stop_str_in_output", True, False),
    (BOTH, "skip_special_tokens", False, True),
    (BOTH, "spaces_between_special_tokens", False, True),
    (BOTH, "allowed_token_ids", [1, 2], None),
    (BOTH, "bad_words", ["no"], []),
    (BOTH, "guided_whitespace_pattern", " ", None),
    (BOTH, "structural_tag", "{}", None),
    (BOTH, "logits_processors", ["mod.fn"], []),
    (BOTH, "priority", 5, 0),
    (BOTH, "request_id", "abc", None),
    (BOTH, "return_tokens_as_token_ids", True, False),
    (BOTH, "return_token_ids", True, False),
    (BOTH, "kv_transfer_params", {"a": 1}, None),
    (BOTH, "vllm_xargs", {"a": 1}, None),
    (("chat",), "echo", True, False),
    (("completion",), "suffix", "end", ""),
    (("completion",), "add_special_tokens", False, True),
    (("completion",), "prompt_embeds", "AAAA", None),
    (("chat",), "add_special_tokens", True, False),
    (("chat",), "functions", [{"name": "f"}], []),
    (("chat",), "function_call", {"name": "f"}, "auto"),
    (("chat",), "audio", {"voice": "alloy", "format": "wav"}, None),
    (("chat",), "modalities", ["text", "audio"], ["text"]),
    (("chat",), "moderation", {"model": "m"}, None),
    (("chat",), "reasoning_effort", "low", None),
    (("chat",), "verbosity", "low", None),
    (("chat",), "web_search_options", {}, None),
    (("chat",), "documents", [{"title": "t", "text": "x"}], []),
    (("chat",), "chat_template", "{{ messages }}", None),
    (("chat",), "mm_processor_kwargs", {"a": 1}, {}),
    (("chat",), "include_reasoning", False, True),
]
IGNORED = [
    (BOTH, "user", "u-1"),
    (BOTH, "guided_decoding_backend", "xgrammar"),
    (("chat",), "safety_identifier", "s"),
    (("chat",), "metadata", {"k": "v"}),
    (("chat",), "store", True),
    (("chat",), "service_tier", "flex"),
    (("chat",), "prompt_cache_key", "k"),
    (("chat",), "prompt_cache_retention", "24h"),
    (("chat",), "prompt_cache_options", {"ttl": "1h"}),
    (("chat",), "prediction", {"type": "content", "content": "x"}),
]


def rows(table):
    return [(kind, *row[1:]) for row in table for kind in row[0]]


def parse(kind: str, **fields):
    return parse_request(BASE[kind] | fields, kind, "m")


def refusal(kind: str, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(body, kind, "m")
    assert e.value.status == 400 and e.value.type == "invalid_request_error", e.value.body()
    return e.value


@pytest.mark.parametrize("kind, name, value, needs, check", rows(IMPLEMENTED))
def test_an_implemented_field_acts(kind, name, value, needs, check):
    assert check(parse(kind, **needs, **{name: value})), (kind, name)


@pytest.mark.parametrize("kind, name, value, neutral", rows(REFUSED))
def test_a_refused_field_is_a_400_naming_it_unless_it_asks_for_nothing(kind, name, value, neutral):
    error = refusal(kind, BASE[kind] | {name: value})
    assert error.param == name and error.message.startswith(f"{name}: not supported by this server"), error.body()
    assert parse(kind, **{name: neutral}) == parse(kind), (kind, name, neutral)
    assert parse(kind, **{name: None}) == parse(kind), (kind, name)


@pytest.mark.parametrize("kind, name, value", rows(IGNORED))
def test_an_ignored_field_changes_nothing(kind, name, value):
    assert parse(kind, **{name: value}) == parse(kind)


def test_the_tables_cover_every_field_the_code_knows():
    """Every field the router classifies is exercised above, in the class the code gives it, and vice versa."""
    for kind in BOTH:
        tested = {
            "implemented": {r[1] for r in rows(IMPLEMENTED) if r[0] == kind},
            "refused": {r[1] for r in rows(REFUSED) if r[0] == kind},
            "ignored": {r[1] for r in rows(IGNORED) if r[0] == kind},
        }
        code = {
            "implemented": set(openai_fields.IMPLEMENTED[kind]),
            "refused": set(openai_fields.REFUSED[kind]),
            "ignored": set(openai_fields.IGNORED[kind]),
        }
        assert tested == code, kind


def test_docs_list_every_field():
    """docs/api.md's field table names each field the router classifies, with its class."""
    docs = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    table = docs[docs.index("### Request fields") :]
    classes = {
        "implemented": openai_fields.IMPLEMENTED,
        "refused": openai_fields.REFUSED,
        "ignored": openai_fields.IGNORED,
    }
    for label, by_kind in classes.items():
        for name in set(by_kind["completion"]) | set(by_kind["chat"]):
            assert re.search(rf"^\| [^|\n]*`{name}`[^|\n]* \| {label}", table, re.M), (name, label)


@pytest.mark.parametrize(
    "kind, name",
    [
        ("completion", "frobnicate"),
        ("chat", "frobnicate"),
        ("completion", "top_logprobs"),  # chat's: a completion's top log-probabilities are `logprobs`
        ("completion", "messages"),
        ("completion", "add_generation_prompt"),
        ("chat", "prompt"),
        ("chat", "suffix"),
    ],
)
def test_a_field_of_neither_schema_or_of_the_other_endpoint_is_refused(kind, name):
    error = refusal(kind, BASE[kind] | {name: 1})
    assert error.param == name and "not a field of /v1/" in error.message, error.body()


def test_nested_fields_are_checked_too():
    user = {"role": "user", "content": "x"}
    for message, param in [
        ({"role": "assistant", "content": "", "function_call": {"name": "f"}}, "messages[1].function_call"),
        (user | {"colour": "red"}, "messages[1].colour"),
        ({"role": "assistant", "content": "y", "annotations": [{"type": "url_citation"}]}, "messages[1].annotations"),
    ]:
        error = refusal("chat", {"messages": [user, message]})
        assert error.param == param, error.body()
    echoed = {
        "role": "assistant",
        "content": "y",
        "refusal": None,
        "tool_calls": [],
        "audio": None,
        "name": None,
        "annotations": [],
    }
    assert parse("chat", messages=[user, echoed]).messages[1] is echoed  # the openai client's model_dump()
    for options, param in [
        ({"include_obfuscation": True}, "stream_options.include_obfuscation"),
        ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
        ({"include_usage": True, "extra": 1}, "stream_options.extra"),
    ]:
        error = refusal("completion", {"prompt": "x", "stream": True, "stream_options": options})
        assert error.param == param, error.body()
    assert parse("completion", stream=True, stream_options={"include_obfuscation": False}).stream


@pytest.mark.parametrize("kind", BOTH)
@pytest.mark.parametrize("value", ["yes", 1, 0, [True], {"x": True}])
def test_include_usage_of_the_wrong_type_is_named_with_its_path(kind, value):
    """The error names `stream_options.include_usage`, as the table's checks name the keys inside stream_options."""
    error = refusal(kind, BASE[kind] | {"stream": True, "stream_options": {"include_usage": value}})
    assert error.param == "stream_options.include_usage", error.body()
    assert error.message.startswith("stream_options.include_usage: must be a boolean"), error.body()


@pytest.mark.parametrize("kind", BOTH)
def test_an_empty_cache_salt_is_refused_not_read_as_no_salt(kind):
    """An empty salt (a tenant id left unset) would share the unsalted requests' cache: refused, as vLLM does.
    null or no salt at all is the unsalted default."""
    error = refusal(kind, BASE[kind] | {"cache_salt": ""})
    assert error.param == "cache_salt" and error.message.startswith("cache_salt: must not be empty"), error.body()
    assert parse(kind, cache_salt=None).cache_salt == parse(kind).cache_salt == ""
    assert parse(kind, cache_salt=" ").cache_salt == " "


def test_the_first_offending_field_is_named():
    error = refusal("completion", {"prompt": "x", "user": "u", "min_p": 0.2, "bad_words": ["a"], "echo": True})
    assert error.param == "bad_words"


@pytest.mark.parametrize(
    "bias, param, words",
    [
        ([5], "logit_bias", "an object"),
        ({"-1": 1}, "logit_bias[-1]", "token id"),
        ({"x": 1}, "logit_bias[x]", "token id"),
        ({"5": "1"}, "logit_bias[5]", "a number"),
        ({"5": True}, "logit_bias[5]", "a number"),
        ({"5": 10**400}, "logit_bias[5]", "float range"),
    ],
)
def test_a_malformed_logit_bias_is_a_400_naming_the_entry(bias, param, words):
    error = refusal("chat", BASE["chat"] | {"logit_bias": bias})
    assert error.param == param and words in error.message, error.body()


@pytest.mark.slow
def test_the_openai_client_gets_a_400_naming_a_vllm_field_the_router_does_not_do(worker, tiny_model, tmp_path):
    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            messages = [{"role": "user", "content": "Hi"}]
            for extra, param in [
                ({"guided_whitespace_pattern": " +"}, "guided_whitespace_pattern"),
                ({"structural_tag": "{}"}, "structural_tag"),
                ({"bad_words": ["Hi"]}, "bad_words"),
            ]:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(
                        model="model", messages=messages, max_tokens=4, extra_body=extra
                    )
                assert e.value.status_code == 400 and e.value.param == param, e.value
                assert param in e.value.message
                with pytest.raises(openai.BadRequestError) as e:
                    await client.completions.create(model="model", prompt="Hi", max_tokens=4, extra_body=extra)
                assert e.value.param == param
            # Ignored and neutral fields are served, and the answer is the one without them.
            plain = await client.chat.completions.create(model="model", messages=messages, max_tokens=4, temperature=0)
            decorated = await client.chat.completions.create(
                model="model",
                messages=messages,
                max_tokens=4,
                temperature=0,
                n=1,
                user="u-1",
                metadata={"k": "v"},
                store=False,
                extra_body={"min_p": 0.0, "guided_json": None},
            )
            assert decorated.choices[0].message.content == plain.choices[0].message.content

    asyncio.run(body())


@pytest.mark.slow
def test_the_openai_client_gets_logit_bias_and_min_p_honoured(worker, tiny_model, tmp_path):
    """A +100 bias forces its token at every greedy step; min_p 1 at temperature 1 keeps only the top token, so it
    answers as greedy does; an id outside the vocabulary is a 400 naming the entry."""
    forced = byte_ids("Z")[0]

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            common = dict(model="model", prompt="Hi", max_tokens=5, extra_body={"ignore_eos": True})
            biased = await client.completions.create(**common, temperature=0, logit_bias={str(forced): 100})
            assert biased.choices[0].text == "ZZZZZ"
            greedy = await client.completions.create(**common, temperature=0)
            assert greedy.choices[0].text != "ZZZZZ"
            min_p = await client.completions.create(
                **common | {"extra_body": {"ignore_eos": True, "min_p": 1.0}}, temperature=1.0, seed=4
            )
            assert min_p.choices[0].text == greedy.choices[0].text
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model="model", messages=[{"role": "user", "content": "Hi"}], logit_bias={"100000": 5}
                )
            assert e.value.param == "logit_bias[100000]" and "token id" in e.value.message, e.value

    asyncio.run(body())


@pytest.mark.slow
def test_a_constraint_the_grammar_engine_refuses_is_a_400_naming_the_clients_field(worker, tiny_model, tmp_path):
    """The refusal comes from compiling the grammar, after the body was read: it names the field the client
    wrote, not the gRPC one the router translated it into."""

    async def body():
        async with http_router(worker, tiny_model, tmp_path) as (router, stub, client, base):
            messages = [{"role": "user", "content": "Hi"}]
            schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
            for kwargs, param in [
                ({"response_format": schema_format}, "response_format.json_schema.schema"),
                ({"extra_body": {"guided_json": {"type": "foo"}}}, "guided_json"),
                ({"extra_body": {"guided_regex": "(a"}}, "guided_regex"),
                ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs.regex"),
            ]:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="model", messages=messages, max_tokens=4, **kwargs)
                message = e.value.body["message"]
                assert e.value.param == param and message.startswith(param + ": "), e.value
                assert "\n" not in message

    asyncio.run(body())


@pytest.mark.parametrize("kind", ["text", "json_object"])
def test_a_json_schema_beside_another_response_format_type_is_refused(kind):
    """`{"type": "text", "json_schema": {...}}` answered unconstrained text, and with "json_object" any object: the
    schema the client sent was dropped silently (a client that forgot `"type": "json_schema"` never knew)."""
    schema = {"name": "x", "schema": {"type": "integer"}}
    body = {"prompt": "x", "response_format": {"type": kind, "json_schema": schema}}
    with pytest.raises(ApiError) as e:
        parse_request(body, "completion", "m")
    assert e.value.param == "response_format.json_schema" and 'type "json_schema"' in e.value.message, e.value
    for asks_nothing in ({"type": kind}, {"type": kind, "json_schema": None}):
        parse_request({"prompt": "x", "response_format": asks_nothing}, "completion", "m")
