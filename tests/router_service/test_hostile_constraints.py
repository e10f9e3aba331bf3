"""Hostile constraints: schemas nested past Python's recursion limit, $refs that loop or point at themselves,
and regexes whose lexer is costly to build are refused or bounded up front (INVALID_ARGUMENT naming the field, in
one line), never a failure mid-request, an internal error, or a stall of the router's event loop."""

import asyncio
import logging
import random
import threading
import time

import grpc
import pytest

from common.errors import InvalidRequestError
from common.pb import router_pb2 as rpb
from router_service.constraints import Constraint, ConstraintCompiler, GrammarError
from tests.helpers import byte_ids, running_router, worker_kv_blocks_used

# Empty and over-fuelled lexers: costly to build, each within the spec's byte limit.
HEAVY_REGEX = "(a{1000}){1000}"


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return ConstraintCompiler((tiny_model / "tokenizer.json").read_text(), 259, [2])


@pytest.mark.parametrize(
    "spec",
    [
        '{"not":' * 5000 + "{}" + "}" * 5000,  # valid JSON, nested past the recursion limit
        "[" * 30000,  # not even JSON, and just as deep
    ],
    ids=["deep-object", "deep-brackets"],
)
def test_a_schema_nested_past_the_recursion_limit_is_refused(compiler, spec):
    with pytest.raises(InvalidRequestError) as e:
        compiler.matcher(Constraint("json_schema", spec))
    assert e.value.field == "parameters.constraint.json_schema" and "\n" not in str(e.value)
    assert "nested" in str(e.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"anyOf": [{"$ref": "#"}]},
    ],
    ids=["self", "loop", "anyof-self"],
)
def test_a_ref_loop_that_matches_nothing_is_refused_at_submit(compiler, schema):
    """Such a schema compiles, but its first mask fails: refused as the request's error, not mid-generation."""
    with pytest.raises(InvalidRequestError) as e:
        compiler.matcher(Constraint.json_schema(schema))
    assert e.value.field == "parameters.constraint.json_schema" and "\n" not in str(e.value)


def test_a_recursive_schema_that_can_end_still_compiles(compiler):
    linked = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    matcher = compiler.matcher(Constraint.json_schema(linked))
    assert matcher.mask()


def test_a_costly_regex_is_compiled_off_the_event_loop(worker, tiny_model, monkeypatch):
    """A new grammar's matcher is built on a thread at submit (the copies each request gets are then quick), so
    other requests' tokens keep flowing. The build is made to take a second (llguidance builds this regex's first
    mask in ~0.1 s here, less than the event loop's scheduling noise on a loaded machine): on the loop it would
    stall it that long, and the thread that built it is checked as well."""
    build, built_on = ConstraintCompiler.matcher, []

    def slow_build(self, *args, **kwargs):
        built_on.append(threading.get_ident())
        time.sleep(1.0)
        return build(self, *args, **kwargs)

    monkeypatch.setattr(ConstraintCompiler, "matcher", slow_build)

    async def body():
        async with running_router(worker.address, model=str(tiny_model)) as (router, stub):
            gaps: list[float] = []
            done = asyncio.Event()

            async def ticker():
                last = time.perf_counter()
                while not done.is_set():
                    await asyncio.sleep(0.005)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            params = rpb.SamplingParameters(max_new_tokens=3, constraint=rpb.Constraint(regex=HEAVY_REGEX))
            try:  # built within the limits, or refused for passing them: never an internal error
                answer = await stub.Generate(rpb.GenerateRequest(text="x", parameters=params))
                assert answer.text == "aaa"
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
                assert e.details().startswith("parameters.constraint") and "\n" not in e.details()
            done.set()
            await tick
            assert built_on and threading.get_ident() not in built_on, "the matcher was built on the event loop"
            assert max(gaps) < 0.6, f"the event loop stalled {max(gaps):.2f} s"
            assert router.batching_loop.num_active == 0

    asyncio.run(body())


def test_a_self_referencing_schema_is_invalid_argument_and_frees_everything(worker, tiny_model):
    async def body():
        async with running_router(worker.address, model=str(tiny_model)) as (router, stub):
            for spec in ('{"$ref": "#"}', '{"not":' * 5000 + "{}" + "}" * 5000):
                params = rpb.SamplingParameters(max_new_tokens=4, constraint=rpb.Constraint(json_schema=spec))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(rpb.GenerateRequest(text="x", parameters=params))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert e.value.details().startswith("parameters.constraint.json_schema")
            assert router.batching_loop.num_active == 0
            assert await worker_kv_blocks_used(router.worker) == 0

    asyncio.run(body())


def test_a_token_outside_the_mask_is_told_apart_from_a_grammar_past_its_limits(compiler):
    """The first is the sampler's bug (an internal error), the second the client's grammar (INVALID_ARGUMENT)."""
    (a,), (b,) = byte_ids("a"), byte_ids("b")
    matcher = compiler.matcher(Constraint("regex", "a+"))
    matcher.mask()
    with pytest.raises(GrammarError) as e:
        matcher.consume(b)
    assert e.value.outside_mask
    endless = compiler.matcher(Constraint("grammar", 'start: "a" start'))  # no finite output: Earley items pile up
    endless.mask()
    with pytest.raises(GrammarError) as e:
        endless.consume(a)
    assert not e.value.outside_mask and "broke the grammar" in str(e.value)


