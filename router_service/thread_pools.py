"""Thread pools the router's event loop hands blocking work to (tokenizing long texts, compiling grammars), each
created on first use so that a router that never needs one starts no threads."""

from __future__ import annotations

import concurrent.futures
import os
import threading

# A core left to the event loop on small machines, and no more than a few threads on large ones.
HELPER_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))


class LazyPool:
    """`pool()`: one ThreadPoolExecutor of `threads` threads named `name-N`, made on the first call."""

    def __init__(self, name: str, threads: int = HELPER_THREADS):
        self.name, self.threads = name, threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
            return self._executor
