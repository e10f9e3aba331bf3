"""StopSignals hands every SIGTERM / SIGINT to the event loop's callback, in order: one kept before `attach`, and
one that arrives while `attach` runs (Python runs a signal handler between any two bytecodes of the main thread)."""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from common.lifecycle import StopSignals


def _attach_with_a_signal_at(step: int | None) -> tuple[list[int], int]:
    """(the signals the callback got, the line events attach ran) for an attach that finds SIGINT kept and gets
    SIGTERM at its `step`-th line event (None: no SIGTERM)."""
    signals, got, steps = StopSignals(), list[int](), [0]
    signals._on_signal(signal.SIGINT, None)

    def tracer(frame, event, arg):
        if frame.f_code is not StopSignals.attach.__code__:
            return None
        frame.f_trace_lines = True
        if event == "line":
            if steps[0] == step:
                signals._on_signal(signal.SIGTERM, None)
            steps[0] += 1
        return tracer

    async def main() -> None:
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            signals.attach(asyncio.get_running_loop(), got.append)
        finally:
            sys.settrace(previous)
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())
    return got, steps[0]


@pytest.mark.parametrize("step", range(_attach_with_a_signal_at(None)[1]))
def test_a_signal_arriving_while_attach_runs_is_handed_over_in_order(step):
    """A signal between attach's swap of the kept list and its setting of the loop went to a list nobody read
    again: the stop was lost and the service ran on."""
    assert _attach_with_a_signal_at(step)[0] == [signal.SIGINT, signal.SIGTERM]
