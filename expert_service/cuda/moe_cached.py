"""The expert cache's side of the MoE block on the cuda backend (`CachedExperts`): device slots per MoE layer,
their replacement and prefetch (expert_service.experts.cache.ExpertCache), and the CACHED_GROUPED / CACHED_CUBLAS
strategies that cuda/moe.py's DeviceMoe hands a layer to when not every expert is resident: the routed experts
run in waves over the slots, the grouped kernels or per-expert cuBLAS reading each expert's slot."""

from __future__ import annotations

import numpy as np
from numba import cuda

from common.model_config import ModelConfig
from expert_service.cuda.expert_slots import DeviceSlots
from expert_service.cuda.linear import DeviceLinear
from expert_service.cuda.weights import DeviceWeights
from expert_service.engine.config import PrefetchSource
from expert_service.experts.cache import CacheStats, ExpertCache
from expert_service.experts.grouping import experts_by_count
from expert_service.experts.slots import SlotPlan
from expert_service.kernels.expert_grouping import launch_expert_grouping
from expert_service.kernels.gate_topk import launch_gate_topk
from expert_service.kernels.gather import launch_gather_rows
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_ffn import launch_moe_down, launch_moe_gate_up


class CachedExperts:
    """The expert cache on the device: slots per MoE layer, their replacement and prefetch, and the CACHED_*
    strategies. The decoder drives the step boundaries (begin_step / prefetch_plan / end_step)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: DeviceWeights,
        workspace,
        linear: DeviceLinear,
        stream,
        max_tokens: int,
        slot_plan: SlotPlan,
        prefetch: frozenset[PrefetchSource],
        policy: str,
    ):
        cfg = config
        self.config, self.weights, self.ws, self.linear, self.stream = cfg, weights, workspace, linear, stream
        self.prefetch = prefetch
        moe = cfg.moe_layers
        S, E, K, T = slot_plan.slots_per_layer, cfg.num_experts, cfg.num_experts_per_tok, max_tokens
        self.slots = DeviceSlots(weights, moe, S, stream)
        self.cache = ExpertCache(moe, E, S, slot_plan.expert_block_bytes, self.slots, policy)
        self.next_moe = {i: next((j for j in moe if j > i), None) for i in range(cfg.num_hidden_layers)}
        self.max_waves = -(-E // S)
        st = stream
        self.slot_of = cuda.device_array((self.max_waves, E), np.int32, stream=st)
        self.ahead_logits = cuda.device_array((T, E), np.float32, stream=st)
        self.ahead_ids = cuda.device_array((T, K), np.int32, stream=st)
        self.ahead_weights = cuda.device_array((T, K), np.float32, stream=st)
        self.host = {
            "slot_of": cuda.pinned_array((self.max_waves, E), np.int32),
            "ids": cuda.pinned_array(T * K, np.int32),
            "ahead_ids": cuda.pinned_array(T * K, np.int32),
            "offsets": cuda.pinned_array(E + 1, np.int32),
        }
        self._hints: dict[int, np.ndarray] | None = None  # this step's expert hints (begin_step)

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes + self.slot_of.nbytes + self.ahead_logits.nbytes + 2 * self.ahead_ids.nbytes

    # --- step boundaries ----------------------------------------------------------------------------
    def begin_step(self, hints: dict[int, np.ndarray] | None) -> None:
        self.cache.begin_step()
        self._hints = hints
        moe = self.config.moe_layers
        if moe:  # the first MoE layer's plan: its copies overlap everything before it
            self.prefetch_plan(moe[0])

    def end_step(self) -> CacheStats:
        """After the step's final synchronisation: the measured stall joins the step's counts."""
        self.cache.add_stall(self.slots.stall_seconds())
        self._hints = None
        return self.cache.end_step()

    def prefetch_plan(self, layer: int | None) -> None:
        if layer is not None and PrefetchSource.PLAN in self.prefetch and self._hints and layer in self._hints:
            self.cache.prefetch(layer, experts_by_count(self._hints[layer]))

    # --- the routed experts of a MoE layer ----------------------------------------------------------
    def run(self, i: int, x, h, T: int, ids, weights, large: bool, combine=None) -> None:
        """x [T, D] normed input, h [T, D] residual (updated), ids/weights [T, K]: layer i's top-k on the device;
        large: per-expert cuBLAS GEMMs (their row ranges come to the host), else the grouped kernels;
        combine: DeviceMoe's combine (None: launch_moe_combine)."""
        cfg, ws, st = self.config, self.ws, self.stream
        K, F, D = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
        n = T * K
        order, position, out = ws.order[:n], ws.position[:n], ws.moe_out[:n]
        launch_expert_grouping(ids, ws.counts, ws.offsets, order, position, stream=st)
        ahead = self.next_moe[i] if PrefetchSource.LOOKAHEAD in self.prefetch else None
        if ahead is not None:
            self.linear.linear(x, self.weights.layer(ahead, "router"), self.ahead_logits[:T])
            launch_gate_topk(
                self.ahead_logits[:T], self.ahead_ids[:T], self.ahead_weights[:T], cfg.norm_topk_prob, stream=st
            )
            self.ahead_ids[:T].reshape(n).copy_to_host(self.host["ahead_ids"][:n], stream=st)
        ids.reshape(n).copy_to_host(self.host["ids"][:n], stream=st)
        if large:
            ws.offsets.copy_to_host(self.host["offsets"], stream=st)
        st.synchronize()
        if ahead is not None:
            self.cache.prefetch(ahead, experts_by_count(self.host["ahead_ids"][:n]))
        if large:
            launch_gather_rows(x, order, ws.moe_in[:n], divisor=K, stream=st)
        buffer = self.slots.weights_of(i)
        offsets = self.host["offsets"]
        for w, wave in enumerate(self.cache.waves(i, experts_by_count(self.host["ids"][:n]))):
            if large:
                for e, slot in wave.items():
                    self._expert_gemms(buffer[slot], int(offsets[e]), int(offsets[e + 1]), F, D, out)
            else:
                row = self.host["slot_of"][w]
                row[:] = -1
                for e, slot in wave.items():
                    row[e] = slot
                slot_of = self.slot_of[w]
                slot_of.copy_to_device(row, stream=st)
                launch_moe_gate_up(x, order, ws.offsets, buffer, F, D, ws.moe_gate[:n], stream=st, slot_of=slot_of)
                launch_moe_down(ws.moe_gate[:n], order, ws.offsets, buffer, F, D, out, stream=st, slot_of=slot_of)
            self.slots.used(i, wave.values())
        if combine is None:
            launch_moe_combine(out, position, weights, h, stream=st)
        else:
            combine(out, position, weights, h)

    def _expert_gemms(self, block, lo: int, hi: int, F: int, D: int, out) -> None:
        """One expert (its weight block [stride]) on the gathered rows moe_in[lo:hi] -> out[lo:hi], cuBLAS."""
        ws = self.ws
        gate, up = block[: F * D].reshape(F, D), block[F * D : 2 * F * D].reshape(F, D)
        down = block[2 * F * D : 3 * F * D].reshape(D, F)
        g = ws.moe_gate[lo:hi]
        self.linear.swiglu(ws.moe_in[lo:hi], gate, up, g, ws.moe_up[lo:hi], force_cublas=True)
        self.linear.linear(g, down, out[lo:hi], force_cublas=True)

    def close(self) -> None:
        self.slots.close()
