"""The ends of a service process (`colibri router`, `colibri worker`): SIGTERM and SIGINT from its first line to its
exit.

`STOP_SIGNALS.hold()` runs first (colibri/cli.py, before the service's imports: seconds on a loaded machine). A
signal from then until the service's event loop takes over (`attach`) is kept and handed to the loop at once, so the
service stops cleanly with 0 instead of being killed by the default action (exit 143, or a KeyboardInterrupt
traceback). Once the exit status is decided, `ignore()`: a late signal (one sent to every process of a pod, or by a
supervisor after the service's own) cannot turn a clean exit into death by signal. The handlers are Python's
(`signal.signal`), not the loop's: asyncio.run puts the default actions back when it closes the loop, with the
process still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM and SIGINT of this process, handed to one callback on an event loop (each signal, in order). Only a
    process that took them over (`hold`: the command line's entry points) gets them; a service run in-process (tests)
    attaches and hears nothing."""

    def __init__(self):
        self._held: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._callback: Callable[[int], None] | None = None
        self._installed = False

    def hold(self) -> None:
        """Takes SIGTERM and SIGINT over (main thread only): each is kept until `attach`, then handed over."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        self._installed = True

    def attach(self, loop: asyncio.AbstractEventLoop, callback: Callable[[int], None]) -> None:
        """`callback(signum)` runs on `loop` for every signal from now on, and soon for those kept before."""
        # The loop first, then the kept ones: a signal arriving meanwhile (its handler runs between any two bytecodes)
        # is kept behind them while any are left, else handed over, so none is lost and the order holds.
        self._loop, self._callback = loop, callback
        while self._held:
            loop.call_soon(callback, self._held[0])
            del self._held[0]

    def ignore(self) -> None:
        """The exit status is decided: SIGTERM and SIGINT are ignored until the process exits."""
        self._loop = self._callback = None
        if self._installed:
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    def _on_signal(self, signum: int, _frame) -> None:
        loop, callback = self._loop, self._callback
        if loop is None or callback is None or self._held:
            self._held.append(signum)
            return
        # call_soon_threadsafe also wakes the loop's selector; a loop closed meanwhile has nobody left to tell
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, signum)


STOP_SIGNALS = StopSignals()


async def settle_tasks(timeout: float = 1.0) -> None:
    """Waits (up to `timeout`) for every other task of the loop to end. Run last, once the servers have stopped:
    gRPC ends a stopped server's calls on tasks of its own, and asyncio.run would cancel those still pending when
    the service's coroutine returns, which gRPC logs as an ERROR with a traceback."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=timeout)
