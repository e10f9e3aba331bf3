"""Chat templates render as transformers' apply_chat_template does, and the Chat / ChatStream RPCs answer as
Generate does on the rendered prompt (tokenized without adding special tokens)."""

import asyncio
import json
import re
import shutil

import grpc
import pytest
from google.protobuf import struct_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from common.errors import ConfigError, InvalidRequestError
from common.pb import router_pb2 as rpb
from expert_service.tools.tiny_model import BOS_ID, SPECIAL_TOKENS, byte_tokenizer
from router_service.chat import ChatTemplate
from router_service.tokenizer import Tokenizer
from tests.helpers import running_router

BOS, EOS = SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]

# Representative templates of the four families, written the way their tokenizer_config.json files write them.
MIXTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
QWEN2_MOE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN3_MOE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and loop.last %}
            {{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
OLMOE = """{{ bos_token }}{% for message in messages %}
{% if message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + '\\n' }}
{% elif message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + '\\n' }}
{% elif message['role'] == 'assistant' %}
{% if not loop.last %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}
{% else %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
{% endif %}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>\\n' }}
{% endif %}
{% endfor %}"""
# The globals and filters transformers gives templates: tojson (no HTML escaping), namespace, dict, loop controls.
HELPERS = """{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}
{% set ns.n = ns.n + 1 %}{{ m | tojson }}|{{ dict(role=m.role) | tojson }}|{{ m.content | length }}
{% endfor %}{{ ns.n }}{{ bos_token }}{{ eos_token }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": 'Write a haiku <b>&</b> "quotes" é ü 漢字'},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>sum</think>\n4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


def hf_tokenizer(template, post_bos=False):
    from transformers import PreTrainedTokenizerFast

    backend = byte_tokenizer()
    if post_bos:  # like Llama/Mixtral tokenizers: encode() prepends BOS
        from tokenizers.processors import TemplateProcessing

        backend.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, unk_token=SPECIAL_TOKENS[0], chat_template=template
    )


def model_dir(tmp_path, template, **extra):
    config = {
        "bos_token": BOS,
        "eos_token": {"content": EOS, "special": True},
        "unk_token": SPECIAL_TOKENS[0],
        "chat_template": template,
        **extra,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "name,template",
    [("mixtral", MIXTRAL), ("qwen2_moe", QWEN2_MOE), ("qwen3_moe", QWEN3_MOE), ("olmoe", OLMOE), ("helpers", HELPERS)],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_templates_render_like_transformers(tmp_path, name, template, add_generation_prompt):
    ours = ChatTemplate.load(model_dir(tmp_path, template))
    hf = hf_tokenizer(template)
    for messages in CONVERSATIONS:
        if name == "mixtral" and messages[0]["role"] == "system":
            continue  # refused by the template (tested below)
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.render(messages, add_generation_prompt=add_generation_prompt) == want


def test_template_kwargs_and_continue_final_message_like_transformers(tmp_path):
    ours, hf = ChatTemplate.load(model_dir(tmp_path, QWEN3_MOE)), hf_tokenizer(QWEN3_MOE)
    messages = CONVERSATIONS[2]
    got = ours.render(messages, template_kwargs={"enable_thinking": False})
    assert got == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert got.endswith("<think>\n\n</think>\n\n")
    prefill = messages + [{"role": "assistant", "content": "The answer is"}]
    got = ours.render(prefill, add_generation_prompt=False, continue_final_message=True)
    assert got == hf.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert got.endswith("The answer is")
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs: must not set messages"):
        ours.render(messages, template_kwargs={"messages": []})


def test_rendered_chat_tokenizes_without_a_second_bos(tmp_path):
    hf = hf_tokenizer(MIXTRAL, post_bos=True)
    ours = ChatTemplate.load(model_dir(tmp_path, MIXTRAL))
    tokenizer = Tokenizer(hf.backend_tokenizer)
    text = ours.render(CONVERSATIONS[1])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf.apply_chat_template(CONVERSATIONS[1], tokenize=True, return_dict=False)
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID
    assert tokenizer.encode(text)[:2] == [BOS_ID, BOS_ID]  # what adding special tokens again would do


def test_errors_name_the_message(tmp_path):
    ours = ChatTemplate.load(model_dir(tmp_path, MIXTRAL))
    bad = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    with pytest.raises(InvalidRequestError) as e:
        ours.render(bad)
    assert e.value.field == "messages[2]" and "Conversation roles must alternate" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        ours.render([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    assert e.value.field == "messages[0]"  # the alternation check fails first, on the system message
    with pytest.raises(InvalidRequestError, match="messages: must not be empty"):
        ours.render([])
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__ }}")
    with pytest.raises(InvalidRequestError, match="messages\\[0\\]: chat template"):
        escape.render([{"role": "user", "content": "x"}])
    private = ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(InvalidRequestError, match="underscore"):
        private.render([{"role": "user", "content": "x"}])


def test_a_developer_message_is_a_system_message_unless_the_template_knows_the_role(tmp_path):
    """OpenAI's `developer` role replaced `system` (its client sends it for newer models): a template that does not
    know it (the families above raise on an unknown role or drop it) gets it as `system`; one that names it gets it."""
    ours = ChatTemplate.load(model_dir(tmp_path, QWEN2_MOE))
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.render(developer) == ours.render(system)
    strict = ChatTemplate(
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    assert strict.render(developer) == "system: Be brief.\nuser: Hi\n"
    knows = ChatTemplate(
        "{% for m in messages %}{{ 'D' if m.role == 'developer' else m.role }}: {{ m.content }}\n{% endfor %}"
    )
    assert knows.render(developer) == "D: Be brief.\nuser: Hi\n"
    assert developer[0]["role"] == "developer"  # the caller's list is left as it was
    listed = ChatTemplate(
        '{% for m in messages %}{% if m.role in ["system", "developer"] %}<<{{ m.role }}>>{% else %}{{ m.role }}'
        "{% endif %}: {{ m.content }}\n{% endfor %}"
    )
    assert listed.render(developer) == "<<developer>>: Be brief.\nuser: Hi\n"


@pytest.mark.parametrize(
    "mention",
    [
        "{# Written by the model's developers; the 'developer' role is not supported. #}",
        "{{ '# A prompt format for developers\n' }}",
        "Made by developers.\n",
    ],
)
def test_a_template_that_only_mentions_developers_gets_the_developer_role_as_system(mention):
    """The word in a comment or in the template's text is not the template handling the role: it still gets
    `developer` as `system` (a strict template would otherwise refuse every request from OpenAI's client)."""
    strict = ChatTemplate(
        mention + "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert strict.render(developer).endswith("system: Be brief.\nuser: Hi\n")


def test_where_templates_come_from(tmp_path):
    assert ChatTemplate.load(model_dir(tmp_path, None)) is None  # no chat template: chat is off
    named = [{"name": "default", "template": QWEN2_MOE}, {"name": "tool_use", "template": "tools"}]
    assert ChatTemplate.load(model_dir(tmp_path, named)).source == QWEN2_MOE
    assert ChatTemplate.load(model_dir(tmp_path, [{"name": "rag", "template": "x"}])) is None
    (tmp_path / "chat_template.jinja").write_text(OLMOE)  # transformers' newer layout wins
    assert ChatTemplate.load(tmp_path).source == OLMOE
    override = tmp_path / "mine.jinja"
    override.write_text("{{ eos_token }}{{ messages[0].content }}")
    loaded = ChatTemplate.load(tmp_path, override)
    assert loaded.render([{"role": "user", "content": "x"}]) == EOS + "x"  # special tokens from the model
    override.write_text("{% if %}")
    with pytest.raises(ConfigError, match="line 1"):
        ChatTemplate.load(tmp_path, override)
    with pytest.raises(ConfigError, match="--chat-template"):
        ChatTemplate.load(tmp_path, tmp_path / "missing.jinja")


# ---- the RPCs against the real CPU worker ----
def chat_request(messages, n=8, cls=rpb.ChatRequest, **kw):
    return cls(
        messages=[rpb.ChatMessage(role=r, content=c) for r, c in messages],
        parameters=rpb.SamplingParameters(max_new_tokens=n, ignore_eos=True),
        **kw,
    )


@pytest.mark.slow
def test_chat_rpcs_equal_generate_on_the_rendered_prompt(worker, tiny_model, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(MIXTRAL)
    messages = [("user", "Hi"), ("assistant", "Hello"), ("user", "More?")]
    rendered = ChatTemplate.load(tiny_model, template).render([{"role": r, "content": c} for r, c in messages])
    ids = Tokenizer.from_model_dir(tiny_model).encode(rendered, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1

    async def body(router, stub):
        want = await stub.Generate(
            rpb.GenerateRequest(
                token_ids=rpb.TokenIds(ids=ids), parameters=rpb.SamplingParameters(max_new_tokens=8, ignore_eos=True)
            )
        )
        got = await stub.Chat(chat_request(messages))
        assert list(got.token_ids) == list(want.token_ids) and got.text == want.text
        assert got.prompt_tokens == len(ids) and got.stop_reason == rpb.STOP_REASON_LENGTH
        pieces = [m async for m in stub.ChatStream(chat_request(messages, cls=rpb.ChatStreamRequest))]
        assert [t for m in pieces for t in m.token_ids] == list(want.token_ids)
        assert "".join(m.text for m in pieces) == want.text and pieces[-1].generated_tokens == 8
        kwargs, reserved = struct_pb2.Struct(), struct_pb2.Struct()
        kwargs.update({"unused": True})
        reserved.update({"messages": 1})
        await stub.Chat(chat_request(messages, chat_template_kwargs=kwargs))

        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Chat(chat_request([("user", "a"), ("assistant", "b"), ("assistant", "c")]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("messages[2]: chat template: Conversation roles must alternate")
        detail = rpc_status.from_call(e.value).details[1]
        violations = error_details_pb2.BadRequest()
        detail.Unpack(violations)
        assert violations.field_violations[0].field == "messages[2]"
        for bad, field in [
            (chat_request([]), "messages"),
            (chat_request([("", "x")]), "messages[0].role"),
            (chat_request([("user", "x" * 10_000)], n=8000), "messages"),
            (chat_request([("user", "x")], chat_template_kwargs=reserved), "chat_template_kwargs"),
            (chat_request([("user", "")] * 3000), "messages: at most 2048 messages"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Chat(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field), (
                e.value.details()
            )
        long = [("user", "a"), ("assistant", "b")] * 50 + [("user", "c")]  # renders on a thread
        text = ChatTemplate.load(tiny_model, template).render([{"role": r, "content": c} for r, c in long])
        want_ids = Tokenizer.from_model_dir(tiny_model).encode(text, add_special_tokens=False)
        assert (await stub.Chat(chat_request(long, n=2))).prompt_tokens == len(want_ids)
        again = await stub.Chat(chat_request(messages))  # still serving
        assert list(again.token_ids) == list(want.token_ids)

    async def run():
        async with running_router(worker.address, model=str(tiny_model), chat_template=str(template)) as rs:
            await body(*rs)

    asyncio.run(run())


@pytest.mark.slow
def test_chat_without_a_template_is_invalid_argument(worker, tiny_model, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the tiny model's files, without its template
        shutil.copy(tiny_model / name, tmp_path)

    async def run():
        async with running_router(worker.address, model=str(tmp_path)) as (router, stub):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Chat(chat_request([("user", "x")]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.value.details()

    asyncio.run(run())


# ---- untrusted templates: each render in a child process, within chat_template_timeout_s ----
SLOW = "{% for i in range(99999) %}{% for j in range(60) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
# far past a 0.3 s budget on any machine (SLOW alone renders in about that on a fast idle one)
SLOWER = SLOW.replace("range(60)", "range(999)")
RUNAWAY = (
    "{% for i in range(99999) %}{% for j in range(99999) %}{% for k in range(99999) %}{% endfor %}"
    "{% endfor %}{% endfor %}"
)
HI = [{"role": "user", "content": "hi"}]


def test_a_slow_template_fails_within_its_budget_and_the_router_keeps_serving(tmp_path, caplog):
    """A small chat whose template loops for seconds (it rendered on the event loop, stalling /health and every
    stream): 400 within the budget, /health answering throughout, the next chat served by a fresh renderer."""
    import time

    import aiohttp

    from tests.router_service.test_http_errors import AUTH, http_harness, problems

    async def body():
        async with http_harness(tmp_path, template_source=SLOWER, chat_template_timeout_s=0.3) as (
            router,
            fake,
            base,
            hooks,
        ):
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(
                    base + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                ) as r:
                    assert r.status == 400  # the first chat also starts the renderer (outside the budget)

                async def chat():
                    started = time.monotonic()
                    async with s.post(base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 1}) as r:
                        return r.status, await r.json(), time.monotonic() - started

                call = asyncio.ensure_future(chat())
                slowest = 0.0
                while not call.done():
                    started = time.monotonic()
                    async with s.get(base + "/health") as r:
                        assert r.status == 200
                    slowest = max(slowest, time.monotonic() - started)
                    await asyncio.sleep(0.02)
                status, answer, took = call.result()
                assert status == 400 and answer["error"]["param"] == "messages", answer
                assert "chat_template_timeout_s" in answer["error"]["message"] and took < 2.0, (answer, took)
                assert slowest < 0.25, f"/health took {slowest:.2f} s while the template rendered"
            assert not problems(caplog)
            assert router.http.frontend.chat_renderer is not None
            assert len(router.http.frontend.chat_renderer._children) <= 2

    asyncio.run(body())


def test_a_runaway_render_is_killed_and_its_renderer_replaced(tmp_path):
    from router_service.chat_render import TemplateRenderer

    async def body():
        renderer = TemplateRenderer(ChatTemplate(RUNAWAY + "{{ messages[0].content }}"), 0.3, 1)
        try:
            await renderer.render([{"role": "user", "content": "warm"}])  # starts the child: not budgeted
        except InvalidRequestError:
            pass
        try:
            for _ in range(2):
                with pytest.raises(InvalidRequestError, match="did not finish rendering within 0.3 s"):
                    await asyncio.wait_for(renderer.render(HI), 30)
        finally:
            renderer.close()
        fine = TemplateRenderer(ChatTemplate(QWEN2_MOE), 1.0, 1)
        try:
            assert await fine.render(HI) == ChatTemplate(QWEN2_MOE).render(HI)
            with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
                await fine.render(HI, template_kwargs={"messages": 1})
        finally:
            fine.close()

    asyncio.run(body())


def test_a_renderer_that_cannot_start_asks_for_the_routers_configured_back_off(monkeypatch, tmp_path):
    """A render process that cannot start (here: no interpreter to run) is UNAVAILABLE with the router's
    --retry-after-s in its RetryInfo, as the router's other UNAVAILABLE answers, not a fixed second."""
    import sys

    from router_service import errors
    from router_service.batching_loop import BatchingLoop
    from router_service.config import RouterConfig
    from router_service.frontend import Frontend

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))

    async def body():
        loop = BatchingLoop(RouterConfig(retry_after_s=7.5), None)
        frontend = Frontend(loop, "tiny", ChatTemplate("{{ messages[0].content }}"))
        assert frontend.chat_renderer is not None
        try:
            with pytest.raises(errors.Unavailable, match="could not start") as err:
                await frontend.chat_renderer.render(HI)
        finally:
            frontend.chat_renderer.close()
        assert err.value.retry_after_s == 7.5

    asyncio.run(body())


def test_renders_of_departed_callers_keep_their_slot(tmp_path):
    """Callers that give up (a client disconnecting) do not free their renderer for the next caller while it
    still renders: never more children than `processes`, and the survivors still get their answer."""
    from router_service.chat_render import TemplateRenderer

    async def body():
        renderer = TemplateRenderer(ChatTemplate(SLOW), 5.0, 2)
        try:
            calls = [asyncio.ensure_future(renderer.render(HI)) for _ in range(8)]
            await asyncio.sleep(0.5)
            for call in calls[:6]:
                call.cancel()
            for _ in range(40):
                assert len(renderer._children) <= 2
                await asyncio.sleep(0.05)
            assert [await asyncio.wait_for(c, 60) for c in calls[6:]] == ["hi", "hi"]
        finally:
            renderer.close()

    asyncio.run(body())


def test_a_memory_bomb_fails_in_its_renderer_alone():
    from router_service.chat_render import TemplateRenderer

    async def body():
        renderer = TemplateRenderer(ChatTemplate("{{ 'a' * (messages|length * 2 ** 33) }}"), 10.0, 1)
        try:
            with pytest.raises(InvalidRequestError, match="chat template: the render failed"):
                await renderer.render(HI)
        finally:
            renderer.close()

    asyncio.run(body())


@pytest.mark.parametrize("where", ["--chat-template", "chat_template.jinja"])
def test_a_template_file_that_is_not_utf8_is_one_line(tmp_path, where):
    """It ended the router's start-up with a UnicodeDecodeError traceback."""
    path = tmp_path / ("mine.jinja" if where == "--chat-template" else "chat_template.jinja")
    path.write_bytes(b"{{ messages[0].content }}\xff")
    what = "--chat-template" if where == "--chat-template" else "chat template"
    with pytest.raises(ConfigError, match=f"^{what}: {re.escape(str(path))} is not UTF-8 text \\(byte 25\\)$"):
        ChatTemplate.load(tmp_path, path if where == "--chat-template" else None)
