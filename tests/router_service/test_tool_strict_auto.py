"""tool_choice "auto" with a strict tool end to end on the default model, through one router and CPU worker, with
the official `openai` client (whose pydantic_function_tool sends strict: true): under a hermes template every
reply is text or calls whose arguments validate; under the default model's own (generic) template it is a 400
naming the strict flag."""

import asyncio
import json

import jsonschema
import pydantic
import pytest

from tests.helpers import BackgroundWorker, free_port, running_router

openai = pytest.importorskip("openai", reason="the HTTP tests drive the router with the test extra's openai client")

pytestmark = pytest.mark.slow
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call a tool as <tool_call>\n{...}\n</tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


@pytest.fixture(scope="module")
def default_worker(default_model):
    w = BackgroundWorker(default_model, max_batch_size=16, max_batch_tokens=1024).start()
    yield w
    w.stop()


def test_auto_with_a_strict_tool_gives_text_or_valid_calls(default_worker, default_model, tmp_path):
    tool = openai.pydantic_function_tool(GetWeather)
    assert tool["function"]["strict"] is True
    schema = tool["function"]["parameters"]
    hermes = tmp_path / "hermes.jinja"
    hermes.write_text(HERMES_TEMPLATE)

    async def body():
        async with running_router(
            default_worker.address, model=str(default_model), http_port=free_port(), chat_template=str(hermes)
        ) as (router, _):
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0)
            prompts = ["What is the weather in Paris?", "And the Lord said", "<tool_call>", "Tell me a story."]
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=router.frontend.model_name,
                        messages=[{"role": "user", "content": p}],
                        tools=[tool],
                        max_tokens=40,
                        temperature=1.0,
                        seed=seed,
                    )
                    for p in prompts
                    for seed in range(3)
                )
            )
            for reply in replies:
                choice = reply.choices[0]
                for call in choice.message.tool_calls or []:
                    assert call.function.name == "GetWeather"
                    jsonschema.validate(json.loads(call.function.arguments), schema)
                assert "<tool_call>" not in (choice.message.content or "")  # a call is a call, never text
                assert choice.finish_reason in ("stop", "length", "tool_calls")
            await client.close()

    asyncio.run(body())


def test_auto_with_a_strict_tool_is_refused_under_the_generic_template(default_worker, default_model):
    async def body():
        async with running_router(default_worker.address, model=str(default_model), http_port=free_port()) as (
            router,
            _,
        ):
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model=router.frontend.model_name,
                    messages=[{"role": "user", "content": "Weather?"}],
                    tools=[
                        {"type": "function", "function": {"name": "now"}},
                        openai.pydantic_function_tool(GetWeather),
                    ],
                )
            assert e.value.param == "tools[1].function.strict" and "hermes or mistral" in e.value.message
            assert "\n" not in e.value.message
            await client.close()

    asyncio.run(body())
