"""The n samples of one request share its render, tokenizing and validation: each sample did all three again
(~3.5 ms a sample: n=128 took 0.45 s on the tiny model). Each sample is still a request of its own, with its own
seed: the request's advanced by the sample's strides, or a fresh one when none was given."""

from __future__ import annotations

import asyncio
import random

from common.pb import router_pb2
from router_service.batching_loop import BatchingLoop
from router_service.chat import ChatTemplate
from router_service.frontend import SEED_STRIDE, Frontend
from tests.router_service.test_frontend import CONFIG, _connect


class CountingTokenizer:
    """Ten ids per text; counts the texts it tokenizes."""

    def __init__(self):
        self.texts: list[str] = []

    async def encode_async(self, text, add_special_tokens=True):
        self.texts.append(text)
        return list(range(1, 11))

    async def encode_chat_async(self, text):
        return await self.encode_async(text, False)

    async def escape_chat_async(self, value):
        return value

    def detokenizer(self, prompt_ids):
        return None


def _frontend(template: ChatTemplate | None = None) -> tuple[Frontend, CountingTokenizer]:
    tokenizer = CountingTokenizer()
    loop = BatchingLoop(CONFIG, None, tokenizer=tokenizer)  # type: ignore[arg-type]
    _connect(loop, num_blocks=512)
    return Frontend(loop, chat_template=template), tokenizer


def _parameters() -> router_pb2.SamplingParameters:
    seeded = random.random() < 0.7
    seed = {"seed": random.randrange(1 << 64)} if seeded else {}
    return router_pb2.SamplingParameters(max_new_tokens=random.randint(1, 5), temperature=1.0, **seed)


def _check_seeds(handles, parameters) -> None:
    seeds = [handle._state.req.seed for handle in handles]
    if parameters.HasField("seed"):
        assert seeds == [(parameters.seed + j * SEED_STRIDE) % (1 << 64) for j in range(len(handles))]
    assert len(set(seeds)) == len(seeds)  # unseeded: fresh ones (2^-64 to collide)


def test_the_samples_of_a_prompt_tokenize_and_validate_it_once():
    async def main():
        frontend, tokenizer = _frontend()
        samples, parameters = random.randint(2, 8), _parameters()
        request = router_pb2.GenerateRequest(text="x" * random.randint(1, 50), parameters=parameters)
        handles = await frontend.submit(request, None, False, samples=samples)
        assert tokenizer.texts == [request.text]
        assert len(handles) == samples and len({h.request_id for h in handles}) == samples
        assert all(h.prompt_ids == handles[0].prompt_ids for h in handles)
        _check_seeds(handles, parameters)
        assert frontend._num_admitting == 0 and frontend.batching_loop.num_active == samples

    asyncio.run(main())


def test_the_samples_of_a_chat_render_it_once():
    async def main():
        frontend, tokenizer = _frontend(ChatTemplate("{% for m in messages %}{{ m.content }}|{% endfor %}"))
        assert frontend.chat_renderer is not None
        renders = []
        render = frontend.chat_renderer.render

        async def counted(*args, **kwargs):
            renders.append(args)
            return await render(*args, **kwargs)

        frontend.chat_renderer.render = counted  # type: ignore[method-assign]
        try:
            samples, parameters = random.randint(2, 8), _parameters()
            content = "".join(random.choice("abc ") for _ in range(random.randint(1, 30)))
            messages = [{"role": "user", "content": content}]
            handles = await frontend.submit_chat(messages, parameters, "", None, False, samples=samples)
            assert len(renders) == 1 and tokenizer.texts == [content + "|"]
            assert len(handles) == samples and all(h.request_id.startswith("chatcmpl-") for h in handles)
            _check_seeds(handles, parameters)
        finally:
            frontend.chat_renderer.close()

    asyncio.run(main())
