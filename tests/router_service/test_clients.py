"""The Python clients (blocking and asyncio) and `colibri generate --chat --logprobs --top-logprobs` against a real
router, with a repetition penalty riding along."""

import argparse
import asyncio

import pytest

from router_service import generate_cmd
from router_service.async_client import AsyncColibriClient
from router_service.client import ColibriClient
from tests.helpers import byte_ids, running_router

pytestmark = pytest.mark.slow
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GREEDY = dict(max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2, repetition_penalty=1.3, temperature=0.0)


def test_sync_and_async_clients_agree(worker, tiny_model, tmp_path, capsys):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    def sync_calls(target):
        with ColibriClient(target) as client:
            chat = client.chat(messages, **GREEDY)
            streamed = list(client.chat_stream([(m["role"], m["content"]) for m in messages], **GREEDY))
            return client.generate("Hello", **GREEDY), chat, streamed

    async def body():
        async with running_router(worker.address, model=str(tiny_model), chat_template=str(template)) as rs:
            router, _ = rs
            target = f"127.0.0.1:{router.port}"
            generated, chat, streamed = await asyncio.to_thread(sync_calls, target)
            assert [t for m in streamed for t in m.token_ids] == list(chat.token_ids)
            assert "".join(m.text for m in streamed) == chat.text and len(chat.logprobs) == 6
            # the stream starts on the chat's cached prompt blocks: the same tokens, log-probabilities to rounding
            tops = [t for m in streamed for t in m.top_logprobs]
            assert [list(t.token_ids) for t in tops] == [list(t.token_ids) for t in chat.top_logprobs]
            for mine, theirs in zip(tops, chat.top_logprobs):
                assert list(mine.logprobs) == pytest.approx(list(theirs.logprobs), rel=1e-5, abs=1e-6)
            assert len(chat.top_logprobs) == 6 and all(len(t.token_ids) == 2 for t in chat.top_logprobs)
            async with AsyncColibriClient(target) as client:
                assert (await client.generate("Hello", **GREEDY)).text == generated.text
                pieces = [m async for m in client.stream("Hello", **GREEDY)]
                assert "".join(m.text for m in pieces) == generated.text
                assert (await client.chat(messages, **GREEDY)).token_ids == chat.token_ids
                pieces = [m async for m in client.chat_stream(messages, **GREEDY)]
                assert [t for m in pieces for t in m.token_ids] == list(chat.token_ids)
                assert await client.tokenize("Hi é") == byte_ids("Hi é")
                assert (await client.model_info()).model_name == "model"
                # Leaving a stream early cancels the call: the router frees the request.
                async for _ in client.stream("Hello", max_new_tokens=500, ignore_eos=True):
                    break
                for _ in range(300):
                    if router.batching_loop.num_active == 0:
                        break
                    await asyncio.sleep(0.01)
                assert router.batching_loop.num_active == 0

            parser = argparse.ArgumentParser()
            generate_cmd.add_arguments(parser)
            args = parser.parse_args(
                [
                    "Hi",
                    "--target",
                    target,
                    "--chat",
                    "--system",
                    "Be brief.",
                    "--logprobs",
                    "--top-logprobs",
                    "2",
                    "--repetition-penalty",
                    "1.3",
                    "--max-new-tokens",
                    "6",
                    "--ignore-eos",
                ]
            )
            assert await asyncio.to_thread(generate_cmd.run, args) == 0
            return chat

    chat = asyncio.run(body())
    out, err = capsys.readouterr()
    assert out == chat.text + "\n"
    lines = [line.split("\t") for line in err.splitlines() if "\t" in line]
    assert [int(i) for i, *_ in lines] == list(chat.token_ids)
    assert [float(lp) for _, lp, *_ in lines] == pytest.approx(list(chat.logprobs), abs=1e-4)
    assert [[int(t.split(":")[0]) for t in top] for _, _, *top in lines] == [
        list(t.token_ids) for t in chat.top_logprobs
    ]
