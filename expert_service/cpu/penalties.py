"""Penalty state and application on the cpu backend: the slots' words in one host array, a step's updates
and its penalised rows vectorised over the batch (semantics and state layout: expert_service/engine/penalties.py)."""

from __future__ import annotations

import numpy as np

from expert_service.engine.penalties import PenaltyBatch, apply_penalties, update_state


class HostPenalties:
    """State words [num_slots, V] uint16, allocated once."""

    def __init__(self, num_slots: int, vocab_size: int):
        self.words = np.zeros((num_slots, vocab_size), np.uint16)

    @property
    def nbytes(self) -> int:
        return self.words.nbytes

    def apply(self, batch: PenaltyBatch, logits: np.ndarray) -> np.ndarray | None:
        """Updates the state, then returns the penalised copy of the sampling rows `logits[:batch.num_rows]`
        (rows without a slot unchanged); None when no row is penalised."""
        update_state(self.words, batch)
        if not batch.has_rows:
            return None
        rows = logits[: batch.num_rows]
        out = rows.astype(np.float32, copy=True)
        mine = np.flatnonzero(batch.row_slots >= 0)
        out[mine] = apply_penalties(
            rows[mine],
            self.words[batch.row_slots[mine]],
            batch.repetition[mine],
            batch.presence[mine],
            batch.frequency[mine],
        )
        return out
