"""The expert cache's memory on the GPU, all of it on the device: a fixed number of slots per MoE layer, the
slot map that says which expert each slot holds (kernels/expert_slot_map.py updates it from the step's own
routing) and the host copy of the experts, read by the fetch kernel (kernels/expert_fetch.py) through its mapped
device address. Nothing here waits for the host or asks it anything, so a cached step is captured and replayed
as a CUDA graph like a resident one.

Host source: the experts files' mmaps, page-locked read-only and mapped (DeviceWeights pins them); where the
driver refuses, each layer's experts are copied once into mapped pinned host memory (host RAM = their bytes).
Counters: hits, misses and prefetches are counted on the device (`stats`, per layer) and read back with each
step's results (`download_stats`); a step's counts are the difference (`step_stats`).
"""

from __future__ import annotations

import logging

import numpy as np
from numba import cuda

from expert_service.cuda.driver import mapped_address
from expert_service.experts.cache import CacheStats
from expert_service.experts.slot_map_reference import waves_needed
from expert_service.kernels.expert_fetch import launch_expert_fetch
from expert_service.kernels.expert_slot_map import (
    HITS,
    MISSES,
    POLICY_LFU,
    POLICY_LRU,
    PREFETCHES_ISSUED,
    PREFETCHES_USED,
    check_layer_size,
    launch_advance_tick,
    launch_plan_demand,
    launch_plan_prefetch,
)

log = logging.getLogger("colibri.worker.cuda")
# each of experts.cache.DEVICE_POLICIES (the names the backend builder accepts) -> the slot-map kernel's argument
POLICY_ARGUMENTS = {"lru": POLICY_LRU, "lfu": POLICY_LFU}
STATS_TWINS = 2  # a step may be launched before the one ahead of it is collected: one host copy each


def _filled(shape, value, dtype, stream):
    array = cuda.device_array(shape, dtype, stream=stream)
    array.copy_to_device(np.full(shape, value, dtype), stream=stream)
    return array


