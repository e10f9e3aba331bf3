"""Penalties on the cuda backend (semantics and state layout: expert_service/engine/penalties.py).

Allocated once with the rest of the memory plan: the slots' state words [max_batch_size, V] uint16 (two bytes
per token: 19 MiB for 64 slots of a 152k vocabulary, half of an int32 count), the penalised logits
[max_batch_size, V] float32 (out of place: the raw rows stay for log-probabilities) and pinned staging for a
step's updates and per-row parameters. A step with penalty work runs, after the forward pass (a replayed
graph or eager): the slot resets (device-to-device copies of a zero row), penalty_update, apply_penalties
and the argmax of the penalised rows into the workspace's greedy ids and non-finite flags, before they are
read back. Steps without penalty work run none of it, so the decode graphs stay as they were captured; warm-up
runs each kernel once, so the first penalised request compiles nothing. Every kernel reads only these
preallocated buffers, so the tail could be captured as well.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from expert_service.engine.penalties import PenaltyBatch
from expert_service.kernels.apply_penalties import launch_apply_penalties
from expert_service.kernels.greedy_split import launch_greedy_split
from expert_service.kernels.penalty_update import launch_penalty_update


class DevicePenalties:
    """State, penalised rows and staging of up to `max_rows` sampling rows and `max_updates` updates a step."""

    def __init__(self, num_slots: int, vocab_size: int, max_rows: int, max_updates: int, ws, stream):
        self.ws, self.stream = ws, stream
        self.max_rows, self.max_updates = max_rows, max_updates
        self.words = cuda.to_device(np.zeros((num_slots, vocab_size), np.uint16), stream=stream)
        self.zero_row = cuda.to_device(np.zeros(vocab_size, np.uint16), stream=stream)
        self.logits = cuda.device_array((max_rows, vocab_size), np.float32, stream=stream)
        self.host_logits = cuda.pinned_array((max_rows, vocab_size), np.float32)
        ints, floats = 3 * max_updates + max_rows, 3 * max_rows
        self.host_ints, self.host_floats = cuda.pinned_array(ints, np.int32), cuda.pinned_array(floats, np.float32)
        self.device_ints = cuda.device_array(ints, np.int32, stream=stream)
        self.device_floats = cuda.device_array(floats, np.float32, stream=stream)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.words, self.zero_row, self.logits, self.device_ints, self.device_floats))

    @staticmethod
    def planned_nbytes(num_slots: int, vocab_size: int, max_rows: int, max_updates: int) -> int:
        """The nbytes of one of these sizes, before it is made (the start-up device-memory check)."""
        words, logits = 2 * (num_slots + 1) * vocab_size, 4 * max_rows * vocab_size
        return words + logits + 4 * (3 * max_updates + max_rows) + 4 * 3 * max_rows

    def apply(self, batch: PenaltyBatch, logits) -> int:
        """Queues the step's penalty work on the stream: resets, state updates, then (when a row is penalised)
        the penalised copy of `logits[:batch.num_rows]` into `self.logits` and its argmax into the
        workspace's greedy_ids / nonfinite. Returns the number of penalised rows written (0: none)."""
        U, R = len(batch.update_slots), batch.num_rows if batch.has_rows else 0
        if U > self.max_updates or R > self.max_rows:
            raise ValueError(
                f"penalties: {U} updates / {R} rows exceed the memory plan ({self.max_updates} / {self.max_rows})"
            )
        st = self.stream
        for slot in batch.reset_slots:
            self.words[int(slot)].copy_to_device(self.zero_row, stream=st)
        ints, floats = self.host_ints, self.host_floats
        for i, part in enumerate((batch.update_slots, batch.update_tokens, batch.update_output)):
            ints[i * U : (i + 1) * U] = part
        ints[3 * U : 3 * U + R] = batch.row_slots[:R]
        for i, part in enumerate((batch.repetition, batch.presence, batch.frequency)):
            floats[i * R : (i + 1) * R] = part[:R]
        if U + R:
            self.device_ints[: 3 * U + R].copy_to_device(ints[: 3 * U + R], stream=st)
        d = self.device_ints
        if U:
            launch_penalty_update(self.words, d[:U], d[U : 2 * U], d[2 * U : 3 * U], stream=st)
        if not R:
            return 0
        self.device_floats[: 3 * R].copy_to_device(floats[: 3 * R], stream=st)
        f, ws, out = self.device_floats, self.ws, self.logits[:R]
        launch_apply_penalties(
            logits[:R], d[3 * U : 3 * U + R], f[:R], f[R : 2 * R], f[2 * R : 3 * R], self.words, out, stream=st
        )
        launch_greedy_split(
            out,
            ws.greedy_ids[:R],
            ws.nonfinite[:R],
            ws.greedy_part_values[:R],
            ws.greedy_part_ids[:R],
            ws.greedy_part_flags[:R],
            stream=st,
        )
        return R

    def warmup(self, logits) -> None:
        """Runs every penalty kernel once on throw-away work (slot 0 marked, penalised into row 0, then zeroed
        again), so the first penalised request compiles nothing; `logits` [>= 1, V] float32 is only read."""
        slot0, ones = np.zeros(1, np.int32), np.ones(1, np.float32)  # slot 0, token 0, a prompt mark
        none_i, none_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
        self.apply(PenaltyBatch(none_i, slot0, slot0, slot0, slot0, ones, ones, ones), logits)
        self.apply(PenaltyBatch(slot0, none_i, none_i, none_i, none_i, none_f, none_f, none_f), logits)
        self.stream.synchronize()

    def download(self, rows: int) -> np.ndarray:
        """The penalised rows [rows, V] on the host (waits for the stream)."""
        host = self.host_logits[:rows]
        self.logits[:rows].copy_to_host(host, stream=self.stream)
        self.stream.synchronize()
        return host.copy()
