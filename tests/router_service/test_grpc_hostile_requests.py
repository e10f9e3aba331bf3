"""Hostile requests on the public gRPC port, as a client library can send them: chats whose repeated fields or
template inputs fill a 16 MiB message, at capacity or not. Each is refused with the status naming the field,
before the router walks or parses it, and afterwards nothing is held: the gauges are back to 0 and a plain request
is served."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import struct_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from common.metrics import new_registry
from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import PLAIN_CHAT_TEMPLATE
from router_service import servicer
from router_service.observability import router_metrics
from tests.helpers import byte_ids, drained, running_router, worth_reporting
from tests.router_service.fake_worker import FakeWorker, harness, ids_request, wait_for

GAUGES = ("colibri_queue_size", "colibri_num_requests_running", "colibri_num_requests_waiting")
HI = rpb.ChatMessage(role="user", content="hi")


async def status_of(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


async def still_serving(router, fake, stub, registry) -> None:
    """Nothing held after a hostile call: no request, KV block or admission in flight, gauges at 0, and a plain
    request is served."""
    loop = router.batching_loop
    await wait_for(lambda: loop.num_active == 0 and not fake.seqs and router.frontend._num_admitting == 0)
    assert loop.scheduler.num_used_blocks == 0
    assert tuple(registry.get_sample_value(name, {"model_name": "m"}) for name in GAUGES) == (0, 0, 0)
    assert (await stub.Generate(ids_request([5], max_new_tokens=2))).generated_tokens == 2


def chat_harness(tokenizer, registry, fake=None, **overrides):
    hooks, _ = router_metrics("m", port=-1, registry=registry)
    return harness(fake, tokenizer=tokenizer, hooks=hooks, chat_template=str(PLAIN_CHAT_TEMPLATE), **overrides)


def test_a_chat_s_repeated_fields_are_bounded_before_they_are_walked(tokenizer, monkeypatch):
    """200,000 empty messages (or tools, or tool calls) are a few hundred kB; checking each for unknown fields took
    ~1 us of Python apiece on the event loop (a 16 MiB message: ~8 s with every stream stalled). Each count is
    refused first; schemas and template variables past max_prompt_bytes are refused before they are parsed."""
    walked: list[int] = []
    check = servicer.check_known_fields
    monkeypatch.setattr(servicer, "check_known_fields", lambda m, path="": (walked.append(1), check(m, path))[1])
    n = 200_000
    schema = '{"type": "object", "properties": {' + ", ".join(f'"p{i}": {{}}' for i in range(5000)) + "}}"
    cases = [
        ("messages", "at most 1024 messages fit the context, got 200000", rpb.ChatRequest(messages=[HI] * n)),
        ("tools", "at most 128 tools, got 200000", rpb.ChatRequest(messages=[HI], tools=[rpb.Tool(name="f")] * n)),
        (
            "messages",
            "at most 1024 tool calls fit the context, got 200000",
            rpb.ChatRequest(messages=[rpb.ChatMessage(role="assistant", tool_calls=[rpb.ToolCall(name="f")] * n)]),
        ),
        (
            "messages",
            "their tool calls must be at most 32768 bytes (max_prompt_bytes), got 4000",
            rpb.ChatRequest(
                messages=[HI, rpb.ChatMessage(role="assistant", tool_calls=[rpb.ToolCall(arguments="1" * 40_000)])]
            ),
        ),
        (
            "tools",
            "the tools must be at most 32768 bytes (max_prompt_bytes), got 6",
            rpb.ChatRequest(messages=[HI], tools=[rpb.Tool(name="f", parameters_json=schema)]),
        ),
    ]
    kwargs = struct_pb2.Struct()
    kwargs.update({f"k{i}": i for i in range(5000)})
    cases.append(
        (
            "chat_template_kwargs",
            "the variables must be at most 32768 bytes (max_prompt_bytes), got 9",
            rpb.ChatRequest(messages=[HI], chat_template_kwargs=kwargs),
        )
    )

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry) as (router, fake, stub, _):
            for field, message, request in cases:
                stream = stub.ChatStream(rpb.ChatStreamRequest.FromString(request.SerializeToString()))
                for err in (await status_of(stub.Chat(request)), await status_of(stream.read())):
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
                    assert err.details().startswith(f"{field}: {message}"), err.details()
                assert walked == [], f"{field}: walked before its bounds were checked"
                await still_serving(router, fake, stub, registry)

    asyncio.run(body())


def test_at_capacity_a_chat_is_refused_before_it_is_read(tokenizer, monkeypatch):
    walked: list[int] = []
    monkeypatch.setattr(servicer, "check_known_fields", lambda *args: walked.append(1))

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry, FakeWorker(step_delay=0.01), max_concurrent_requests=1) as (
            router,
            fake,
            stub,
            _,
        ):
            holder = stub.GenerateStream(ids_request([1], max_new_tokens=200, ignore_eos=True))
            await holder.read()
            err = await status_of(stub.Chat(rpb.ChatRequest(messages=[HI] * 100_000)))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent_requests" in err.details()
            assert walked == []
            holder.cancel()
            await still_serving(router, fake, stub, registry)

    asyncio.run(body())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), [1, {"deep": float("-inf")}]])
def test_template_variables_that_json_cannot_write_are_invalid_argument(tokenizer, caplog, value):
    """A Struct's number may be NaN or infinite; JSON, which the template variables are, has neither. It was
    INTERNAL with a traceback logged at ERROR."""
    kwargs = struct_pb2.Struct()
    kwargs.update({"x": value})

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry) as (router, fake, stub, _):
            request = rpb.ChatRequest(messages=[HI], chat_template_kwargs=kwargs)
            err = await status_of(stub.Chat(request))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert err.details() == "chat_template_kwargs: numbers must be finite (JSON has no NaN or Infinity)"
            await still_serving(router, fake, stub, registry)

    asyncio.run(body())
    assert not [r for r in caplog.records if worth_reporting(r)]


def test_a_forced_tool_call_s_grammar_errors_name_the_tools(tokenizer):
    """The grammar of a forced call is the router's, built from the tools' schemas: a schema it cannot compile is
    the tools' error, as on the HTTP front (the schema's own field, tools[i].parameters_json). It named
    parameters.constraint.json_schema, which the client never set."""
    tool = rpb.Tool(name="f", parameters_json='{"$ref": "#"}', strict=True)
    chat = rpb.ChatRequest(messages=[HI], tools=[tool], tool_choice=rpb.ToolChoice(mode=rpb.TOOL_CHOICE_MODE_REQUIRED))

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry) as (router, fake, stub, _):
            stream = stub.ChatStream(rpb.ChatStreamRequest.FromString(chat.SerializeToString()))
            for err in (await status_of(stub.Chat(chat)), await status_of(stream.read())):
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
                assert err.details().startswith("tools[0].parameters_json: "), err.details()
            # a constraint of the client's own keeps its name
            own = rpb.ChatRequest(messages=[HI], tools=[rpb.Tool(name="f")], parameters=rpb.SamplingParameters())
            own.parameters.constraint.json_schema = '{"$ref": "#"}'
            err = await status_of(stub.Chat(own))
            assert err.details().startswith("parameters.constraint.json_schema: "), err.details()
            # forced, with a constraint of its own: the error names the gRPC field, not the HTTP front's
            own.tool_choice.mode = rpb.TOOL_CHOICE_MODE_REQUIRED
            own.parameters.constraint.json_schema = '{"type": "object"}'
            err = await status_of(stub.Chat(own))
            assert err.details().startswith("tool_choice: ") and "parameters.constraint" in err.details(), err.details()
            await still_serving(router, fake, stub, registry)

    asyncio.run(body())


def test_every_answer_carries_x_request_id_in_its_metadata(tokenizer):
    """A client library reads the id from the metadata whatever the call: a unary answer had none (a stream's
    and an error's did)."""

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry) as (router, fake, stub, _):
            for call in (
                stub.Generate(ids_request([5], request_id="mine-1", max_new_tokens=2)),
                stub.Generate(ids_request([5], max_new_tokens=2)),
                stub.Chat(rpb.ChatRequest(messages=[HI], parameters=rpb.SamplingParameters(max_new_tokens=2))),
            ):
                answer = await call
                assert dict(await call.initial_metadata())["x-request-id"] == answer.request_id
            stream = stub.GenerateStream(rpb.GenerateStreamRequest(token_ids=rpb.TokenIds(ids=[5]), request_id="s-1"))
            assert dict(await stream.initial_metadata())["x-request-id"] == "s-1"
            await stream.read()
            stream.cancel()
            await still_serving(router, fake, stub, registry)

    asyncio.run(body())


