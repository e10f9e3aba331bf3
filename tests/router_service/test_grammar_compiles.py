"""A grammar compile is work for a caller still waiting: one queued for a caller past its deadline or cancelled
is never run, and one running stops before building its lexer (the costly part) once its caller has gone, caching
nothing. Compiles of cancelled requests ran on to completion, holding the threads other requests waited for."""

from __future__ import annotations

import asyncio
import random
import threading
import types

import pytest

from expert_service.tools.tiny_model import EOS_ID, byte_tokenizer
from router_service import call_deadline, grammar_compiles
from router_service.call_deadline import CALL_DEADLINE
from router_service.constraints import CompileAbandoned, Constraint, ConstraintCompiler
from router_service.errors import DeadlineExceeded
from router_service.grammar_compiles import COMPILE_THREADS, compile_matcher


def _compiler() -> ConstraintCompiler:
    tok = byte_tokenizer()
    return ConstraintCompiler(tok.to_str(), tok.get_vocab_size(), [EOS_ID])


def _constraint() -> Constraint:
    names = random.sample(["a", "b", "c", "d", "e", "f"], random.randint(1, 4))
    return Constraint.json_schema(
        {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names}
    )


class _Watched:
    """Wraps a compiler's llguidance: its grammar validation (the compile's first part) waits for `release`, and
    every compile's outcome is recorded."""

    def __init__(self, compiler: ConstraintCompiler):
        self.started, self.release, self.ended = threading.Event(), threading.Event(), threading.Event()
        self.outcomes: list[str] = []
        real, watched = compiler._llg, self

        class LLMatcher:
            @staticmethod
            def validate_grammar_with_warnings(*args, **kwargs):
                watched.started.set()
                assert watched.release.wait(60)
                return real.LLMatcher.validate_grammar_with_warnings(*args, **kwargs)

            def __new__(cls, *args, **kwargs):
                return real.LLMatcher(*args, **kwargs)

        compiler._llg = types.SimpleNamespace(LLMatcher=LLMatcher, LLParserLimits=real.LLParserLimits)
        compile_ = compiler._compile

        def recorded(*args):
            try:
                result = compile_(*args)
                self.outcomes.append("compiled")
                return result
            except CompileAbandoned:
                self.outcomes.append("abandoned")
                raise
            finally:
                self.ended.set()

        compiler._compile = recorded


def test_a_compile_for_a_caller_past_its_deadline_never_starts():
    async def main():
        compiler = _compiler()
        watched = _Watched(compiler)
        watched.release.set()
        CALL_DEADLINE.set(-random.uniform(0, 5))  # time.monotonic() is never negative
        with pytest.raises(DeadlineExceeded, match="grammar compile"):
            await compile_matcher(compiler, _constraint(), False)
        assert watched.outcomes == [] and not compiler._cache
        CALL_DEADLINE.set(None)
        assert (await compile_matcher(compiler, _constraint(), False)) is not None  # in time: compiled

    asyncio.run(main())


def test_a_running_compile_stops_before_its_lexer_when_its_caller_is_cancelled():
    async def main():
        compiler = _compiler()
        watched = _Watched(compiler)
        caller = asyncio.ensure_future(compile_matcher(compiler, _constraint(), False))
        try:
            assert await asyncio.to_thread(watched.started.wait, 60)
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
        finally:
            watched.release.set()
        assert await asyncio.to_thread(watched.ended.wait, 60)
        assert watched.outcomes == ["abandoned"] and not compiler._cache and compiler.misses == 0

    asyncio.run(main())


def test_a_running_compile_whose_deadline_passes_fails_the_call_as_deadline_exceeded(monkeypatch):
    clock = [0.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0])
    monkeypatch.setattr(call_deadline, "time", fake_time)
    monkeypatch.setattr(grammar_compiles, "time", fake_time)

    async def main():
        compiler = _compiler()
        watched = _Watched(compiler)
        CALL_DEADLINE.set(random.uniform(1, 100))
        caller = asyncio.ensure_future(compile_matcher(compiler, _constraint(), False))
        try:
            assert await asyncio.to_thread(watched.started.wait, 60)
            clock[0] = CALL_DEADLINE.get() + random.uniform(0, 10)
        finally:
            watched.release.set()
        with pytest.raises(DeadlineExceeded, match="while its grammar was compiling"):
            await caller
        assert watched.outcomes == ["abandoned"] and not compiler._cache

    asyncio.run(main())


def test_a_queued_compile_of_a_cancelled_caller_never_runs():
    async def main():
        compiler = _compiler()
        watched = _Watched(compiler)
        watched.release.set()
        started, release = threading.Semaphore(0), threading.Event()

        def busy():
            started.release()
            release.wait(60)

        blockers = [grammar_compiles._pool().submit(busy) for _ in range(COMPILE_THREADS)]
        try:
            for _ in blockers:
                assert await asyncio.to_thread(started.acquire, timeout=60)
            caller = asyncio.ensure_future(compile_matcher(compiler, _constraint(), False))
            await asyncio.sleep(0)  # queued behind the busy threads
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
        finally:
            release.set()
        # jobs run in order: once one queued after it has run, the cancelled compile was skipped
        await asyncio.wrap_future(grammar_compiles._pool().submit(lambda: None))
        for blocker in blockers:
            await asyncio.wrap_future(blocker)
        assert watched.outcomes == [] and not compiler._cache
        # the threads serve the next caller
        assert (await compile_matcher(compiler, _constraint(), False)) is not None

    asyncio.run(main())
