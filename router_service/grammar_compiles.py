"""Grammar compiles (structured output, tools) off the event loop, on threads of their own, for callers still
waiting.

A new grammar's lexer takes up to a fraction of a second. A compile queued for a caller that has gone (cancelled,
or past its call deadline, call_deadline.CALL_DEADLINE) is skipped when a thread takes it; one already running stops
before its next costly part (ConstraintCompiler's `wanted`), so the threads go to the callers still waiting. The
threads are apart from the loop's default executor, which parses HTTP bodies: neither kind of work queues behind the
other.
"""

from __future__ import annotations

import asyncio
import threading
import time

from router_service import errors
from router_service.call_deadline import CALL_DEADLINE, check_call_deadline
from router_service.constraints import CompileAbandoned, Constraint, ConstraintCompiler, GrammarMatcher
from router_service.thread_pools import HELPER_THREADS, LazyPool

COMPILE_THREADS = HELPER_THREADS
_pool = LazyPool("colibri-grammar", COMPILE_THREADS)


async def compile_matcher(compiler: ConstraintCompiler, constraint: Constraint, ignore_eos: bool) -> GrammarMatcher:
    """compiler.matcher(constraint, ignore_eos) on a compile thread, for as long as the caller waits for it."""
    check_call_deadline("grammar compile")
    deadline, gone = CALL_DEADLINE.get(), threading.Event()

    def wanted() -> bool:
        return not gone.is_set() and (deadline is None or time.monotonic() < deadline)

    work = asyncio.get_running_loop().run_in_executor(_pool(), compiler.matcher, constraint, ignore_eos, wanted)
    try:
        return await work
    except asyncio.CancelledError:
        gone.set()  # a queued compile is dropped by the executor itself; a running one stops at its next check
        raise
    except CompileAbandoned:  # the deadline passed (a cancelled caller no longer awaits)
        raise errors.DeadlineExceeded("the call's deadline passed while its grammar was compiling") from None