def test_json_text_is_read_as_the_standard_has_it(tokenizer):
    """Python's json reads NaN and Infinity: a tool with them was offered to the model as no JSON, and a schema
    with them failed at a column of the router's own rewrite. An integer past Python's digit limit was refused
    telling the client to call sys.set_int_max_str_digits."""
    nan_tool = rpb.Tool(name="f", parameters_json='{"type": "object", "properties": {"a": {"maximum": NaN}}}')
    huge = '{"type": "object", "properties": {"a": {"maximum": ' + "9" * 5000 + "}}}"
    call = rpb.ToolCall(id="call_1", name="f", arguments='{"a": -Infinity}')
    params = rpb.SamplingParameters(max_new_tokens=2)

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry) as (router, fake, stub, _):
            cases = [
                (
                    stub.Chat(rpb.ChatRequest(messages=[HI], tools=[nan_tool], parameters=params)),
                    "tools[0].parameters_json: not JSON: NaN is not a JSON number",
                ),
                (
                    stub.Chat(rpb.ChatRequest(messages=[HI], tools=[rpb.Tool(name="f", parameters_json=huge)])),
                    "tools[0].parameters_json: not JSON: an integer of 5000 digits (at most 4300)",
                ),
                (
                    stub.Chat(rpb.ChatRequest(messages=[HI, rpb.ChatMessage(role="assistant", tool_calls=[call])])),
                    "messages[1].tool_calls[0].function.arguments: must be the JSON text of an object: "
                    "-Infinity is not a JSON number",
                ),
                (
                    stub.Generate(ids_request([5], constraint=rpb.Constraint(json_schema='{"maximum": Infinity}'))),
                    "parameters.constraint.json_schema: is not valid JSON: Infinity is not a JSON number",
                ),
            ]
            for call_, message in cases:
                err = await status_of(call_)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
                assert err.details() == message
            await still_serving(router, fake, stub, registry)

    asyncio.run(body())


