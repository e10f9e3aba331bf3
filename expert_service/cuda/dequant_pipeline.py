"""Per-expert cuBLAS on 8-bit layers (CUBLAS_PER_EXPERT) with the dequantising pass off the critical path.

The GEMMs read a dense copy of each group of active experts (kernels/dequant_experts.py). On one stream every
group's widening waited for the previous group's GEMMs and the GEMMs for their widening, so the pass (~0.23 ms
per mixtral-shape expert on the H200, half the HBM roofline) added to every expert's time. Here the scratch holds
two halves: group i+1 is widened into one half on a side stream while group i's GEMMs read the other on the
compute stream. Events order the two: the GEMMs of a group wait for its widening, and a half is widened again
only after the GEMMs that read it were issued before it (they finished, on the device).

Runs inside a host break (the GEMMs need the row counts on the host), which is never captured in a graph: the
side stream's work joins the compute stream by those waits alone, and the last group's GEMMs wait for the last
widening, so nothing on the side stream outlives the call.
"""

from __future__ import annotations

from collections.abc import Callable

from cuda.bindings import driver as drv

from expert_service.cuda.driver import Event, check, non_blocking_stream, stream_handle

HALVES = 2


class DequantPipeline:
    def __init__(self, stream):
        self.stream = stream
        self._main = stream_handle(stream)
        self._side_handle, self.side = non_blocking_stream()
        self._fork = Event()
        self._widened = [Event() for _ in range(HALVES)]
        self._read = [Event() for _ in range(HALVES)]

    def run(self, groups: int, widen: Callable[[int, int, object], None], gemms: Callable[[int, int], None]):
        """widen(group, half, stream) issues the widening of `group` into scratch half `half` on `stream`;
        gemms(group, half) issues its GEMMs (reading that half) on the compute stream."""
        self._fork.record(self._main)  # the widening reads the grouping and reuses halves earlier work read
        self._wait(self._side_handle, self._fork)
        for group in range(groups):
            half = group % HALVES
            if group >= HALVES:
                self._wait(self._side_handle, self._read[half])
            widen(group, half, self.side)
            self._widened[half].record(self._side_handle)
            self._wait(self._main, self._widened[half])
            gemms(group, half)
            self._read[half].record(self._main)

    def run_in_order(self, groups: int, widen, gemms) -> None:
        """The same on the compute stream alone, group after group (CudaOptions.overlap_dequant off)."""
        for group in range(groups):
            widen(group, group % HALVES, self.stream)
            gemms(group, group % HALVES)

    @staticmethod
    def _wait(stream, event: Event) -> None:
        check(drv.cuStreamWaitEvent(stream, event.handle, 0))

    def close(self) -> None:
        check(drv.cuStreamSynchronize(self._side_handle))
        for event in [self._fork, *self._widened, *self._read]:
            event.close()
        check(drv.cuStreamDestroy(self._side_handle))
