"""A step's logits as the sampler sees them, wherever they live.

Greedy sequences need only the argmax (and a non-finite check), which the cuda backend computes on the
device; the full rows cross to the host only when a sequence samples, asks for logprobs or suppresses stop
tokens. On the cpu backend both come from the same host array.
"""
from __future__ import annotations

import numpy as np


class HostLogits:
    """Logits already on the host: [rows, V] float32."""

    def __init__(self, logits: np.ndarray):
        self.array = logits

    def greedy(self, row: int) -> tuple[int, bool]:
        """(argmax, all finite) of one row."""
        values = self.array[row]
        return int(np.argmax(values)), bool(np.all(np.isfinite(values)))

    def __getitem__(self, row: int) -> np.ndarray:
        return self.array[row]

    def __len__(self) -> int:
        return self.array.shape[0]

    def __iter__(self):
        return iter(self.array)
