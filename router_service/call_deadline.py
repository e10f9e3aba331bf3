"""The deadline of the call being served, for the work it starts off the event loop (tokenizing, detokenizing, a
chat template's render).

A handler sets CALL_DEADLINE (a time.monotonic(); the variable is per task, so per call) once it knows its
deadline. Work is refused before it starts when the deadline has passed, and a job queued for a thread is skipped
when a thread takes it too late: a client that has given up costs no CPU. A job whose caller was cancelled is
dropped by the executor itself (asyncio cancels the thread's future with the caller's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import time
from collections.abc import Callable
from typing import TypeVar

from router_service import errors

T = TypeVar("T")
CALL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("colibri_call_deadline", default=None)


def enter_call(time_remaining: float | None, what: str) -> None:
    """Sets CALL_DEADLINE from a gRPC call's time_remaining() (None: no deadline), and refuses the call's `what`
    when that deadline has already passed (the call waited behind others, or arrived late)."""
    CALL_DEADLINE.set(None if time_remaining is None else time.monotonic() + time_remaining)
    check_call_deadline(what)


def check_call_deadline(what: str) -> None:
    """Raises DeadlineExceeded, naming `what` was not started, when the current call's deadline has passed."""
    _check(CALL_DEADLINE.get(), what)


def _check(deadline: float | None, what: str) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise errors.DeadlineExceeded(f"the call's deadline passed before its {what} started")


async def run_in_time(executor: concurrent.futures.Executor, what: str, fn: Callable[..., T], *args) -> T:
    """fn(*args) on `executor`, unless the current call's deadline passes before it starts (checked now and again
    when a thread takes the job)."""
    deadline = CALL_DEADLINE.get()
    _check(deadline, what)

    def job() -> T:
        _check(deadline, what)
        return fn(*args)

    return await asyncio.get_running_loop().run_in_executor(executor, job)
