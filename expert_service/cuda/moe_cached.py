"""The expert cache's side of the MoE block on the cuda backend (`CachedExperts`): the CACHED_GEMV / CACHED_GROUPED /
CACHED_CUBLAS strategies that cuda/moe.py's DeviceMoe hands a layer to when not every expert is resident, and the prefetch.

A layer, all on the device: router -> top-k -> grouping as on the resident path; the slot-map kernel turns the
step's routed ids into waves of at most `slots` experts and the copies each needs (cuda/expert_slots.py); per
wave the fetch kernel copies the misses from mapped host memory, then the grouped kernels read the wave's
experts through its slot map (experts outside the wave skipped, their rows left for another wave). A captured
step launches every wave a step of its size can need; waves with nothing to do return at once.
Pipelined waves (CudaOptions.pipelined_waves, two slots a layer at least): waves of half the slots, whose copies
run on a copy stream one wave ahead (wave w + 1's copies while wave w computes; the plan keeps them out of wave
w's slots), so a batch whose union exceeds the slots streams its misses with the kernels hidden behind them.
CACHED_GEMV (CudaOptions.cached_gemv): a one-token step whose K experts fit the slots is always one wave, so it
skips the grouping and runs the resident one-token kernels on the slot buffer (`_gemv`): the GEMV expert kernels
on the slots wave 0's map gives its ids, or moe_q8 by slot on 8-bit layers. The grouped kernels' grid of E
experts, mostly returning at once, is what a decode step paid for there.

Prefetch never shares a stream with demand copies (so demand copies never queue behind speculative ones), and
each layer's prefetch is joined before that layer's own plan. The routing plan names every layer's experts before
the step runs (looked up on the device from the pass's own input tokens when the worker has the table,
kernels/table_hints.py; else the router's, staged by stage_hints), so its copies are all issued when the step
starts, layer after layer on a plan stream: a layer's
predicted experts arrive while the layers before it compute, not only behind the layer before. Lookahead, the next
layer's router applied to this layer's input (its top-k on the device), is known one layer ahead only: it runs on a
side stream forked after the layer's first wave of demand copies, behind that next layer's plan copies (both
update the next layer's slot map), and fills the slots the plan left unprotected. Only passes whose tokens' experts
fit the slots prefetch (SlotPlan.step_prefetches; EngineConfig.prefetch_large_steps for every pass).
Steps above GROUPED_MAX_TOKENS (CACHED_CUBLAS; with CudaOptions.cached_mma_large on layers whose waves run on a
tensor-core kernel they take the grouped waves too) read the waves and expert offsets back at a host break and run two cuBLAS GEMMs per expert on
its slot, as the resident per-expert path does; they take no prefetch.

8-bit and mixed-dtype experts (DeviceWeights.quantized): slots hold the blocks' bytes as stored (weights and
float32 scales), and each expert's dtype, scale scheme and tensor offsets stay in the layer's meta table indexed by
expert id (an expert's block layout is the same in any slot): the grouped steps run moe_q8 through the wave's
slot map, or, when every expert is int8 / fp8, the 8-bit tensor-core kernel (moe_gemm_q8mma: each tile's bytes
from its slot, its meta by expert id; CudaOptions.cached_mma, and cached_mma_large for steps of any size), and
CACHED_CUBLAS dequantises each expert from its slot into a dense scratch before its GEMMs.
"""

from __future__ import annotations

import functools

import numpy as np
from cuda.bindings import driver as drv
from numba import cuda

