"""Tool calling end to end through the real router, with the official `openai` client and the gRPC stubs.

The models here cannot decide to call a tool, so the replies that must parse come from a fake worker that
generates a scripted reply (tests/router_service/fake_worker.py, `script`): the router's tokenizer, detokenizer,
parser, both fronts and their streaming are real. The round trip of a tool conversation (assistant tool_calls ->
tool result -> the final answer) runs on the real CPU worker and the tiny model's own chat template.
"""

import asyncio
import contextlib
import json

import grpc
import pytest

from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import PLAIN_CHAT_TEMPLATE, byte_tokenizer
from router_service import frontend as frontend_module
from router_service.tokenizer import Tokenizer
from tests.helpers import byte_ids, free_port, running_router
from tests.router_service.fake_worker import FakeWorker, harness

openai = pytest.importorskip("openai", reason="the HTTP tests drive the router with the test extra's openai client")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
USER = [{"role": "user", "content": "Weather in Paris and the time?"}]
GENERIC = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]}'
HERMES_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}<tool_call> example"
HERMES = (
    'Checking — é.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
WANT_CALLS = [("get_weather", {"city": "Paris"}), ("now", {})]


@contextlib.asynccontextmanager
async def scripted(tmp_path, reply: str, template: str | None = None):
    """The router (HTTP and gRPC) over a fake worker whose every reply is `reply`."""
    path = tmp_path / "chat.jinja"
    path.write_text(template or PLAIN_CHAT_TEMPLATE.read_text())
    fake = FakeWorker(script=byte_ids(reply))
    settings = dict(http_port=free_port(), chat_template=str(path), max_new_tokens=512, default_max_new_tokens=512)
    async with harness(fake, tokenizer=Tokenizer(byte_tokenizer()), **settings) as (router, fake, stub, _):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0)
        try:
            yield client, stub
        finally:
            await client.close()


def calls_of(tool_calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


async def streamed(client, **kwargs):
    """The accumulated deltas of a streamed chat, as an OpenAI client adds them up."""
    content, calls, reasons, roles = "", {}, [], []
    async for chunk in await client.chat.completions.create(model="fake", messages=USER, stream=True, **kwargs):
        choice = chunk.choices[0]
        roles += [choice.delta.role] if choice.delta.role else []
        content += choice.delta.content or ""
        reasons += [choice.finish_reason] if choice.finish_reason else []
        for d in choice.delta.tool_calls or ():
            if d.id:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    assert roles == ["assistant"]
    return content, [calls[i] for i in sorted(calls)], reasons


@pytest.mark.parametrize(
    "fmt,reply,template,content",
    [("generic", GENERIC, None, None), ("hermes", HERMES, HERMES_TEMPLATE, "Checking — é.")],
)
def test_openai_client_gets_tool_calls_whole_and_streamed(tmp_path, fmt, reply, template, content):
    async def body():
        async with scripted(tmp_path, reply, template) as (client, _):
            answer = await client.chat.completions.create(model="fake", messages=USER, tools=TOOLS)
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content == content
            assert calls_of(choice.message.tool_calls) == WANT_CALLS
            ids = [c.id for c in choice.message.tool_calls]
            assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
            got_content, got_calls, reasons = await streamed(client, tools=TOOLS)
            assert got_content == (content or "") and reasons == ["tool_calls"]
            assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == WANT_CALLS
            assert [c["arguments"] for c in got_calls] == [c.function.arguments for c in choice.message.tool_calls]
            # No tools: the same reply is plain text; tool_choice none: too.
            plain = await client.chat.completions.create(model="fake", messages=USER)
            assert plain.choices[0].message.content == reply and plain.choices[0].finish_reason == "stop"
            none = await client.chat.completions.create(model="fake", messages=USER, tools=TOOLS, tool_choice="none")
            assert none.choices[0].message.content == reply and not none.choices[0].message.tool_calls
            single = await client.chat.completions.create(
                model="fake", messages=USER, tools=TOOLS, parallel_tool_calls=False
            )
            if fmt == "hermes":  # one call only: the second is content
                assert calls_of(single.choices[0].message.tool_calls) == WANT_CALLS[:1]
                assert '"now"' in single.choices[0].message.content
            else:  # the generic format's reply is one value: two calls where one is allowed do not parse
                assert single.choices[0].message.content == reply and not single.choices[0].message.tool_calls

    asyncio.run(body())


def test_a_reply_that_looks_like_a_call_but_does_not_parse_is_content(tmp_path):
    broken = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}'  # cut short

    async def body():
        async with scripted(tmp_path, broken) as (client, _):
            answer = await client.chat.completions.create(model="fake", messages=USER, tools=TOOLS)
            assert answer.choices[0].message.content == broken and answer.choices[0].finish_reason == "stop"
            content, calls, reasons = await streamed(client, tools=TOOLS)
            assert (content, calls, reasons) == (broken, [], ["stop"])
            cut = await client.chat.completions.create(model="fake", messages=USER, tools=TOOLS, max_tokens=20)
            assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == broken[:20]

    asyncio.run(body())


