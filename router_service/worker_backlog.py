"""How long the prompt work already sent to the worker will keep it busy, estimated from the pace at which its
prompt-heavy steps have been answered. The batching loop uses it to hold the next step while a long prefill
runs: requests still arriving then join that step instead of the one after it, at no cost in device time as long
as the step reaches the worker before the running work ends."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BacklogConfig:
    # steps with fewer prompt tokens do not teach the pace (their time is mostly fixed costs and decodes)
    min_prompt_tokens: int = 256
    weight: float = 0.25  # of the newest observation in the running estimate


class WorkerBacklog:
    def __init__(self, config: BacklogConfig = BacklogConfig()):
        self.config = config
        self.seconds_per_prompt_token: float | None = None  # None until a prompt-heavy step was answered
        self._last_answer_at = 0.0

    def answered(self, sent_at: float, prompt_tokens: int, now: float) -> None:
        """A step sent at `sent_at` carrying `prompt_tokens` was answered at `now`. It started on the worker at
        the earliest when it was sent and when the step before it was answered (the worker runs them in order);
        what the pace includes beyond device time (one transit each way) errs on the side of waiting less."""
        if prompt_tokens >= self.config.min_prompt_tokens:
            pace = (now - max(sent_at, self._last_answer_at)) / prompt_tokens
            old = self.seconds_per_prompt_token
            w = self.config.weight
            self.seconds_per_prompt_token = pace if old is None else (1 - w) * old + w * pace
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