from common.model_config import ModelConfig
from expert_service.cuda.driver import Event, check, non_blocking_stream, stream_handle
from expert_service.cuda.expert_slots import DeviceSlots
from expert_service.cuda.linear import DeviceLinear
from expert_service.cuda.moe_grouped_mma import cached_mma_possible, q8_mma_applies
from expert_service.cuda.weights import DeviceWeights
from expert_service.engine.config import PrefetchSource
from expert_service.experts.cache import CacheStats
from expert_service.experts.slots import SlotPlan
from expert_service.kernels.dequant_experts import launch_dequant_experts
from expert_service.kernels.expert_grouping import launch_expert_grouping
from expert_service.kernels.expert_slot_ids import launch_expert_slot_ids
from expert_service.kernels.gate_topk import launch_gate_topk
from expert_service.kernels.gather import launch_gather_rows
from expert_service.kernels.gemv import launch_expert_down, launch_expert_gate_up
from expert_service.kernels.moe_align import MAX_ASSIGNMENTS as ALIGN_MAX_ASSIGNMENTS
from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_ffn import GROUPED_MAX_TOKENS, launch_moe_down, launch_moe_gate_up
from expert_service.kernels.moe_gemm_mma import (
    COMBINE_STORE,
    Config,
    choose_config,
    launch_moe_gemm_down,
    launch_moe_gemm_gate_up,
)
from expert_service.kernels.moe_gemm_q8mma import choose_config as choose_q8_config
from expert_service.kernels.moe_gemm_q8mma import launch_q8mma_down, launch_q8mma_gate_up
from expert_service.kernels.moe_q8 import launch_q8_down, launch_q8_gate_up
from expert_service.kernels.moe_q8_dp4a import launch_dp4a_down, launch_dp4a_gate_up
from expert_service.kernels.table_hints import launch_table_hints
from expert_service.kernels.tile_slots import launch_tile_slots

HINT_TWINS = 2  # the plan's ids are staged per step; two steps may be in flight


def dense_scratch_needed(quantized: bool, max_tokens: int, largest_grouped: int) -> bool:
    """Whether CachedExperts holds CACHED_CUBLAS's one-expert dense scratch: 8-bit experts and steps larger than
    the largest one its grouped waves take."""
    return quantized and max_tokens > largest_grouped