@pytest.mark.parametrize("role", ["x\ny", "x\r\ny", "x\u2028y", "x\x85y", "x\x00y"])
def test_an_error_quoting_a_line_break_stays_one_line(tokenizer, role):
    """The chat template's raise_exception quotes the role as sent: a role with a line break made a status message
    of two lines. What the client sent is quoted with its control characters escaped."""
    escaped = role.encode("unicode_escape").decode()

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry) as (router, fake, stub, _):
            err = await status_of(stub.Chat(rpb.ChatRequest(messages=[rpb.ChatMessage(role=role, content="hi")])))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert (
                err.details()
                == f"messages[0]: chat template: role must be system, user, assistant or tool, got {escaped}"
            )
            assert len(err.details().splitlines()) == 1
            await still_serving(router, fake, stub, registry)

    asyncio.run(body())


def test_a_deadline_that_passes_before_the_queue_is_the_router_s_status(tokenizer, monkeypatch):
    """The router ends a request at the client's deadline (less its headroom) with its own status, ErrorInfo and
    x-request-id; before the request reached the batching loop (its chat rendering behind others, its text
    tokenizing) gRPC cut the call first: a bare DEADLINE_EXCEEDED without either. The headroom is widened here
    (50 ms in service), so a loaded machine's event loop cannot lose the race to the client's own deadline."""
    monkeypatch.setattr(servicer, "DEADLINE_HEADROOM_S", 1.0)  # min(1.0, a quarter of 2 s): 0.5 s ahead

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry) as (router, fake, stub, _):
            renderer, tokenizer_ = router.frontend.chat_renderer, router.batching_loop.tokenizer
            render, encode = renderer.render, tokenizer_.encode_async

            async def slow_render(*args, **kwargs):
                await asyncio.sleep(5)
                return await render(*args, **kwargs)

            async def slow_encode(*args, **kwargs):
                await asyncio.sleep(5)
                return await encode(*args, **kwargs)

            renderer.render, tokenizer_.encode_async = slow_render, slow_encode
            chat = rpb.ChatRequest(messages=[HI], request_id="c-1")
            calls = [
                stub.Chat(chat, timeout=2),
                stub.ChatStream(rpb.ChatStreamRequest.FromString(chat.SerializeToString()), timeout=2).read(),
                stub.Generate(rpb.GenerateRequest(text="hello", request_id="c-1"), timeout=2),
            ]
            for call in calls:
                err = await status_of(call)
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
                assert err.details().startswith("the request's deadline passed before it reached the queue")
                info = error_details_pb2.ErrorInfo()
                assert rpc_status.from_call(err).details[0].Unpack(info) and info.reason == "QUEUE_TIMEOUT"
                assert dict(err.trailing_metadata())["x-request-id"] == "c-1"
            outcome = {"model_name": "m", "outcome": "deadline_exceeded"}
            assert registry.get_sample_value("colibri_requests_total", outcome) == 3
            renderer.render, tokenizer_.encode_async = render, encode
            await still_serving(router, fake, stub, registry)

    asyncio.run(body())


