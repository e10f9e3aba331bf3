"""How long the prompt work already sent to the worker will keep it busy, estimated from the time its prompt-heavy
steps took (as the worker reports it). The batching loop uses it to hold the next step while a long prefill runs:
requests still arriving then join that step instead of the one after it, at no cost in device time as long as
the step reaches the worker before the running work ends."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass

# Behind a long prefill the arrival wait lasts until the worker's prompt work is estimated to end, less
# SEND_MARGIN_S (the next step's build, transit and launch), whatever pauses the arrivals make meanwhile: the
# device is busy until then, so ending the wait early gains nothing, and a client of the burst arriving after a
# pause (the first of a round often comes milliseconds before the others) would start a step later.
SEND_MARGIN_S = 0.003


@dataclass(frozen=True)
class BacklogConfig:
    # steps with fewer prompt tokens do not teach the pace (their time is mostly fixed costs and decodes)
    min_prompt_tokens: int = 256
    # the pace is the fastest of the last `window` such steps: a slow one (a first launch compiling or capturing a
    # graph, a step queued behind another) does not move it, nor do chunks attending over a long cached prefix
    # (on the H200 a 1,024-token step over 2,048 cached tokens a sequence took 1.5x a plain chunk's time a token;
    # a median over both made the hold outlast a plain chunk by up to a third of its time, the device idle)
    window: int = 8


class WorkerBacklog:
    def __init__(self, config: BacklogConfig = BacklogConfig()):
        self.config = config
        self.seconds_per_prompt_token: float | None = None  # None until a prompt-heavy step was answered
        self._paces: collections.deque[float] = collections.deque(maxlen=config.window)
        self._last_answer_at = 0.0

    def answered(self, sent_at: float, prompt_tokens: int, now: float, worker_seconds: float = 0.0) -> None:
        """A step sent at `sent_at` carrying `prompt_tokens` was answered at `now`; `worker_seconds`: the time the
        worker reports for it (0: not reported). Without the worker's time, the step started at the earliest
        when it was sent and when the step before it was answered (the worker runs them in order); that time also
        holds transit and host work, so the pace comes out longer than the worker's (the wait then ends later,
        at the latest when the running step is answered)."""
        if prompt_tokens >= self.config.min_prompt_tokens:
            seconds = worker_seconds if worker_seconds > 0 else now - max(sent_at, self._last_answer_at)
            self._paces.append(seconds / prompt_tokens)
            self.seconds_per_prompt_token = min(self._paces)
        self._last_answer_at = now

    def busy_until(self, in_flight: Iterable[tuple[float, int]]) -> float:
        """When the worker should run out of the prompt work of the steps in flight, (sent_at, prompt_tokens)
        each, oldest first, on the monotonic clock; 0 when unknown or none. Decodes are not counted: the
        estimate errs towards an earlier time, which only shortens the wait it is used for."""
        steps = list(in_flight)
        if not steps or self.seconds_per_prompt_token is None:
            return 0.0
        began = max(steps[0][0], self._last_answer_at)
        return began + sum(tokens for _, tokens in steps) * self.seconds_per_prompt_token

    def arrival_wait(self, in_flight: Iterable[tuple[float, int]], window_end: float, quiet_s: float):
        """(until when, after how long a pause) the batching loop waits for arrivals before its next step, given
        its own short window and quiet period: while the steps in flight hold a long prefill, until shortly
        before it ends, and no pause ends the wait (an infinite quiet period)."""
        hold_until = self.busy_until(in_flight) - SEND_MARGIN_S
        return (hold_until, math.inf) if hold_until > window_end else (window_end, quiet_s)