class CachedExperts:
    """The expert cache on the device: slots and slot map (DeviceSlots), the CACHED_* strategies and the
    prefetch. The decoder stages each step's plan (`stage_hints`), the pass starts with `start_pass`, the
    counters come back with `download_stats` / `step_stats`."""

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
        host_break=None,
        plan_table: np.ndarray | None = None,
        largest_grouped: int = GROUPED_MAX_TOKENS,
        prefetch_large_steps: bool = False,
    ):
        cfg = config
        self.config, self.weights, self.ws, self.linear, self.stream = cfg, weights, workspace, linear, stream
        self.prefetch = prefetch
        self.slot_plan, self.prefetch_large_steps = slot_plan, prefetch_large_steps
        self._prefetching = False  # the pass being launched prefetches (start_pass: SlotPlan.step_prefetches)
        self.host_break = host_break if host_break is not None else (lambda resume: resume())
        moe = cfg.moe_layers
        self.moe_layers = moe
        E, K, T = cfg.num_experts, cfg.num_experts_per_tok, max_tokens
        self.slots = DeviceSlots(weights, moe, slot_plan.slots_per_layer, T * K, policy, stream)
        self.next_moe = {i: next((j for j in moe if j > i), None) for i in range(cfg.num_hidden_layers)}
        st = stream
        self._main = stream_handle(stream)
        self._side_handle, self.side = non_blocking_stream()  # lookahead prefetch
        self._plan_handle, self.plan_stream = non_blocking_stream()  # the routing plan's prefetch, issued at the start
        self._copy_handle, self.copy = non_blocking_stream()  # pipelined waves' demand copies
        self._fork = Event()
        W = self.slots.max_waves
        self._fetched = [Event() for _ in range(W)]  # pipelined wave w's copies are done
        self._computed = [Event() for _ in range(W)]  # pipelined wave w's kernels are done
        self._joined = {layer: Event() for layer in moe}  # the layer's lookahead copies are done
        self._plan_joined = {layer: Event() for layer in moe}  # the layer's plan copies are done
        self._pending: set[int] = set()  # layers with a lookahead prefetch not yet joined (while issuing a pass)
        self._plan_pending: set[int] = set()  # ... with a plan prefetch not yet joined
        self.ahead_logits = cuda.device_array((T, E), np.float32, stream=st)
        # two buffers, by the predicted layer's MoE index: layer L+1's lookahead copy may still wait for L+1's plan
        # copies on the side stream while the compute stream writes layer L+2's ids (it joins L+1's copies only after)
        self.ahead_ids = cuda.device_array((2, T, K), np.int32, stream=st)
        self.ahead_weights = cuda.device_array((T, K), np.float32, stream=st)
        self.no_ids = cuda.to_device(np.full(1, -1, np.int32), stream=st)
        self.slot_ids = cuda.to_device(np.full((1, K), -1, np.int32), stream=st)  # CACHED_GEMV's experts' slots
        L = max(len(moe), 1)
        # the plan prefetch's table on the device ([L, V, k] uint16): each pass looks its own tokens up
        # (start_pass), so no plan comes from the host; None: the router's plans, staged by stage_hints. A table
        # may predict more experts a token than the model routes to (more prefetched bytes for more recall).
        self.plan_table = None
        if plan_table is not None and PrefetchSource.PLAN in prefetch:
            self.plan_table = cuda.to_device(np.ascontiguousarray(plan_table, dtype=np.uint16), stream=st)
        self.hint_width = max(K, self.plan_table.shape[2]) if self.plan_table is not None else K  # ids a token
        self.hint_ids = cuda.to_device(np.full((L, T * self.hint_width), -1, np.int32), stream=st)
        self.host_hints = cuda.pinned_array((HINT_TWINS, L, T * K), np.int32)
        self._hints_clear = True  # hint_ids holds no plan (all -1)
        self.host_waves = cuda.pinned_array((W, E), np.int32)  # CACHED_CUBLAS's readback
        self.host_offsets = cuda.pinned_array(E + 1, np.int32)
        self.quantized = weights.quantized
        # the tensor-core waves (CudaOptions.cached_mma): bf16 layers, or every expert 8-bit (moe_gemm_q8mma), and
        # their rows in the workspace (laid out with the option on)
        q8 = q8_mma_applies(cfg, weights.all_8bit, np.dtype(weights.dtype) == np.uint16)
        self.mma_supported = cached_mma_possible(weights.dtype, weights.quantized, E, q8)
        self.mma_possible = self.mma_supported and "mma_tile_slot" in workspace.arrays
        # CACHED_CUBLAS on 8-bit experts: one expert dequantised for its GEMMs (3 x F x D in the dense dtype, 336 MiB
        # on mixtral-shape), only where a step can take it: above largest_grouped (cached_grouped_tokens of the
        # options the decoder was laid out with; the 8-bit tensor-core waves take every step an engine can run)
        self.dense = self.one_expert = None
        if dense_scratch_needed(self.quantized, T, largest_grouped):
            self.make_dense_scratch()

    def make_dense_scratch(self) -> None:
        """CACHED_CUBLAS's one-expert dense scratch for 8-bit experts, once (at start-up where the configured options
        reach it, else when CudaDecoder.set_options turns to options that do: never inside a step)."""
        if self.dense is None:
            cfg = self.config
            F, D = cfg.moe_intermediate_size, cfg.hidden_size
            self.dense = cuda.device_array((1, 3 * F * D), self.weights.dtype, stream=self.stream)
            self.one_expert = cuda.to_device(np.array([0, 1], np.int32), stream=self.stream)  # dequant's offsets

    @property
    def nbytes(self) -> int:
        dense = self.dense.nbytes if self.dense is not None else 0
        small = self.hint_ids.nbytes + self.slot_ids.nbytes
        small += self.plan_table.nbytes if self.plan_table is not None else 0
        return (
            self.slots.nbytes
            + self.ahead_logits.nbytes
            + self.ahead_ids.nbytes
            + self.ahead_weights.nbytes
            + small
            + dense
        )

    # --- step boundaries ----------------------------------------------------------------------------
    @property
    def reads_router_plans(self) -> bool:
        """Whether passes prefetch from the router's plans (plan prefetch on, no table of its own on the device)."""
        return self.plan_table is None and PrefetchSource.PLAN in self.prefetch

    def _fits_prefetch(self, T: int) -> bool:
        """Whether a pass of T (bucket) tokens prefetches: SlotPlan.step_prefetches under this engine's setting."""
        return self.slot_plan.step_prefetches(T, self.config.num_experts_per_tok, self.prefetch_large_steps)

    def stage_hints(self, hints: dict[int, np.ndarray] | None, twin: int, T: int) -> None:
        """The step's routing plan (layer -> [T, k] ids) to the device before its pass of T (bucket) tokens,
        outside any graph, on the compute stream; with plan prefetch off, or no plan, the device keeps (or gets)
        none. With the table on the device the pass looks its plan up itself (start_pass) and the router's is not
        needed; a pass too large to prefetch (SlotPlan.step_prefetches) never reads it, so it costs no host time."""
        if not self.reads_router_plans or (not hints and self._hints_clear) or not self._fits_prefetch(T):
            return
        host = self.host_hints[twin]
        host[:] = -1
        width = host.shape[1]
        for m, layer in enumerate(self.moe_layers):
            ids = np.asarray(hints.get(layer, ()) if hints else (), np.int32)
            # each token's first hint_width ids (a router told Info.plan_width sends no more), never whole tokens;
            # from an older router's wider plan those are its lowest-numbered experts (the plan carries no rank)
            ids = (ids[:, : self.hint_width] if ids.ndim == 2 else ids).reshape(-1)[:width]
            host[m, : ids.size] = ids
        self.hint_ids.copy_to_device(host, stream=self.stream)
        self._hints_clear = not hints

    def start_pass(self, T: int, large: bool, prefetch_yields: bool = True) -> None:
        """Issued at the start of a pass of T tokens: the clock ticks, and every MoE layer's plan is prefetched,
        in layer order on the plan stream (large: a CACHED_CUBLAS step, which takes no prefetch; nor does a pass
        whose tokens may route to more experts than the slots, unless prefetch_large_steps). With the table
        on the device the plan is first looked up from the pass's own input tokens (fed decodes included).
        prefetch_yields: the pass's prefetch copies wait for its demand copies (CudaOptions.prefetch_yields)."""
        self.slots.prefetch_yields = prefetch_yields
        # a pass that raised can leave layers pending: their events belong to it (maybe to a failed capture), and
        # this pass's own forks on those streams come after that work anyway (each stream runs in order)
        self._pending.clear()
        self._plan_pending.clear()
        self.slots.advance(self.stream)
        # a static choice per token bucket, so a captured pass replays it (T is the bucket: its padding routes too)
        self._prefetching = not large and self._fits_prefetch(T)
        if not self.moe_layers or not self._prefetching or PrefetchSource.PLAN not in self.prefetch:
            return
        if self.plan_table is not None:
            ws = self.ws
            launch_table_hints(
                ws.token_ids[:T],
                ws.feed_rows[:T],
                ws.greedy_ids,
                ws.slot_mapping[:T],
                self.plan_table,
                self.hint_ids,
                self.hint_width,
                stream=self.stream,
            )
        self._fork_onto(self._plan_handle)  # after the tick, and after the step before finished with every slot
        for layer in self.moe_layers:
            self.slots.prefetch(layer, self._hints(layer, T), self.no_ids, self.plan_stream)
            self._plan_joined[layer].record(self._plan_handle)
            self._plan_pending.add(layer)

    def download_stats(self, twin: int) -> None:
        self.slots.download_stats(twin, self.stream)

    def step_stats(self, twin: int) -> CacheStats:
        """The step's counts, once its readback landed (stall is not measured: the host never waits on copies)."""
        return self.slots.step_stats(twin)

    def settle_totals(self) -> None:
        """Steps run outside launch/finish (warm-up) count towards no step: the running totals move past them."""
        self.download_stats(0)
        self.stream.synchronize()
        self.step_stats(0)

    # --- the routed experts of a MoE layer ----------------------------------------------------------
    def _hints(self, layer: int, T: int):
        return self.hint_ids[self.slots.index[layer], : T * self.hint_width]

    def run(
        self,
        i: int,
        x,
        h,
        T: int,
        ids,
        weights,
        large: bool,
        combine=None,
        gemv: bool = False,
        pipelined: bool = False,
        mma: bool = False,
        int8_activations: bool = False,
        layout: tuple[int, ...] | None = None,
    ) -> None:
        """x [T, D] normed input, h [T, D] residual (updated), ids/weights [T, K]: layer i's top-k on the device;
        large: per-expert cuBLAS GEMMs at a host break; gemv: CACHED_GEMV (one token whose K experts fit the
        slots: one wave, `_gemv`); else the grouped kernels in waves, pipelined (CudaOptions.pipelined_waves,
        two slots a layer at least) or in turn, each wave on moe_ffn or, mma (CudaOptions.cached_mma, bf16 layers),
        on the tensor-core grouped kernel; combine: DeviceMoe's (None: launch_moe_combine); int8_activations:
        CACHED_GEMV on a layer wholly int8 per channel runs moe_q8_dp4a (DeviceMoe.int8_activations); layout: the
        meta row every expert of an 8-bit layer shares, for the moe_q8 launches (DeviceMoe.layout)."""
        cfg, ws, st = self.config, self.ws, self.stream
        K = cfg.num_experts_per_tok
        n = T * K
        order, position, out = ws.order[:n], ws.position[:n], ws.moe_out[:n]
        tiling = None  # the tensor-core waves' (tile config, tiles), decided once for the layer's waves
        if mma and self.mma_possible and not (large or gemv) and n <= ALIGN_MAX_ASSIGNMENTS:
            tiling = self._align(x, ids, n)  # sorted into tiles once; each wave computes its experts' tiles
            position = ws.identity_position[:n]  # y rows in assignment order
        elif not gemv:  # the GEMV kernels take the ids as routed: no grouping
            launch_expert_grouping(ids, ws.counts, ws.offsets, order, position, stream=st)
        ahead = self.next_moe[i]
        lookahead = ahead is not None and PrefetchSource.LOOKAHEAD in self.prefetch and self._prefetching and not large
        if lookahead and ahead is not None:  # the next layer's router on this layer's input
            self.linear.linear(x, self.weights.layer(ahead, "router"), self.ahead_logits[:T])
            launch_gate_topk(
                self.ahead_logits[:T], self._ahead_ids(ahead, T), self.ahead_weights[:T], cfg.norm_topk_prob, stream=st
            )
        self._join(i)
        pipelined = pipelined and self.slots.can_pipeline and not (large or gemv)
        waves = self.slots.waves(n, pipelined)
        self.slots.plan(i, ids.reshape(n), waves, st, pipelined)
        buffer = self.slots.weights_of(i)
        if large:
            launch_gather_rows(x, order, ws.moe_in[:n], divisor=K, stream=st)
            self.slots.wave_map[self.slots.index[i], :waves].copy_to_host(self.host_waves[:waves], stream=st)
            ws.offsets.copy_to_host(self.host_offsets, stream=st)
            self.host_break(functools.partial(self._cublas_waves, i, n, waves, buffer))
        elif gemv:
            assert waves == 1, "CACHED_GEMV needs the step's experts in one wave"  # choose_strategy: T*K <= slots
            self._first_wave(i, T, ahead, lookahead)
            self._gemv(i, x, ids, buffer, out, int8_activations, layout)
            position = ws.identity_position[:n]  # out rows in the token's top-k order
        elif pipelined:
            self._pipelined_waves(i, T, x, buffer, waves, ahead, lookahead, tiling, layout)
        else:
            for w in range(waves):
                if w == 0:
                    self._first_wave(i, T, ahead, lookahead)
                else:
                    self.slots.fetch(i, w, st)
                self._wave(i, w, T, x, buffer, tiling, layout)
        if combine is None:
            launch_moe_combine(out, position, weights, h, stream=st)
        else:
            combine(out, position, weights, h)

    def _align(self, x, ids, n: int) -> tuple[Config, int]:
        """The tensor-core waves' shared part: the step's assignments sorted into tiles by expert (moe_align) and
        their rows gathered in bf16, once per layer. Returns the tile config and tile count every wave uses."""
        ws, st, E = self.ws, self.stream, self.config.num_experts
        config = choose_q8_config(n, E) if self.quantized else choose_config(n, E)
        bm = config.block_m
        tiles = max_tiles(n, E, bm)
        sorted_ids, tile_expert = ws.mma_sorted_ids[: tiles * bm], ws.mma_tile_expert[:tiles]
        launch_moe_align(ids, E, bm, sorted_ids, tile_expert, ws.mma_num_tiles, ws.position[:n], stream=st)
        launch_moe_gather_bf16(x, sorted_ids, ws.mma_num_tiles, ids.shape[1], bm, ws.mma_xs[: tiles * bm], stream=st)
        return config, tiles

    def _mma_wave(self, i: int, slot_of, n: int, buffer, tiling: tuple[Config, int]) -> None:
        """Wave's tiles on the tensor-core grouped kernel: their slots (tile_slots: -1 for other waves' tiles,
        which the kernels skip), then gate|up and down from the slot buffer, y stored in assignment order. 8-bit
        layers: moe_gemm_q8mma, each tile's bytes from its slot and its meta row by expert id."""
        cfg, ws, st = self.config, self.ws, self.stream
        F, D = cfg.moe_intermediate_size, cfg.hidden_size
        config, tiles = tiling
        rows = tiles * config.block_m
        tile_expert, tile_slot, num_tiles = ws.mma_tile_expert[:tiles], ws.mma_tile_slot[:tiles], ws.mma_num_tiles
        xs, h, sorted_ids, out = ws.mma_xs[:rows], ws.mma_h[:rows], ws.mma_sorted_ids[:rows], ws.moe_out[:n]
        launch_tile_slots(tile_expert, num_tiles, slot_of, tile_slot, stream=st)
        if self.quantized:
            meta, q8 = self.weights.expert_meta[i], dict(config=config, stream=st, tile_slot=tile_slot)
            launch_q8mma_gate_up(xs, tile_expert, num_tiles, buffer, meta, F, D, h, **q8)
            launch_q8mma_down(h, tile_expert, num_tiles, sorted_ids, buffer, meta, F, D, out, **q8)
            return
        launch_moe_gemm_gate_up(xs, tile_slot, num_tiles, buffer, F, D, h, config=config, stream=st)
        launch_moe_gemm_down(
            h, tile_slot, num_tiles, sorted_ids, buffer, F, D, out, combine=COMBINE_STORE, config=config, stream=st
        )

    def _wave(self, i: int, w: int, T: int, x, buffer, tiling: tuple[Config, int] | None = None, layout=None) -> None:
        """The grouped kernels of wave w on the compute stream: the wave's experts read through its slot map into
        moe_out (rows of experts outside the wave untouched); tiling (from `_align`): on the tensor-core kernel
        (`_mma_wave`)."""
        cfg, ws, st = self.config, self.ws, self.stream
        F, D, n = cfg.moe_intermediate_size, cfg.hidden_size, T * cfg.num_experts_per_tok
        order, out, gate = ws.order[:n], ws.moe_out[:n], ws.moe_gate[:n]
        slot_of = self.slots.wave_slots(i, w)
        if tiling is not None:
            self._mma_wave(i, slot_of, n, buffer, tiling)
            return
        if self.quantized:
            meta, kinds = self.weights.expert_meta[i], self.weights.expert_kinds[i]
            q8 = dict(offsets=ws.offsets, stream=st, slot_of=slot_of, kinds=kinds, layout=layout)
            launch_q8_gate_up(x, buffer, meta, F, D, gate, order=order, **q8)
            launch_q8_down(gate, buffer, meta, F, D, out, **q8)
            return
        launch_moe_gate_up(x, order, ws.offsets, buffer, F, D, gate, stream=st, slot_of=slot_of)
        launch_moe_down(gate, order, ws.offsets, buffer, F, D, out, stream=st, slot_of=slot_of)

    def _pipelined_waves(
        self,
        i: int,
        T: int,
        x,
        buffer,
        waves: int,
        ahead: int | None,
        lookahead: bool,
        tiling: tuple[Config, int] | None = None,
        layout: tuple[int, ...] | None = None,
    ) -> None:
        """The waves with their copies on the copy stream, one wave ahead: wave w + 1's copies (into slots no wave
        from w on reads: the plan's pipelined rule) run while wave w computes, once wave w - 1's kernels, the last
        to read the slots they fill, are done. The compute stream waits for each wave's copies; the last wave's
        wait joins the copy stream back (a capture must end joined)."""
        copy, main = self._copy_handle, self._main
        self._fork_onto(copy)  # the layer's plan is done: its copies may start
        self.slots.fetch(i, 0, self.copy)
        self._fetched[0].record(copy)
        self._prefetch_ahead(i, T, ahead, lookahead, after=self._fetched[0])
        for w in range(waves):
            if w + 1 < waves:
                if w:
                    check(drv.cuStreamWaitEvent(copy, self._computed[w - 1].handle, 0))
                self.slots.fetch(i, w + 1, self.copy)
                self._fetched[w + 1].record(copy)
            check(drv.cuStreamWaitEvent(main, self._fetched[w].handle, 0))
            self._wave(i, w, T, x, buffer, tiling, layout)
            self._computed[w].record(main)

    def _first_wave(self, i: int, T: int, ahead: int | None, lookahead: bool) -> None:
        """Wave 0's copies, then the next MoE layer's prefetch forks (behind the demand copies, never ahead)."""
        self.slots.fetch(i, 0, self.stream)
        self._prefetch_ahead(i, T, ahead, lookahead)

    def _prefetch_ahead(self, i: int, T: int, ahead: int | None, lookahead: bool, after: Event | None = None) -> None:
        """The next MoE layer's lookahead prefetch, forked after what the compute stream has issued (and after
        `after`: wave 0's copies on the copy stream)."""
        if ahead is None or not lookahead:
            return
        n = T * self.config.num_experts_per_tok
        self._prefetch(ahead, self._ahead_ids(ahead, T).reshape(n), self.no_ids, after)

    def _ahead_ids(self, layer: int, T: int):
        """The lookahead's top-k ids [T, K] predicted for MoE layer `layer` (its buffer alternates by MoE index)."""
        return self.ahead_ids[self.slots.index[layer] % 2, :T]

    def _gemv(self, i: int, x, ids, buffer, out, int8_activations: bool = False, layout=None) -> None:
        """CACHED_GEMV, after wave 0's copies: the resident one-token kernels on the slot buffer [S, stride], each
        expert read from the slot wave 0's map gives it. The map, not slot_of: it is this step's plan output, the
        same contract the grouped kernels read (equal to slot_of here, the whole union being in wave 0). Dense:
        slot ids [1, K] (expert_slot_ids), then the GEMV expert kernels with them as ids; 8-bit / mixed: moe_q8
        by slot, which reads ids[k]'s meta row and its slot through the map itself (int8_activations: moe_q8_dp4a,
        the same way, as the resident engine's one-token steps under q8_decode_activations)."""
        cfg, ws, st = self.config, self.ws, self.stream
        K, F, D = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
        wave0, gate = self.slots.wave_slots(i, 0), ws.moe_gate[:K]
        if int8_activations:
            meta, part_max = self.weights.expert_meta[i], ws.moe_gate_part_max[:K]
            launch_dp4a_gate_up(x, ids, buffer, meta, F, D, gate, part_max, stream=st, slot_of=wave0)
            launch_dp4a_down(gate, part_max, ids, buffer, meta, F, D, out, stream=st, slot_of=wave0)
            return
        if self.quantized:
            meta, kinds = self.weights.expert_meta[i], self.weights.expert_kinds[i]
            q8 = dict(ids=ids, stream=st, slot_of=wave0, kinds=kinds, layout=layout)
            launch_q8_gate_up(x, buffer, meta, F, D, gate, **q8)
            launch_q8_down(gate, buffer, meta, F, D, out, **q8)
            return
        launch_expert_slot_ids(ids.reshape(K), wave0, self.slot_ids.reshape(K), stream=st)
        launch_expert_gate_up(x, self.slot_ids, buffer, F, D, gate, stream=st)
        launch_expert_down(gate, self.slot_ids, buffer, F, D, out, stream=st)

    def _prefetch(self, layer: int, predicted_a, predicted_b, after: Event | None = None) -> None:
        """The prefetch of `layer` on the side stream, after everything issued so far on the compute stream, after
        the layer's plan copies (they update the same slot map), and after the event `after`."""
        self._fork_onto(self._side_handle)
        if layer in self._plan_pending:
            check(drv.cuStreamWaitEvent(self._side_handle, self._plan_joined[layer].handle, 0))
        if after is not None:
            check(drv.cuStreamWaitEvent(self._side_handle, after.handle, 0))
        self.slots.prefetch(layer, predicted_a, predicted_b, self.side)
        self._joined[layer].record(self._side_handle)
        self._pending.add(layer)

    def _fork_onto(self, handle) -> None:
        """The stream `handle` waits for everything issued so far on the compute stream."""
        self._fork.record(self._main)
        check(drv.cuStreamWaitEvent(handle, self._fork.handle, 0))

    def _join(self, layer: int) -> None:
        """The compute stream waits for the layer's prefetch copies (not for later layers' ones)."""
        for pending, done in ((self._plan_pending, self._plan_joined), (self._pending, self._joined)):
            if layer in pending:
                check(drv.cuStreamWaitEvent(self._main, done[layer].handle, 0))
                pending.discard(layer)

    def end_pass(self) -> None:
        """Every fork is joined before a pass ends (a capture must end with the side streams joined)."""
        for layer in list(self._plan_pending | self._pending):
            self._join(layer)

    def _cublas_waves(self, i: int, n: int, waves: int, buffer) -> None:
        """The host part of CACHED_CUBLAS once the waves and offsets are on their way: per wave its copies, then
        per expert of the wave two GEMMs on its slot over its gathered rows."""
        cfg = self.config
        F, D = cfg.moe_intermediate_size, cfg.hidden_size
        self.stream.synchronize()
        offsets, wave_map = self.host_offsets, self.host_waves
        for w in range(waves):
            self.slots.fetch(i, w, self.stream)
            for e in np.flatnonzero(wave_map[w] >= 0).tolist():
                lo, hi, slot = int(offsets[e]), int(offsets[e + 1]), int(wave_map[w, e])
                if hi <= lo:
                    continue
                block = buffer[slot]
                if self.quantized:  # 8-bit: widened into the scratch, read by the GEMMs after it (one stream)
                    assert self.dense is not None, "CACHED_CUBLAS on 8-bit experts without its scratch"
                    meta = self.weights.expert_meta[i][e : e + 1]
                    launch_dequant_experts(
                        buffer[slot : slot + 1], meta, self.one_expert, 0, F, D, self.dense, stream=self.stream
                    )
                    block = self.dense[0]
                self._expert_gemms(block, lo, hi, F, D, self.ws.moe_out[:n])

    def _expert_gemms(self, block, lo: int, hi: int, F: int, D: int, out) -> None:
        """One expert (its weight block [stride]) on the gathered rows moe_in[lo:hi] -> out[lo:hi], cuBLAS."""
        ws = self.ws
        gate, up = block[: F * D].reshape(F, D), block[F * D : 2 * F * D].reshape(F, D)
        down = block[2 * F * D : 3 * F * D].reshape(D, F)
        g = ws.moe_gate[lo:hi]
        self.linear.swiglu(ws.moe_in[lo:hi], gate, up, g, ws.moe_up[lo:hi], force_cublas=True)
        self.linear.linear(g, down, out[lo:hi], force_cublas=True)

    def close(self) -> None:
        handles = (self._side_handle, self._plan_handle, self._copy_handle)
        for handle in handles:
            check(drv.cuStreamSynchronize(handle))
        joined = [*self._joined.values(), *self._plan_joined.values()]
        for event in [self._fork, *self._fetched, *self._computed, *joined]:
            event.close()
        for handle in handles:
            check(drv.cuStreamDestroy(handle))
        self.slots.close()