def test_an_answer_over_max_message_bytes_is_refused_in_the_router_s_terms(worker, tiny_model, caplog):
    """Prompt log-probabilities cost ~300 bytes a prompt token: a long prompt's answer (or a stream's first
    message) can pass max_message_bytes, which bounds answers too. gRPC refused to send it with a bare
    RESOURCE_EXHAUSTED and logged a traceback at ERROR; the router refuses it itself, with ErrorInfo and the id."""
    params = rpb.SamplingParameters(max_new_tokens=2, logprobs=True, top_logprobs=20, prompt_logprobs=20)
    prompt = rpb.TokenIds(ids=list(range(10, 250)) * 2)

    async def body():
        async with running_router(worker.address, model=str(tiny_model), max_message_bytes=64 << 10) as (router, stub):
            stream = stub.GenerateStream(rpb.GenerateStreamRequest(token_ids=prompt, parameters=params, request_id="s"))
            for call in (
                stub.Generate(rpb.GenerateRequest(token_ids=prompt, parameters=params, request_id="u")),
                stream.read(),
            ):
                err = await status_of(call)
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert err.details().startswith("the answer would be "), err.details()
                assert "over max_message_bytes (65536)" in err.details()
                info = error_details_pb2.ErrorInfo()
                status = rpc_status.from_call(err)
                assert status.details[0].Unpack(info) and info.reason == "ANSWER_TOO_LARGE"
                assert len(status.details) == 1, "asking again gets the same: no RetryInfo"
                assert dict(err.trailing_metadata())["x-request-id"] in ("u", "s")
            await drained(router)
            small = rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=[5, 6]), parameters=params)
            assert len((await stub.Generate(small)).prompt_logprobs) == 2

    asyncio.run(body())
    assert not [r for r in caplog.records if worth_reporting(r)]


@pytest.mark.parametrize("rpc", ["Tokenize", "Detokenize"])
def test_a_tokenize_or_detokenize_answer_over_max_message_bytes_is_refused_in_the_router_s_terms(
    tokenizer, caplog, rpc
):
    """A text within max_message_bytes tokenizes, with pieces and offsets, to an answer several times its size;
    each lone byte 0x80 detokenizes to U+FFFD, 3 bytes of text for a 2-byte id."""
    text, ids = "abc " * 1000, [byte_ids("\u0080")[1]] * 1900  # 4 kB of text; 1,900 ids: a 3.8 kB request
    too_large, fits = {
        "Tokenize": (
            rpb.TokenizeRequest(text=text, return_pieces=True, return_offsets=True),
            rpb.TokenizeRequest(text=text),
        ),
        "Detokenize": (rpb.DetokenizeRequest(token_ids=ids), rpb.DetokenizeRequest(token_ids=ids[:1000])),
    }[rpc]

    async def body():
        registry = new_registry(process_metrics=False)
        async with chat_harness(tokenizer, registry, max_message_bytes=4096) as (router, fake, stub, _):
            err = await status_of(getattr(stub, rpc)(too_large))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert err.details().startswith("the answer would be ") and "(4096)" in err.details(), err.details()
            answer = await getattr(stub, rpc)(fits)
            assert len(answer.token_ids) > 1000 if rpc == "Tokenize" else answer.text == "\ufffd" * 1000
            await still_serving(router, fake, stub, registry)

    asyncio.run(body())
    assert not [r for r in caplog.records if worth_reporting(r)]