def test_grpc_chat_returns_tool_calls_whole_and_streamed(tmp_path):
    async def body():
        async with scripted(tmp_path, HERMES, HERMES_TEMPLATE) as (_, stub):
            request = dict(
                messages=[rpb.ChatMessage(role="user", content="hi")],
                tools=[
                    rpb.Tool(name="get_weather", parameters_json=json.dumps(TOOLS[0]["function"]["parameters"])),
                    rpb.Tool(name="now"),
                ],
            )
            answer = await stub.Chat(rpb.ChatRequest(**request))
            assert answer.text == "Checking — é." and answer.stop_reason == rpb.STOP_REASON_EOS
            assert [(c.index, c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [
                (0, *WANT_CALLS[0]),
                (1, *WANT_CALLS[1]),
            ]
            text, calls = "", {}
            async for message in stub.ChatStream(rpb.ChatStreamRequest(**request)):
                text += message.text
                for piece in message.tool_calls:
                    if piece.id:
                        calls[piece.index] = [piece.id, piece.name, ""]
                    calls[piece.index][2] += piece.arguments
            assert text == answer.text
            assert [(n, a) for _, n, a in calls.values()] == [(c.name, c.arguments) for c in answer.tool_calls]
            for bad, field in [
                (
                    rpb.ChatRequest(
                        messages=request["messages"], tool_choice=rpb.ToolChoice(mode=rpb.TOOL_CHOICE_MODE_REQUIRED)
                    ),
                    "tool_choice",
                ),
                (rpb.ChatRequest(**request, tool_choice=rpb.ToolChoice(function_name="rm")), "tool_choice"),
                # quoted whole, a 100 kB name passed the metadata limit: RESOURCE_EXHAUSTED, not the field's error
                (rpb.ChatRequest(**request, tool_choice=rpb.ToolChoice(function_name="r" * 100_000)), "tool_choice"),
                (
                    rpb.ChatRequest(messages=request["messages"], tools=[rpb.Tool(name="f", parameters_json="{")]),
                    "tools[0].parameters_json",
                ),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Chat(bad)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)
                assert len(e.value.details()) < 1100

    asyncio.run(body())


def test_forced_tool_choice_attaches_the_constraint(tmp_path, monkeypatch):
    """`required` and a named function go through the enforcement hook with the template format's constraint
    (the default-model tests in test_constrained.py check that the engine enforces it); a forced call together
    with response_format is refused (400 naming tool_choice): the reply cannot match both."""

    async def body():
        async with scripted(tmp_path, GENERIC) as (client, _):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model="fake",
                    messages=USER,
                    tools=TOOLS,
                    tool_choice="required",
                    response_format={"type": "json_object"},
                )
            assert e.value.body["param"] == "tool_choice"
            attached = []
            monkeypatch.setattr(frontend_module, "attach_tool_constraint", lambda p, c, field: attached.append(c))
            named = {"type": "function", "function": {"name": "now"}}
            answer = await client.chat.completions.create(model="fake", messages=USER, tools=TOOLS, tool_choice=named)
            kind, spec = attached[0]
            assert kind == "json_schema" and json.loads(spec)["properties"]["tool_calls"]["items"]["properties"][
                "name"
            ] == {"const": "now"}
            assert calls_of(answer.choices[0].message.tool_calls) == WANT_CALLS  # the script ignores the mask

    asyncio.run(body())


def test_min_tokens_with_a_constrained_tool_reply_names_the_tools(tmp_path):
    """A forced call (or strict tools under auto) constrains the reply, so min_tokens is refused as with
    response_format: the error said "cannot be combined with a constraint", of a request that sent none."""

    async def body():
        async with scripted(tmp_path, HERMES, HERMES_TEMPLATE) as (client, stub):
            strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
            for tools, choice in [(TOOLS, "required"), (TOOLS, {"type": "function", "function": {"name": "now"}})]:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(
                        model="fake", messages=USER, tools=tools, tool_choice=choice, extra_body={"min_tokens": 2}
                    )
                assert e.value.body["param"] == "min_tokens" and "tool_choice" in e.value.body["message"]
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model="fake", messages=USER, tools=strict, extra_body={"min_tokens": 2}
                )
            assert e.value.body["param"] == "min_tokens" and "strict" in e.value.body["message"]
            forced = rpb.ChatRequest(
                messages=USER,
                tools=[rpb.Tool(name="now")],
                tool_choice=rpb.ToolChoice(mode=rpb.TOOL_CHOICE_MODE_REQUIRED),
                parameters=rpb.SamplingParameters(min_new_tokens=2),
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Chat(forced)
            assert e.value.details().startswith("parameters.min_new_tokens: ") and "tool_choice" in e.value.details()
            # with tool_choice "none" nothing constrains the reply: min_tokens applies
            answer = await client.chat.completions.create(
                model="fake", messages=USER, tools=TOOLS, tool_choice="none", extra_body={"min_tokens": 2}
            )
            assert answer.choices[0].message.content

    asyncio.run(body())


def test_strict_tools_under_auto_with_response_format_name_the_strict_flag(tmp_path):
    """Strict tools under auto (tool_choice left out, as LangChain's bind_tools(strict=True) sends them) with a
    response_format: the 400 named tool_choice, a field the client never sent; it names the strict flag."""

    async def body():
        async with scripted(tmp_path, HERMES, HERMES_TEMPLATE) as (client, stub):
            strict = [TOOLS[1], {"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model="fake", messages=USER, tools=strict, response_format={"type": "json_object"}
                )
            assert e.value.body["param"] == "tools[1].function.strict", e.value.body
            request = rpb.ChatRequest(
                messages=USER,
                tools=[rpb.Tool(name="now", strict=True)],
                parameters=rpb.SamplingParameters(constraint=rpb.Constraint(regex="x")),
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Chat(request)
            assert e.value.details().startswith("tools[0].strict: "), e.value.details()

    asyncio.run(body())


def test_a_call_whose_arguments_escape_a_lone_surrogate_is_content_on_both_fronts(tmp_path):
    """`"\\ud800"` is valid JSON text for no character: the call's arguments, written back as UTF-8, failed to
    encode, so a stream ended in a 500 error event and gRPC in INTERNAL. Such a call is invalid: content."""
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800x"}}\n</tool_call>'

    async def body():
        async with scripted(tmp_path, reply, HERMES_TEMPLATE) as (client, stub):
            whole = (await client.chat.completions.create(model="fake", messages=USER, tools=TOOLS)).choices[0]
            assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (reply, None, "stop")
            assert await streamed(client, tools=TOOLS) == (reply, [], ["stop"])
            request = rpb.ChatRequest(
                messages=[rpb.ChatMessage(role="user", content="x")], tools=[rpb.Tool(name="get_weather")]
            )
            answer = await stub.Chat(request)
            assert answer.text == reply and not answer.tool_calls

    asyncio.run(body())


def test_a_stop_string_inside_a_forced_call_leaves_the_cut_call_as_content(tmp_path):
    """Stop sequences apply to a forced call's reply as to any constrained one: a stop string its JSON holds cuts
    it, and the cut call is content with finish_reason "stop", whole and streamed alike (never a half call)."""

    async def body():
        call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'  # as the grammar has it
        async with scripted(tmp_path, call, HERMES_TEMPLATE) as (client, _):
            kwargs = dict(tools=TOOLS, tool_choice="required", stop=["Paris"])
            whole = (await client.chat.completions.create(model="fake", messages=USER, **kwargs)).choices[0]
            cut = call[: call.index("Paris")]
            assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (cut, None, "stop")
            assert await streamed(client, **kwargs) == (cut, [], ["stop"])

    asyncio.run(body())


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE], ids=["generic", "hermes"])
def test_a_forced_call_s_schema_error_names_the_tool(tmp_path, template):
    """The call grammar is the router's, built from every tool: an error compiling it named `tools` alone, and
    in the hermes format with a line and column of the router's grammar (`at 3(7): failed to compile JSON
    schema: ...`), leaving a client with many tools to guess which schema. It names the tool's parameters."""
    bad = {"type": "object", "properties": {"y": {"not": {"type": "string"}}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "b", "parameters": bad}}]

    async def body():
        async with scripted(tmp_path, GENERIC, template) as (client, stub):
            for choice in ("required", {"type": "function", "function": {"name": "b"}}):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="fake", messages=USER, tools=tools, tool_choice=choice)
                param, message = e.value.body["param"], e.value.body["message"]
                assert param == "tools[1].function.parameters", e.value.body
                assert message == 'tools[1].function.parameters: Unimplemented keys: ["not"]', message
            request = rpb.ChatRequest(
                messages=USER,
                tools=[rpb.Tool(name="a"), rpb.Tool(name="b", parameters_json=json.dumps(bad))],
                tool_choice=rpb.ToolChoice(mode=rpb.TOOL_CHOICE_MODE_REQUIRED),
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Chat(request)
            assert e.value.details() == 'tools[1].parameters_json: Unimplemented keys: ["not"]', e.value.details()

    asyncio.run(body())


def test_langchain_bind_tools(tmp_path):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    @tool
    def now() -> str:
        """The time."""
        return "noon"

    async def body():
        async with scripted(tmp_path, GENERIC) as (client, _):
            llm = ChatOpenAI(base_url=str(client.base_url), api_key="x", model="fake", max_retries=0)
            message = await llm.bind_tools([get_weather, now]).ainvoke("Weather in Paris?")
            await llm.root_async_client.close()  # else its close runs, on garbage collection, on a later test's loop
            assert [(c["name"], c["args"]) for c in message.tool_calls] == WANT_CALLS
            assert all(c["id"].startswith("call_") for c in message.tool_calls)

    asyncio.run(body())


@pytest.mark.slow
def test_tool_round_trip_on_the_cpu_worker(worker, tiny_model):
    """assistant tool_calls -> tool result -> the final answer, through both services on the CPU backend and the
    tiny model's own (plain) template: the prompt is the conversation as transformers renders it."""
    from transformers import PreTrainedTokenizerFast

    async def body():
        async with running_router(worker.address, model=str(tiny_model), http_port=free_port()) as (router, stub):
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0)
            call = {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
            messages = USER + [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            ]
            answer = await client.chat.completions.create(
                model="model", messages=messages, tools=TOOLS, max_tokens=6, temperature=0
            )
            await client.close()
            hf = PreTrainedTokenizerFast.from_pretrained(tiny_model)
            for m in messages:
                for c in m.get("tool_calls") or ():
                    c["function"]["arguments"] = json.loads(c["function"]["arguments"])
            prompt = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
            assert "18 C, sunny" in prompt and '"arguments": {"city": "Paris"}' in prompt
            assert answer.usage.prompt_tokens == len(hf(prompt, add_special_tokens=False).input_ids)
            assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
            assert answer.usage.completion_tokens >= 1

    asyncio.run(body())
