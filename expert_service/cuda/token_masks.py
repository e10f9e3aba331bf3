"""Grammar masks on the cuda backend (semantics: expert_service/engine/token_masks.py).

Allocated once with the memory plan: a step's masks [max_rows, W] uint32 (device, and pinned staging), the
masked rows [max_rows, V] float32 (out of place: the raw rows stay for prompt log-probabilities) and scratch
non-finite flags. A step with a constrained sequence runs, after the forward pass (a replayed graph or eager) and
the penalties: one copy of its masks into the preallocated buffer, apply_token_mask (penalised rows read from the
penalties' buffer), and the argmax of the masked rows into the workspace's greedy ids, before they are read back.
The non-finite flags stay those of the unmasked rows (a disallowed -inf is no fault). Steps without masks run
none of it, so the captured graphs are untouched; warm-up runs both kernels once.
"""

from __future__ import annotations

import numpy as np
from cuda.bindings import driver as drv
from numba import cuda

from expert_service.cuda.driver import check, device_address, stream_handle
from expert_service.cuda.workspace import HOST_TWINS
from expert_service.kernels.apply_token_mask import launch_apply_token_mask
from expert_service.kernels.greedy_split import launch_greedy_split
from expert_service.kernels.numeric import SIMULATOR

MAX_VIEWS = 1024  # cached row views (seven arrays x the row counts in use)


class DeviceMasks:
    def __init__(self, max_rows: int, vocab_size: int, ws, stream):
        self.ws, self.stream, self.max_rows = ws, stream, max_rows
        words = -(-vocab_size // 32)
        self.masks = cuda.device_array((max_rows, words), np.uint32, stream=stream)
        # one pinned staging per host twin: a step's upload may still be queued when the next step stages its own
        self.host_masks = [cuda.pinned_array((max_rows, words), np.uint32) for _ in range(HOST_TWINS)]
        self.logits = cuda.device_array((max_rows, vocab_size), np.float32, stream=stream)
        self.host_logits = cuda.pinned_array((max_rows, vocab_size), np.float32)
        self.flags = cuda.device_array(max_rows, np.int32, stream=stream)
        # one driver copy uploads a step's masks (a Numba copy costs ~160 us of host time); not in the simulator
        self._stream_handle = None if SIMULATOR else stream_handle(stream)
        self._masks_address = None if SIMULATOR else device_address(self.masks)
        # Views of R rows, made once per R and per array: slicing a Numba device array costs ~40 us of host time,
        # and a late mask's apply is on the critical path of every constrained step (eleven slices: ~0.5 ms).
        self._views: dict[tuple[int, int], tuple[object, object]] = {}

    @property
    def nbytes(self) -> int:
        return self.masks.nbytes + self.logits.nbytes + self.flags.nbytes

    @staticmethod
    def planned_nbytes(max_rows: int, vocab_size: int) -> int:
        """The nbytes of one of these sizes, before it is made (the start-up device-memory check)."""
        return 4 * max_rows * (-(-vocab_size // 32) + vocab_size + 1)

    def _rows(self, array, rows: int):
        """array[:rows], cached (the cache holds the array, so its id is not reused meanwhile)."""
        key = (id(array), rows)
        hit = self._views.get(key)
        if hit is None:
            if len(self._views) >= MAX_VIEWS:  # callers passing new arrays each time (tests): keep it bounded
                self._views.clear()
            hit = self._views[key] = (array, array[:rows])
        return hit[1]

    def apply(self, masks: np.ndarray, logits, penalized, num_penalized: int, twin: int = 0) -> int:
        """Queues the masked copy of `logits[:R]` (its first num_penalized rows from `penalized`) and its argmax
        into the workspace's greedy ids; R = len(masks); `twin`: the step's host copy. Returns R."""
        rows = len(masks)
        if rows > self.max_rows:
            raise ValueError(f"token masks: {rows} rows exceed the memory plan ({self.max_rows})")
        if masks.shape[1:] != self.masks.shape[1:]:
            raise ValueError(
                f"token masks: rows of {masks.shape[1:]} words, the vocabulary needs {self.masks.shape[1]}"
            )
        host = self.host_masks[twin]
        host[:rows] = masks
        if self._masks_address is None:
            self._rows(self.masks, rows).copy_to_device(host[:rows], stream=self.stream)
        else:
            nbytes = rows * self.masks.shape[1] * 4
            check(drv.cuMemcpyHtoDAsync(self._masks_address, host.ctypes.data, nbytes, self._stream_handle))
        out, ws, view = self._rows(self.logits, rows), self.ws, self._rows
        # the masks end at the last constrained row; penalised rows past it keep the penalties' own argmax
        used = min(num_penalized, rows)
        launch_apply_token_mask(view(logits, rows), penalized, used, view(self.masks, rows), out, stream=self.stream)
        launch_greedy_split(
            out,
            view(ws.greedy_ids, rows),
            view(self.flags, rows),
            view(ws.greedy_part_values, rows),
            view(ws.greedy_part_ids, rows),
            view(ws.greedy_part_flags, rows),
            stream=self.stream,
        )
        return rows

    def warmup(self, logits, penalized) -> None:
        """Compiles both kernels on throw-away work (row 0 of `logits` is only read)."""
        self.apply(np.full((1, self.masks.shape[1]), 0xFFFFFFFF, np.uint32), logits, penalized, 0)
        self.stream.synchronize()

    def download(self, rows: int) -> np.ndarray:
        """The masked rows [rows, V] on the host (waits for the stream)."""
        host = self.host_logits[:rows]
        self.logits[:rows].copy_to_host(host, stream=self.stream)
        self.stream.synchronize()
        return host.copy()