def test_a_grammar_past_the_limits_mid_output_is_invalid_argument(worker, tiny_model, caplog):
    """The client's answer names what failed (the sampled token among it); the router's log lines, the request's
    own included, never carry that text: it quotes a completion token id."""

    async def body():
        async with running_router(worker.address, model=str(tiny_model)) as (router, stub):
            params = rpb.SamplingParameters(max_new_tokens=6, constraint=rpb.Constraint(grammar='start: "a" start'))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(rpb.GenerateRequest(text="x", parameters=params))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert e.value.details().startswith("parameters.constraint: failed after 0 tokens")
            assert "\n" not in e.value.details()
            assert router.batching_loop.num_active == 0
            return e.value.details()

    with caplog.at_level(logging.INFO, logger="colibri.router"):
        details = asyncio.run(body())
    quoted = details.removeprefix("parameters.constraint: failed after 0 tokens: ")
    assert quoted and not [r for r in caplog.records if quoted in r.getMessage() or quoted in str(r.__dict__)]
    [line] = [r for r in caplog.records if getattr(r, "outcome", None) == "invalid_argument"]
    assert line.error == "invalid parameters.constraint"


def test_the_boolean_schemas_are_any_value_and_nothing(compiler):
    """`true` is the schema any JSON value matches; `false` matches nothing: refused naming that, not llguidance's
    complaint about options it cannot apply to a boolean."""
    matcher = compiler.matcher(Constraint.json_schema(True))
    for token in byte_ids('[1,"a"]'):
        matcher.mask()
        matcher.consume(token)
    assert matcher.is_stopped or matcher.mask()
    with pytest.raises(InvalidRequestError, match="matches nothing") as e:
        compiler.matcher(Constraint.json_schema(False))
    assert e.value.field == "parameters.constraint.json_schema"


def takes(compiler, schema, text: str) -> bool:
    """Whether the schema's constraint accepts `text` whole."""
    matcher = compiler.matcher(Constraint.json_schema(schema))
    try:
        for token in byte_ids(text):
            matcher.mask()
            matcher.consume(token)
    except GrammarError:
        return False
    return matcher.is_stopped or bool(matcher.mask()[0] & 1 << 2)  # EOS (id 2) allowed: complete


@pytest.mark.parametrize(
    "date,valid",
    [("2024-02-29", True), ("2000-02-29", True), ("2023-02-28", True), ("2023-12-31", True)]
    + [("2023-02-29", False), ("1900-02-29", False), ("2100-02-29", False), ("2023-04-31", False)],
)
def test_a_date_format_knows_leap_years(compiler, date, valid):
    """llguidance's date patterns know each month's length but took February 29th of any year."""
    day = {"type": "string", "format": "date"}
    nested = {"type": "object", "properties": {"d": {"$ref": "#/$defs/d"}}, "required": ["d"], "$defs": {"d": day}}
    assert takes(compiler, day, f'"{date}"') == valid
    assert takes(compiler, {"type": "string", "format": "date-time"}, f'"{date}T12:00:00Z"') == valid
    assert takes(compiler, nested, f'{{"d":"{date}"}}') == valid
    assert takes(compiler, {"anyOf": [{"type": "integer"}, day]}, f'"{date}"') == valid


def test_an_objects_properties_come_in_the_schemas_order(compiler):
    """The schema was serialised with sorted keys, so every object came out in alphabetical order rather than the
    client's (a `reasoning` field meant to come before its `answer` came after it)."""
    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }
    assert takes(compiler, schema, '{"reasoning":"x","answer":1}')
    assert not takes(compiler, schema, '{"answer":1,"reasoning":"x"}')


@pytest.mark.parametrize("key", ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"])
@pytest.mark.parametrize("kind", ["integer", "number"])
def test_a_bound_the_compiler_would_round_is_refused(compiler, key, kind):
    """Bounds are held as doubles: `"minimum": 2^53 + 1, "maximum": 2^53 + 1` admitted only 2^53, which breaks
    both, and `"maximum": 10^30` refused 10^29. Such a bound, in any subschema, is refused naming it."""
    bound = random.choice([2**53 + 1, -(2**53) - 1, 10**30, -1e300, 2.0**60])
    for schema in (
        {"type": kind, key: bound},
        {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": kind, key: bound}}},
        {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": kind, key: bound}}]},
    ):
        with pytest.raises(InvalidRequestError, match=rf"^parameters\.constraint\.json_schema: {key} .* ±2\^53"):
            compiler.matcher(Constraint.json_schema(schema), False)


@pytest.mark.parametrize("key", ["const", "enum"])
def test_an_integer_the_compiler_would_round_is_refused_in_data(compiler, key):
    """`"const": 2^53 + 1` produced 2^53, and an integer const of 10^30 allowed nothing (every mask empty)."""
    big = random.choice([2**53 + 1, -(2**53) - 1, 10**30])
    for value in (big, [1, {"a": [big]}]):
        schema = {key: value if key == "const" else ["x", value]}
        with pytest.raises(InvalidRequestError, match=rf"^parameters\.constraint\.json_schema: {key} holds {big},"):
            compiler.matcher(Constraint.json_schema({"type": "object", "properties": {"v": schema}}), False)


def test_bounds_within_2_53_stay_exact(compiler):
    edge = 2**53
    schema = {"type": "integer", "minimum": -edge, "maximum": edge}
    assert takes(compiler, schema, str(edge)) and takes(compiler, schema, str(-edge))
    assert not takes(compiler, schema, str(edge + 1)) and not takes(compiler, schema, str(-edge - 1))
    within = random.randrange(1, edge)
    assert takes(compiler, {"type": "integer", "minimum": within, "maximum": within}, str(within))
    assert takes(compiler, {"const": edge}, str(edge)) and takes(compiler, {"enum": [-edge, 1e300]}, str(-edge))
