"""How long the prompt work already sent to the worker will keep it busy, estimated from the time its prompt-heavy
steps took (as the worker reports it). The batching loop uses it to hold the next step while a long prefill runs:
requests still arriving then join that step instead of the one after it, at no cost in device time as long as
the step reaches the worker before the running work ends."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

# Behind a long prefill the arrival wait may last until the worker's prompt work is estimated to end, less
# SEND_MARGIN_S (the next step's build, transit and launch), and a burst counts as paused only after
# ARRIVAL_QUIET_LONG_S: the first client of a burst can arrive milliseconds before the others (3-7 ms on the
# CPU timelines, where a 3 ms pause sent the first prompt's decode alone and the others' turns a step later).
# The pause still ends the wait when nothing arrives: the estimate starts from the router's receipt of the step
# before, later than the worker started the running one, so holding on it alone would idle the device.
ARRIVAL_QUIET_LONG_S = 0.010
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
    # ... among the steps of the same size class (prompt tokens within a power of two: 256-511, 512-1023, ...),
    # each class remembering its own last `window`: a step's fixed costs weigh more on fewer tokens (on the CPU a
    # 272-token prompt took twice a 2,047-token chunk's time a token, and the 2,047-token pace ended the hold behind
    # it 14 ms early, before the burst was in). A class with no step yet takes the nearest larger class's pace
    # (faster a token: the estimate errs early), or with none larger the nearest smaller one's.


class WorkerBacklog:
    def __init__(self, config: BacklogConfig = BacklogConfig()):
        self.config = config
        self._paces: dict[int, collections.deque[float]] = {}  # size class -> seconds a token, newest last
        self._last_answer_at = 0.0

    @property
    def seconds_per_prompt_token(self) -> float | None:
        """The fastest pace of any size class; None until a prompt-heavy step was answered."""
        return min(min(paces) for paces in self._paces.values()) if self._paces else None

    def answered(self, sent_at: float, prompt_tokens: int, now: float, worker_seconds: float = 0.0) -> None:
        """A step sent at `sent_at` carrying `prompt_tokens` was answered at `now`; `worker_seconds`: the time the
        worker reports for it (0: not reported). Without the worker's time, the step started at the earliest
        when it was sent and when the step before it was answered (the worker runs them in order); that time also
        holds transit and host work, so the pace comes out longer than the worker's (the wait then ends later,
        at the latest when the running step is answered)."""
        if prompt_tokens >= self.config.min_prompt_tokens:
            seconds = worker_seconds if worker_seconds > 0 else now - max(sent_at, self._last_answer_at)
            size_class = prompt_tokens.bit_length()
            if size_class not in self._paces:
                self._paces[size_class] = collections.deque(maxlen=self.config.window)
            self._paces[size_class].append(seconds / prompt_tokens)
        self._last_answer_at = now

    def pace(self, prompt_tokens: int) -> float | None:
        """Seconds a prompt token for a step of `prompt_tokens`: the fastest remembered step of its size class,
        else of the nearest larger class, else of the nearest smaller one (None: nothing learned)."""
        size_class = prompt_tokens.bit_length()
        nearest = sorted(self._paces, key=lambda c: (c < size_class, abs(c - size_class)))
        return min(self._paces[nearest[0]]) if nearest else None

    def busy_until(self, in_flight: Iterable[tuple[float, int]]) -> float:
        """When the worker should run out of the prompt work of the steps in flight, (sent_at, prompt_tokens)
        each, oldest first, on the monotonic clock; 0 when unknown or none. Decodes are not counted."""
        steps = list(in_flight)
        if not steps or not self._paces:
            return 0.0
        began = max(steps[0][0], self._last_answer_at)
        return began + sum(tokens * (self.pace(tokens) or 0.0) for _, tokens in steps if tokens)

    def arrival_wait(self, in_flight: Iterable[tuple[float, int]], window_end: float, quiet_s: float):
        """(until when, after how long a pause) the batching loop waits for arrivals before its next step, given
        its own short window and quiet period: while the steps in flight hold a long prefill, until shortly
        before it ends or the arrivals pause for ARRIVAL_QUIET_LONG_S."""
        hold_until = self.busy_until(in_flight) - SEND_MARGIN_S
        return (hold_until, ARRIVAL_QUIET_LONG_S) if hold_until > window_end else (window_end, quiet_s)
