"""Constrained decoding through the gRPC front on the default model and the CPU worker: every kind of constraint
yields output in its language, EOS only where it is complete, max_new_tokens still truncates ("length"), a
constraint the engine cannot compile is INVALID_ARGUMENT naming it, and an unconstrained neighbour's greedy
output is unchanged by constrained requests beside it."""

import asyncio
import json
import math
import re

import grpc
import jsonschema
import pytest

from common.pb import router_pb2 as rpb
from tests.helpers import BackgroundWorker, running_router

pytestmark = pytest.mark.slow

PROMPT = "And God said,"


@pytest.fixture(scope="module")
def default_worker(default_model):
    w = BackgroundWorker(default_model, max_batch_size=64).start()
    yield w
    w.stop()


def generate(constraint=None, n=48, prompt=PROMPT, **kw):
    params = rpb.SamplingParameters(max_new_tokens=n, **kw)
    if constraint is not None:
        params.constraint.CopyFrom(constraint)
    return rpb.GenerateRequest(text=prompt, parameters=params)


async def with_router(worker, model, body):
    async with running_router(worker.address, model=str(model)) as (router, stub):
        return await body(router, stub)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_every_constraint_kind_through_the_grpc_front(default_worker, default_model):
    async def body(router, stub):
        out = await stub.Generate(generate(rpb.Constraint(json_schema=json.dumps(SCHEMA)), n=64))
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.stop_reason == rpb.STOP_REASON_EOS
        out = await stub.Generate(generate(rpb.Constraint(regex=r"(yes|no), [0-9]{3}"), temperature=1.0, seed=3))
        assert re.fullmatch(r"(yes|no), [0-9]{3}", out.text), out.text
        out = await stub.Generate(generate(rpb.Constraint(choice=rpb.ChoiceList(choices=["Lord", "Moses", "x y"]))))
        assert out.text in ("Lord", "Moses", "x y")
        out = await stub.Generate(generate(rpb.Constraint(grammar='start: "A" num\nnum: /[1-9][0-9]?/'), n=8))
        assert re.fullmatch(r"A[1-9][0-9]?", out.text), out.text
        out = await stub.Generate(generate(rpb.Constraint(grammar='root ::= "B" [0-9]+ "."'), n=6))  # GBNF
        assert re.fullmatch(r"B[0-9]*\.?", out.text), out.text
        cache = router.batching_loop._constraints
        assert cache is not None and cache.misses == 5
        await stub.Generate(generate(rpb.Constraint(json_schema=json.dumps(SCHEMA)), n=64))
        assert cache.hits == 1 and cache.misses == 5  # the same schema compiles once

    asyncio.run(with_router(default_worker, default_model, body))


def test_max_new_tokens_truncates_a_constrained_output_as_length(default_worker, default_model):
    async def body(router, stub):
        out = await stub.Generate(generate(rpb.Constraint(regex="[a-z]{30}"), n=5))
        assert out.stop_reason == rpb.STOP_REASON_LENGTH and len(out.token_ids) == 5
        assert re.fullmatch("[a-z]+", out.text) and len(out.text) < 30

    asyncio.run(with_router(default_worker, default_model, body))


def test_logprobs_of_a_constrained_output_are_of_the_constrained_distribution(default_worker, default_model):
    async def body(router, stub):
        choice = rpb.Constraint(choice=rpb.ChoiceList(choices=["Lord", "Moses"]))
        out = await stub.Generate(generate(choice, logprobs=True, top_logprobs=5))
        first = out.top_logprobs[0]
        assert 1 <= len(first.token_ids) < 5  # only the few tokens that start a choice, none at -inf
        assert all(text and ("Lord".startswith(text) or "Moses".startswith(text)) for text in first.texts)
        # every allowed token is listed, so their probabilities (renormalised over the grammar) sum to 1
        assert out.logprobs[0] <= 0 and sum(math.exp(lp) for lp in first.logprobs) == pytest.approx(1, abs=1e-3)

    asyncio.run(with_router(default_worker, default_model, body))


@pytest.mark.parametrize(
    "constraint,field",
    [
        (rpb.Constraint(regex="a(b"), "parameters.constraint.regex"),
        (rpb.Constraint(json_schema='{"type": "foo"}'), "parameters.constraint.json_schema"),
        (rpb.Constraint(json_schema="{not json"), "parameters.constraint.json_schema"),
        (rpb.Constraint(grammar="start: undefined_rule"), "parameters.constraint.grammar"),
        (rpb.Constraint(choice=rpb.ChoiceList()), "parameters.constraint.choice"),
    ],
)
def test_a_constraint_that_cannot_compile_is_invalid_argument_in_one_line(
    default_worker, default_model, constraint, field
):
    async def body(router, stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(generate(constraint))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(field) and "\n" not in e.value.details()
        assert router.batching_loop.num_active == 0

    asyncio.run(with_router(default_worker, default_model, body))


def test_min_new_tokens_with_a_constraint_is_refused(default_worker, default_model):
    async def body(router, stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(generate(rpb.Constraint(regex="a+"), min_new_tokens=2))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_new_tokens" in e.value.details()

    asyncio.run(with_router(default_worker, default_model, body))


def test_constrained_requests_leave_an_unconstrained_neighbour_unchanged(default_worker, default_model):
    async def body(router, stub):
        alone = await stub.Generate(generate(n=24, ignore_eos=True))
        schema = rpb.Constraint(json_schema=json.dumps(SCHEMA))
        together = await asyncio.gather(
            stub.Generate(generate(n=24, ignore_eos=True)),
            *(stub.Generate(generate(schema, n=40, temperature=1.0, seed=s)) for s in range(6)),
        )
        assert list(together[0].token_ids) == list(alone.token_ids)
        for out in together[1:]:
            if out.stop_reason != rpb.STOP_REASON_LENGTH:
                jsonschema.validate(json.loads(out.text), SCHEMA)

    asyncio.run(with_router(default_worker, default_model, body))


WEATHER_TOOLS = [
    rpb.Tool(
        name="get_weather",
        parameters_json=json.dumps(
            {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
                "additionalProperties": False,
            }
        ),
    ),
    rpb.Tool(name="now"),
]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_call_always_parses_on_the_default_model(default_worker, default_model, choice):
    """tool_choice required / named is enforced by the constraint engine: the base model, which never chose to
    call a tool, returns calls of the request's tools with arguments that validate, greedy and sampled."""

    async def body(router, stub):
        if choice == "required":
            tool_choice = rpb.ToolChoice(mode=rpb.TOOL_CHOICE_MODE_REQUIRED)
        else:
            tool_choice = rpb.ToolChoice(function_name="get_weather")
        for seed in (None, 1, 2):
            sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
            params = rpb.SamplingParameters(max_new_tokens=96, **sampling)
            request = rpb.ChatRequest(
                messages=[rpb.ChatMessage(role="user", content="Weather in Paris?")],
                parameters=params,
                tools=WEATHER_TOOLS,
                tool_choice=tool_choice,
                parallel_tool_calls=False,  # a base model repeats a call until max_new_tokens otherwise
            )
            out = await stub.Chat(request)
            assert out.stop_reason == rpb.STOP_REASON_EOS, out.text
            assert len(out.tool_calls) == 1, out.text
            for call in out.tool_calls:
                assert call.name in ("get_weather", "now") if choice == "required" else call.name == "get_weather"
                arguments = json.loads(call.arguments)
                if call.name == "get_weather":
                    jsonschema.validate(arguments, json.loads(WEATHER_TOOLS[0].parameters_json))

    asyncio.run(with_router(default_worker, default_model, body))
