"""Streamed text end to end, through the real router over a fake worker that generates a scripted reply, with the
tokenizers of real model families: emoji, CJK and combining marks span tokens (Mixtral's are `<0xNN>` byte
tokens), the prompt ends inside such a run, replies are cut at max_tokens mid-character and stopped by strings
that span tokens. On both fronts, for every choice of n > 1, the streamed pieces concatenate to the unary text."""

import asyncio
import json

import aiohttp
import pytest

from common.pb import router_pb2 as rpb
from router_service.tokenizer import REPLACEMENT, Tokenizer
from tests.helpers import free_port
from tests.router_service.fake_worker import FakeWorker, harness
from tests.router_service.real_tokenizers import chatml_byte_level, sentencepiece_bpe

pytestmark = pytest.mark.slow
PROMPT = "Say 日本語"  # ends in a run of byte tokens (Mixtral) or byte-level pieces (Qwen)
REPLY = "Hi 🙂 日本語 e\u0301 done. Bonjour"
STOPS = [[], ["本語"], ["done", "do"], ["🙂"], ["Bonjourx"], ["語 e"]]


async def _sse(session, url: str, body: dict) -> tuple[dict[int, list[str]], dict[int, str]]:
    pieces: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    pieces.setdefault(choice["index"], []).append(choice["text"])
                    if choice["finish_reason"]:
                        reasons[choice["index"]] = choice["finish_reason"]
    return pieces, reasons


@pytest.mark.parametrize("family", ["mixtral", "qwen"])
def test_streams_concatenate_to_the_unary_text(family):
    """Before, with Mixtral's tokenizer, the prompt's CJK bytes came out first as U+FFFDs ("����� Hi ...")."""
    hf = sentencepiece_bpe() if family == "mixtral" else chatml_byte_level()
    tokenizer = Tokenizer(hf)
    script = tokenizer.encode(REPLY, add_special_tokens=False)
    # in context the first "▁Hi" shows its space; Qwen's byte-level text has none to show
    whole = (" " if family == "mixtral" else "") + REPLY

    async def body():
        fake = FakeWorker(vocab_size=hf.get_vocab_size(), script=script)
        settings = dict(http_port=free_port(), max_new_tokens=512, default_max_new_tokens=512)
        async with harness(fake, tokenizer=tokenizer, **settings) as (router, _, stub, _):
            url = f"http://127.0.0.1:{router.http_port}/v1/completions"
            async with aiohttp.ClientSession() as session:
                for max_tokens in (len(script), 3, 5, 9, 12):
                    for stop in STOPS:
                        request = {"prompt": PROMPT, "max_tokens": max_tokens, "n": 2, "stop": stop or None}
                        async with session.post(url, json=request) as response:
                            unary = (await response.json())["choices"]
                        pieces, reasons = await _sse(session, url, {**request, "stream": True})
                        params = rpb.SamplingParameters(max_new_tokens=max_tokens, stop_sequences=stop)
                        grpc_unary = await stub.Generate(rpb.GenerateRequest(text=PROMPT, parameters=params))
                        stream = rpb.GenerateStreamRequest(text=PROMPT, parameters=params)
                        grpc_pieces = [m.text async for m in stub.GenerateStream(stream)]
                        for choice in unary:
                            text, streamed = choice["text"], pieces[choice["index"]]
                            assert "".join(streamed) == text == grpc_unary.text == "".join(grpc_pieces)
                            assert reasons[choice["index"]] == choice["finish_reason"]
                            assert whole.startswith(text.rstrip(REPLACEMENT))  # a prefix, maybe cut mid-character
                            if REPLACEMENT not in text:
                                assert not any(REPLACEMENT in p for p in streamed + grpc_pieces)
                            if stop:
                                assert not any(s in text for s in stop)
                            elif max_tokens == len(script):
                                assert text == whole

    asyncio.run(body())


def test_stop_strings_count_from_min_tokens_on():
    """As EOS and the stop ids, a stop string ends the reply only once min_tokens were generated; before, one that
    completed inside the first min_tokens ended it anyway."""
    hf = chatml_byte_level()
    tokenizer = Tokenizer(hf)
    script = tokenizer.encode(REPLY, add_special_tokens=False)
    stop = "o"
    starts = [i for i, c in enumerate(REPLY) if c == stop]  # in "done" and "Bonjour"

    def tokens_to_complete(end: int) -> int:
        return next(t for t in range(1, len(script) + 1) if len(hf.decode(script[:t]).rstrip(REPLACEMENT)) >= end)

    async def body():
        fake = FakeWorker(vocab_size=hf.get_vocab_size(), script=script)
        settings = dict(http_port=free_port(), max_new_tokens=512, default_max_new_tokens=512)
        async with harness(fake, tokenizer=tokenizer, **settings) as (router, _, _, _):
            url = f"http://127.0.0.1:{router.http_port}/v1/completions"
            async with aiohttp.ClientSession() as session:
                for min_tokens in range(len(script) + 1):
                    cut = next((p for p in starts if tokens_to_complete(p + 1) >= min_tokens), None)
                    request = {"prompt": PROMPT, "max_tokens": len(script), "min_tokens": min_tokens, "stop": [stop]}
                    async with session.post(url, json=request) as response:
                        choice = (await response.json())["choices"][0]
                    pieces, reasons = await _sse(session, url, {**request, "stream": True})
                    expected = REPLY if cut is None else REPLY[:cut]
                    assert choice["text"] == "".join(pieces[0]) == expected, min_tokens
                    assert choice["finish_reason"] == reasons[0] == ("length" if cut is None else "stop")

    asyncio.run(body())
