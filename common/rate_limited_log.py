"""Log lines that anyone on the network can cause (a malformed request, a chat template past its time budget)
are written at most once per interval, each saying how many like it were left out since the previous one."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """One kind of event, logged at WARNING at most once every `interval_s` seconds."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.logger, self.interval_s = logger, interval_s
        self._next = 0.0
        self._skipped = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        self._next = now + self.interval_s
        if self._skipped:
            message, args = message + " (and %d more like it since the last such line)", (*args, self._skipped)
        self._skipped = 0
        self.logger.warning(message, *args)
