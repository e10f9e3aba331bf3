"""Property tests of constrained decoding on the default model through one router and CPU worker: 500 random JSON
schemas (nested objects, arrays, enums, bounded numbers, required fields) and 200 random regexes, sent
concurrently with short max_new_tokens, a third of them greedy (late masks at pipeline depth 2), the rest sampled; every complete output parses and validates, every truncated one is a
prefix the constraint still allows. Also the openai client's `parse` helper with a pydantic model."""

import asyncio
import json
import random
import re

import jsonschema
import llguidance
import pydantic
import pytest

from common.pb import router_pb2 as rpb
from tests.helpers import BackgroundWorker, free_port, running_router

openai = pytest.importorskip("openai", reason="the HTTP tests drive the router with the test extra's openai client")

pytestmark = pytest.mark.slow
# 128 in flight in batches of 128: half the engine steps of 64 for the same 700 requests (each case is cheaper)
NUM_SCHEMAS, NUM_REGEXES, CONCURRENCY = 500, 200, 128


@pytest.fixture(scope="module")
def default_worker(default_model):
    w = BackgroundWorker(default_model, max_batch_size=128, max_batch_tokens=2048, kv_cache_tokens=8192).start()
    yield w
    w.stop()


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kind = rng.choice(
        ["object", "array", "enum", "integer", "number", "string", "boolean"]
        if depth < 2
        else ["enum", "integer", "boolean", "string"]
    )
    if kind == "object":
        names = rng.sample(["a", "b", "id", "name", "x1", "ok"], rng.randint(1, 3))
        props = {n: random_schema(rng, depth + 1) for n in names}
        return {
            "type": "object",
            "properties": props,
            "required": rng.sample(names, rng.randint(0, len(names))),
            "additionalProperties": False,
        }
    if kind == "array":
        lo = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": lo,
            "maxItems": lo + rng.randint(0, 2),
        }
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 7, None, True, "x y"], rng.randint(1, 4))}
    if kind in ("integer", "number"):
        lo = rng.randint(-50, 50)
        return {"type": kind, "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    return {"type": "boolean"}


def random_regex(rng: random.Random) -> str:
    atoms = ["[a-z]", "[0-9]", "(yes|no)", "[A-Z][a-z]", "-", r"\.", "(ab|cd|e)"]
    parts = [rng.choice(atoms) + rng.choice(["", "?", "{1,3}", "{2}"]) for _ in range(rng.randint(1, 4))]
    return "".join(parts)


def matches_prefix(matcher_grammar: str, tokenizer, token_ids) -> bool:
    """Whether llguidance accepts these tokens as a prefix (a truncated output is one)."""
    matcher = llguidance.LLMatcher(tokenizer, matcher_grammar, log_level=0)
    return matcher.consume_tokens(list(token_ids)) and not matcher.is_error()


def test_random_schemas_and_regexes_always_yield_valid_output(default_worker, default_model):
    rng = random.Random(1234)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    regexes = [random_regex(rng) for _ in range(NUM_REGEXES)]

    async def body():
        async with running_router(default_worker.address, model=str(default_model), max_concurrent_requests=256) as (
            router,
            stub,
        ):
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(constraint, seed):
                # a third greedy: at pipeline depth 2 (the default) their masks come late, one message after their step
                temperature = 0.0 if seed % 3 == 0 else 1.0
                params = rpb.SamplingParameters(max_new_tokens=24, temperature=temperature, seed=seed)
                params.constraint.CopyFrom(constraint)
                async with gate:
                    return await stub.Generate(rpb.GenerateRequest(text="The", parameters=params))

            jobs = [one(rpb.Constraint(json_schema=json.dumps(s)), i) for i, s in enumerate(schemas)]
            jobs += [one(rpb.Constraint(regex=r), i) for i, r in enumerate(regexes)]
            return await asyncio.gather(*jobs), router.batching_loop._constraints.tokenizer

    outs, tokenizer = asyncio.run(body())
    complete = 0
    for i, out in enumerate(outs):
        if i < NUM_SCHEMAS:
            schema, grammar = (
                schemas[i],
                llguidance.LLMatcher.grammar_from_json_schema(schemas[i], defaults={"whitespace_flexible": False}),
            )
            if out.stop_reason != rpb.STOP_REASON_LENGTH:
                jsonschema.validate(json.loads(out.text), schema)
                complete += 1
            else:
                assert matches_prefix(grammar, tokenizer, out.token_ids), (schema, out.text)
        else:
            regex = regexes[i - NUM_SCHEMAS]
            if out.stop_reason != rpb.STOP_REASON_LENGTH:
                assert re.fullmatch(regex, out.text), (regex, out.text)
                complete += 1
            else:
                assert matches_prefix(llguidance.LLMatcher.grammar_from_regex(regex), tokenizer, out.token_ids)
    assert complete > 0.8 * len(outs)  # short limits still complete most outputs: the check is not vacuous


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)


def test_the_openai_client_parse_helper_gets_a_valid_pydantic_object(default_worker, default_model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")

    async def body():
        async with running_router(
            default_worker.address, model=str(default_model), http_port=free_port(), chat_template=str(template)
        ) as (
            router,
            _,
        ):
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0)
            completion = await client.beta.chat.completions.parse(
                model=router.frontend.model_name,
                messages=[{"role": "user", "content": "A person as JSON"}],
                response_format=Person,
                max_tokens=48,
                temperature=0,
            )
            person = completion.choices[0].message.parsed
            assert isinstance(person, Person) and 0 <= person.age <= 120
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model=router.frontend.model_name,
                    messages=[{"role": "user", "content": "x"}],
                    extra_body={"guided_regex": "a(b"},
                )
            assert "regex" in e.value.message and "\\n" not in e.value.message
            both = {"guided_regex": "a", "guided_choice": ["b"]}
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(model=router.frontend.model_name, prompt="x", extra_body=both)
            assert e.value.param == "guided_choice"
            await client.close()  # left to the garbage collector, its close runs on a later test's event loop

    asyncio.run(body())