class DeviceSlots:
    """Slots [layer] = [S, stride] (the layer's expert stride: a mixed model's layers differ) in the weights'
    dtype, or uint8 bytes for 8-bit / mixed experts (DeviceWeights.quantized: the kernels find each expert's
    dtype and tensors in its meta row, indexed by expert id); the mapped host experts; the slot map's state."""

    def __init__(self, weights, moe_layers: list[int], slots_per_layer: int, max_ids: int, policy: str, stream):
        if policy not in POLICY_ARGUMENTS:
            raise ValueError(
                f"expert_cache_policy {policy!r} has no device implementation ({sorted(POLICY_ARGUMENTS)})"
            )
        cfg = weights.config
        self.moe_layers, self.policy = list(moe_layers), POLICY_ARGUMENTS[policy]
        self.index = {layer: m for m, layer in enumerate(self.moe_layers)}
        L, E, S = len(self.moe_layers), cfg.num_experts, slots_per_layer
        check_layer_size(E, S)  # at start-up, not at the first step's plan
        self.num_experts, self.slots_per_layer = E, S
        # whole blocks at the layer's stride, as the experts file holds them: any expert dtype copies unchanged
        self.block_bytes = [weights.model.expert_strides[layer] for layer in self.moe_layers]
        self.can_pipeline = S >= 2  # pipelined waves hold S // 2 experts each (slot_map_reference.wave_capacity)
        self.max_waves = waves_needed(max_ids, E, S, self.can_pipeline)
        unit = np.dtype(np.uint8) if weights.quantized else np.dtype(weights.dtype)
        raw = [cuda.device_array(S * b, np.uint8, stream=stream) for b in self.block_bytes]
        self.words = [r.view(np.uint32) for r in raw]  # what the fetch kernel writes
        # what the expert kernels read: [S, stride] elements of the dense dtype, or bytes
        self.buffers = [r.view(unit).reshape(S, b // unit.itemsize) for r, b in zip(raw, self.block_bytes)]
        self._staged: list[np.ndarray] = []  # mapped pinned copies (the fallback), kept alive
        self.sources = [self._source(weights, layer) for layer in self.moe_layers]
        i32, W = np.int32, self.max_waves
        self.slot_of = _filled((L, E), -1, i32, stream)
        self.expert_in = _filled((L, S), -1, i32, stream)
        self.stamp = _filled((L, S), 0, i32, stream)
        self.prefetched = _filled((L, S), 0, i32, stream)
        self.busy = _filled((L, S), -1, i32, stream)
        self.mark = _filled((L, E), 0, i32, stream)
        self.pf_mark = _filled((L, E), 0, i32, stream)  # the prefetch's scratch: it runs on the side stream
        self.stats = _filled((L, 4), 0, np.int64, stream)
        self.freq = _filled((L, E + 1), 0, i32, stream)  # lfu's counts (slot_map_reference)
        self.tick = _filled((1,), 0, i32, stream)
        self.wave_map = _filled((L, W, E), -1, i32, stream)
        self.fetch_expert = _filled((L, W, S), 0, i32, stream)
        self.fetch_slot = _filled((L, W, S), 0, i32, stream)
        self.fetch_count = _filled((L, W), 0, i32, stream)
        self.pf_expert = _filled((L, S), 0, i32, stream)
        self.pf_slot = _filled((L, S), 0, i32, stream)
        self.pf_count = _filled((L, 1), 0, i32, stream)
        # demand copies' CTAs now copying: prefetch copies wait while it is above 0 (kernels/expert_fetch.py)
        self.demand_copies = _filled((1,), 0, i32, stream)
        self.prefetch_yields = True  # CudaOptions.prefetch_yields of the pass being launched (set by start_pass)
        self.host_stats = cuda.pinned_array((STATS_TWINS, L, 4), np.int64)
        self.host_stats[:] = 0
        self._totals = np.zeros((L, 4), np.int64)

    def _source(self, weights, layer: int):
        """The layer's experts [E * words] uint32 as the device reads them: the mapped mmap, or a mapped copy."""
        host = weights.expert_host[layer]
        if weights.expert_pinned[layer]:
            desc = {"shape": (host.nbytes // 4,), "typestr": "<u4", "data": (mapped_address(host), True), "version": 3}
            return cuda.from_cuda_array_interface(desc, owner=host, sync=False)
        if not self._staged:
            log.warning(
                "expert files could not be page-locked and mapped: holding a mapped pinned host copy of the "
                "experts (%.2f GiB of host memory)",
                len(self.moe_layers) * host.nbytes / 2**30,
            )
        staged = cuda.mapped_array(host.nbytes // 4, dtype=np.uint32)  # numba's mapped arrays cannot change dtype
        np.asarray(staged).view(np.uint8)[:] = host
        self._staged.append(staged)
        return staged

    @property
    def nbytes(self) -> int:
        state = (self.slot_of, self.expert_in, self.stamp, self.freq, self.wave_map, self.fetch_expert, self.fetch_slot)
        return sum(b.nbytes for b in self.buffers) + sum(a.nbytes for a in state)

    def weights_of(self, layer: int):
        """The layer's slot buffer [slots, stride] (the expert kernels read it through a wave's slot map)."""
        return self.buffers[self.index[layer]]

    def waves(self, num_ids: int, pipelined: bool = False) -> int:
        """Waves a layer of num_ids routed ids is planned in (a captured step launches all of them)."""
        return waves_needed(num_ids, self.num_experts, self.slots_per_layer, pipelined)

    # --- launches (eager or captured alike) ----------------------------------------------------------
    def advance(self, stream) -> None:
        """A new step: the LRU clock ticks (predictions of this step protect the slots they stamp)."""
        launch_advance_tick(self.tick, stream=stream)

    def plan(self, layer: int, ids, waves: int, stream, pipelined: bool = False) -> None:
        """The layer's waves for the step routed to ids [n] (the first `waves` rows of wave_map / fetch lists);
        pipelined: waves of half the slots, whose copies leave the previous wave's slots alone."""
        m = self.index[layer]
        launch_plan_demand(
            ids,
            self.tick,
            self.slot_of[m],
            self.expert_in[m],
            self.stamp[m],
            self.prefetched[m],
            self.busy[m],
            self.mark[m],
            self.wave_map[m, :waves],
            self.fetch_expert[m, :waves],
            self.fetch_slot[m, :waves],
            self.fetch_count[m, :waves],
            self.stats[m],
            self.freq[m],
            stream=stream,
            policy=self.policy,
            pipelined=pipelined,
        )

    def fetch(self, layer: int, wave: int, stream) -> None:
        """The copies wave `wave` needs before its kernels read the slots."""
        m = self.index[layer]
        launch_expert_fetch(
            self.sources[m],
            self.words[m],
            self.fetch_expert[m, wave],
            self.fetch_slot[m, wave],
            self.fetch_count[m, wave : wave + 1],
            self.block_bytes[m],
            stream=stream,
            active=self.demand_copies if self.prefetch_yields else None,
        )

    def wave_slots(self, layer: int, wave: int):
        """slot_of [E] of the experts wave `wave` computes (-1: not in it), for the grouped kernels."""
        return self.wave_map[self.index[layer], wave]

    def prefetch(self, layer: int, predicted_a, predicted_b, stream) -> None:
        """Predicted ids [na], [nb] of the layer (-1: none) into free, unprotected slots, copied at once."""
        m = self.index[layer]
        launch_plan_prefetch(
            predicted_a,
            predicted_b,
            self.tick,
            self.slot_of[m],
            self.expert_in[m],
            self.stamp[m],
            self.prefetched[m],
            self.pf_mark[m],
            self.pf_expert[m],
            self.pf_slot[m],
            self.pf_count[m],
            self.stats[m],
            self.freq[m],
            stream=stream,
            policy=self.policy,
        )
        launch_expert_fetch(
            self.sources[m],
            self.words[m],
            self.pf_expert[m],
            self.pf_slot[m],
            self.pf_count[m],
            self.block_bytes[m],
            stream=stream,
            active=self.demand_copies if self.prefetch_yields else None,
            speculative=True,
        )

    # --- counters ------------------------------------------------------------------------------------
    def download_stats(self, twin: int, stream) -> None:
        """The running counters to host copy `twin`, behind the step on the stream."""
        self.stats.copy_to_host(self.host_stats[twin], stream=stream)

    def step_stats(self, twin: int) -> CacheStats:
        """The counts of the step whose counters landed in copy `twin` (steps are collected in launch order)."""
        now = np.array(self.host_stats[twin])
        per_layer, self._totals = now - self._totals, now
        copies = per_layer[:, MISSES] + per_layer[:, PREFETCHES_ISSUED]
        delta = per_layer.sum(axis=0)
        return CacheStats(
            hits=int(delta[HITS]),
            misses=int(delta[MISSES]),
            bytes_copied=int(copies @ np.array(self.block_bytes, np.int64)),  # each copy moves its layer's stride
            prefetches_issued=int(delta[PREFETCHES_ISSUED]),
            prefetches_used=int(delta[PREFETCHES_USED]),
        )

    def close(self) -> None:
        self._staged.clear()
