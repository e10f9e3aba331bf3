"""The expert cache's copy engine on the GPU: a fixed number of device expert slots per MoE layer, filled
from the page-locked host copy of the experts on a dedicated copy stream.

Ordering, all on the device (the host never blocks on a copy):
- a copy into a slot first waits for the compute stream's last use of that slot (an event recorded after
  the kernels that read it), so a re-targeted slot is never overwritten under a running kernel;
- the compute stream waits on the copy's completion event before the kernels that read the slot
  (`CopyHandle.result`, called by ExpertCache.wait);
- the time the compute stream spent waiting is measured with a pair of timing events around each wait
  and read back after the step (the stall reported per step).
Host source: the experts files' mmaps page-locked read-only (DeviceWeights pins them); where the driver
refuses, each layer's experts are copied once into pinned host memory (host RAM = the experts' bytes).
"""

from __future__ import annotations

import logging

import numpy as np
from cuda.bindings import driver as drv
from numba import cuda

from expert_service.cuda.driver import check, non_blocking_stream, stream_handle

log = logging.getLogger("colibri.worker.cuda")


def _event(timing: bool = False):
    flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
    return check(drv.cuEventCreate(flags))


class CopyHandle:
    """A copy in flight: `result()` makes the compute stream wait for it (no host blocking)."""

    __slots__ = ("slots", "event")

    def __init__(self, slots: DeviceSlots, event):
        self.slots, self.event = slots, event

    def result(self) -> None:
        self.slots.wait_on(self.event)


class DeviceSlots:
    def __init__(self, weights, moe_layers: list[int], slots_per_layer: int, compute_stream):
        self.weights, self.slots_per_layer = weights, slots_per_layer
        self.compute = stream_handle(compute_stream)
        self._copy_handle, self.copy_stream = non_blocking_stream()
        self.block_bytes = weights.model.expert_stride
        elems = self.block_bytes // weights.dtype.itemsize
        self.buffers = {
            layer: cuda.device_array((slots_per_layer, elems), dtype=weights.dtype, stream=compute_stream)
            for layer in moe_layers
        }
        self.sources: dict[int, np.ndarray] = {}
        for layer in moe_layers:
            host = weights.expert_host[layer]
            if not weights.expert_pinned[layer]:
                if not self.sources:
                    log.warning(
                        "expert files could not be page-locked: holding a pinned host copy of the experts "
                        "(%.2f GiB of host memory)",
                        len(moe_layers) * host.nbytes / 2**30,
                    )
                staged = cuda.pinned_array(host.nbytes, dtype=np.uint8)
                staged[:] = host
                host = staged
            self.sources[layer] = host
        keys = [(layer, slot) for layer in moe_layers for slot in range(slots_per_layer)]
        self._copied = {key: _event() for key in keys}  # the latest copy into the slot completed
        self._last_use = {key: _event() for key in keys}  # the compute stream's latest use of the slot
        self._used: set[tuple[int, int]] = set()  # slots whose _last_use has been recorded
        self._timers: list[tuple[object, object]] = []  # timing event pairs, reused step after step
        self._timed = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def weights_of(self, layer: int):
        """The layer's slot buffer [slots, stride] (the expert kernels take it with a slot_of map)."""
        return self.buffers[layer]

    # --- the CopyEngine protocol ------------------------------------------------------------------
    def copy(self, layer: int, expert: int, slot: int) -> CopyHandle:
        key = (layer, slot)
        if key in self._used:
            check(drv.cuStreamWaitEvent(self._copy_handle, self._last_use[key], 0))
        nbytes = self.block_bytes
        src = self.sources[layer].ctypes.data + expert * nbytes
        dst = self.buffers[layer].device_ctypes_pointer.value + slot * nbytes
        check(drv.cuMemcpyHtoDAsync(dst, src, nbytes, self._copy_handle))
        check(drv.cuEventRecord(self._copied[key], self._copy_handle))
        return CopyHandle(self, self._copied[key])

    # --- compute-side ordering ----------------------------------------------------------------------
    def wait_on(self, event) -> None:
        """The compute stream waits for a copy, between a pair of timing events (the stall it causes)."""
        if self._timed == len(self._timers):
            self._timers.append((_event(timing=True), _event(timing=True)))
        start, end = self._timers[self._timed]
        self._timed += 1
        check(drv.cuEventRecord(start, self.compute))
        check(drv.cuStreamWaitEvent(self.compute, event, 0))
        check(drv.cuEventRecord(end, self.compute))

    def used(self, layer: int, slots) -> None:
        """Records that the kernels launched so far read these slots (later copies into them wait for them)."""
        for slot in slots:
            key = (layer, slot)
            check(drv.cuEventRecord(self._last_use[key], self.compute))
            self._used.add(key)

    def stall_seconds(self) -> float:
        """Total waiting time of this step's timed waits (call after the compute stream synchronised)."""
        total = 0.0
        for start, end in self._timers[: self._timed]:
            total += check(drv.cuEventElapsedTime(start, end)) / 1e3
        self._timed = 0
        return total

    def close(self) -> None:
        check(drv.cuStreamSynchronize(self._copy_handle))
        for event in (
            list(self._copied.values()) + list(self._last_use.values()) + [e for pair in self._timers for e in pair]
        ):
            drv.cuEventDestroy(event)
        self._timers.clear()
        drv.cuStreamDestroy(self._copy_handle)
