"""Work a call starts off the event loop (tokenizing, detokenizing, a chat template's render) is not started for a
caller whose deadline has passed or who has gone: such a client still cost the CPU of tokenizing its text."""

from __future__ import annotations

import asyncio
import random
import threading
import types

import grpc
import pytest

from expert_service.tools.tiny_model import byte_tokenizer
from router_service import call_deadline
from router_service import tokenizer as tokenizer_module
from router_service.call_deadline import CALL_DEADLINE
from router_service.chat import ChatTemplate
from router_service.chat_render import TemplateRenderer
from router_service.config import RouterConfig
from router_service.errors import DeadlineExceeded
from router_service.servicer import GenerationServicer
from router_service.tokenizer import INLINE_MAX_CHARS, TOKENIZER_THREADS, Tokenizer


class _CountingTokenizer:
    """An HF tokenizer that counts the calls doing real work."""

    def __init__(self):
        self._inner, self.calls = byte_tokenizer(), []

    def __getattr__(self, name):
        attribute = getattr(self._inner, name)
        if name in ("encode", "encode_batch", "decode", "decode_batch"):
            self.calls.append(name)
        return attribute


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self, time_remaining):
        self._time_remaining, self.codes = time_remaining, []

    def time_remaining(self):
        return self._time_remaining

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details="", trailing_metadata=()):
        self.codes.append((code, details))
        raise _Aborted


def _servicer(hf) -> GenerationServicer:
    loop = types.SimpleNamespace(config=RouterConfig(), tokenizer=Tokenizer(hf), limits=None, info=None)
    return GenerationServicer(loop, frontend=types.SimpleNamespace(model_name="m"))  # type: ignore[arg-type]


def _text() -> str:
    return "".join(random.choice("abc é") for _ in range(random.randint(1, 3 * INLINE_MAX_CHARS)))


@pytest.mark.parametrize("method", ["Tokenize", "Detokenize"])
def test_a_call_past_its_deadline_tokenizes_nothing(method):
    from common.pb import router_pb2 as rpb

    async def main():
        hf = _CountingTokenizer()
        servicer = _servicer(hf)
        text = _text()
        request = (
            rpb.TokenizeRequest(text=text, return_pieces=random.random() < 0.5)
            if method == "Tokenize"
            else rpb.DetokenizeRequest(token_ids=hf.encode(text).ids)
        )
        hf.calls.clear()
        context = _Context(-random.uniform(0, 5) if random.random() < 0.5 else 0.0)
        with pytest.raises(_Aborted):
            await getattr(servicer, method)(request, context)
        assert hf.calls == [] and len(context.codes) == 1
        code, details = context.codes[0]
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline passed before its" in details
        ok = _Context(60.0)  # the same call in time is answered
        await getattr(servicer, method)(request, ok)
        assert ok.codes == [] and hf.calls

    asyncio.run(main())


def test_a_job_a_thread_takes_past_its_deadline_is_skipped(monkeypatch):
    """The deadline was still ahead when the job was queued, behind busy threads, and passed before a thread took
    it (a fake clock: no timing involved)."""
    clock = [0.0]
    monkeypatch.setattr(call_deadline, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    async def main():
        hf = _CountingTokenizer()
        tokenizer = Tokenizer(hf)
        started, release = threading.Semaphore(0), threading.Event()

        def busy():
            started.release()
            release.wait(60)

        pool = tokenizer_module._pool()
        blockers = [pool.submit(busy) for _ in range(TOKENIZER_THREADS)]
        try:
            for _ in blockers:
                assert started.acquire(timeout=60)
            CALL_DEADLINE.set(random.uniform(1, 100))
            text = "x" * (INLINE_MAX_CHARS + random.randint(1, 5000))
            call = random.choice([tokenizer.encode_async, tokenizer.encode_details_async])
            job = asyncio.ensure_future(call(text))
            await asyncio.sleep(0)  # queued, its deadline ahead
            assert not job.done()
            clock[0] = CALL_DEADLINE.get() + random.uniform(0, 10)
        finally:
            release.set()
        with pytest.raises(DeadlineExceeded, match="deadline passed before its tokenizing started"):
            await job
        assert hf.calls == []

    asyncio.run(main())


def test_a_render_is_not_started_for_a_caller_past_its_deadline_or_gone():
    async def main():
        renderer = TemplateRenderer(ChatTemplate("{{ messages[0].content }}"), 5.0, 1)
        messages = [{"role": "user", "content": _text()}]
        try:
            CALL_DEADLINE.set(-random.uniform(0, 5))  # time.monotonic() is never negative
            with pytest.raises(DeadlineExceeded, match="chat template render"):
                await renderer.render(messages)
            CALL_DEADLINE.set(None)
            caller = asyncio.ensure_future(renderer.render(messages))
            await asyncio.sleep(0)  # the caller holds the slot and waits for its render, not yet begun
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            for _ in range(10):  # the render task's turn comes
                await asyncio.sleep(0)
            assert not renderer._children  # no child started, nothing rendered
            assert not renderer._slots.locked()
        finally:
            renderer.close()

    asyncio.run(main())
