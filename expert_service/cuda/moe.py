"""The MoE block on the cuda backend: router -> top-k -> the routed experts -> the shared expert (`DeviceMoe`).

How a layer runs its routed experts (`MoeStrategy`) is decided by cuda/moe_strategy.py's `choose_strategy`;
`DeviceMoe.forward` runs the strategy it picks. The fused router and the combine that also writes the next
layer's input norm are CudaOptions (engine/cuda_options.py). What each strategy launches, and the H200
measurements behind the thresholds, are in docs/kernels.md, section "MoE strategy choice".
"""

from __future__ import annotations

import functools

import numpy as np

from common.model_config import ModelConfig
from expert_service.cuda.dequant_pipeline import HALVES, DequantPipeline
from expert_service.cuda.driver import device_address
from expert_service.cuda.linear import DeviceLinear
from expert_service.cuda.moe_cached import CachedExperts
from expert_service.cuda.moe_grouped_mma import W8A8Kind, run_grouped_mma, step_tile, takes_w8a8, w8a8_kind
from expert_service.cuda.moe_strategy import (
    MoeStrategy,
    cached_grouped_tokens,
    choose_strategy,
    fused_router,
    q8_mma_tokens,
    step_strategy,
    w8a8_everywhere,
)
from expert_service.cuda.weights import DeviceWeights
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels import elementwise
from expert_service.kernels.dequant_experts import DequantInto
from expert_service.kernels.expert_grouping import launch_expert_grouping
from expert_service.kernels.expert_quant import CODE_INT8, SCALE_CHANNEL
from expert_service.kernels.gate_fused import launch_gate_fused
from expert_service.kernels.gate_planned import launch_gate_planned
from expert_service.kernels.gate_topk import launch_gate_topk
from expert_service.kernels.gather import launch_gather_rows
from expert_service.kernels.gemv import launch_expert_down, launch_expert_gate_up
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_combine_dense import launch_moe_combine_dense
from expert_service.kernels.moe_combine_rmsnorm import launch_moe_combine_rmsnorm
from expert_service.kernels.moe_ffn import launch_moe_down, launch_moe_gate_up
from expert_service.kernels.moe_q8 import launch_q8_down, launch_q8_gate_up
from expert_service.kernels.moe_q8_dp4a import launch_dp4a_down, launch_dp4a_gate_up
from expert_service.kernels.moe_q8_dp4a_grouped import (
    launch_dp4a_grouped_down,
    launch_dp4a_grouped_gate_up,
    launch_dp4a_quantize_tokens,
)

# The combine computes the next layer's input norm (moe_combine_rmsnorm, one block per token) in steps of at least
# this many tokens; below, moe_combine spreads each token over blocks and rmsnorm follows (same bits): one block a
# token made a qwen3 decode combine ~20 µs. The all-experts combine (moe_combine_dense, one block a token either
# way) always fuses: there the split would only add the rmsnorm launch.
FUSED_COMBINE_NORM_MIN_TOKENS = 256
# cuBLAS chooses a kernel for every GEMM shape it has not seen, at ~0.6 ms of host time each (H200, cuBLAS 13;
# bench/moe_gemm.py --cublas-host): the per-expert row counts of CUBLAS_PER_EXPERT change every step, so each
# expert's GEMMs run on its rows rounded up to a multiple of these (warm-up runs every such shape once). The
# per-assignment buffers hold CUBLAS_ROW_SLACK rows more than a step's, so the last expert's rounded rows fit.
CUBLAS_ROW_QUANTUM, CUBLAS_ROW_QUANTUM_LARGE, CUBLAS_LARGE_ROWS = 64, 256, 1024
CUBLAS_ROW_SLACK = CUBLAS_ROW_QUANTUM_LARGE - 1
# Per-expert cuBLAS on 8-bit layers dequantises active experts into dense scratch of this many bytes, in two halves
# of a group each (at least one expert): one half is widened while the other's GEMMs run (cuda/dequant_pipeline.py).
DEQUANT_SCRATCH_BYTES = 256 << 20


def dequant_group(E: int, F: int, D: int, itemsize: int) -> int:
    """Experts dequantised at a time for per-expert cuBLAS on 8-bit layers (the scratch holds HALVES such groups)."""
    return max(1, min(E, DEQUANT_SCRATCH_BYTES // HALVES // (3 * F * D * itemsize)))


def cublas_rows(rows: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Rows each per-expert GEMM computes: `rows` rounded up (multiples of CUBLAS_ROW_QUANTUM, above
    CUBLAS_LARGE_ROWS of CUBLAS_ROW_QUANTUM_LARGE), at most `room` (the buffer rows from the expert's first)."""
    quantum = np.where(rows <= CUBLAS_LARGE_ROWS, CUBLAS_ROW_QUANTUM, CUBLAS_ROW_QUANTUM_LARGE)
    return np.minimum(-(-rows // quantum) * quantum, room)


class DeviceMoe:
    """The MoE block of every sparse layer. `cached`: the expert cache (None: every expert resident). `options`:
    the router it takes (CudaModel.use_options replaces them). `planned`: routing=lut, each step's expert ids come
    from its routing plan (workspace.routed_ids), not the top-k."""

    def __init__(
        self,
        config: ModelConfig,
        weights: DeviceWeights,
        workspace,
        linear: DeviceLinear,
        stream,
        cached: CachedExperts | None,
        options: CudaOptions,
        planned: bool = False,
        host_break=None,
    ):
        self.config, self.weights, self.ws, self.linear, self.stream = config, weights, workspace, linear, stream
        self.cached, self.options, self.planned = cached, options, planned
        # host_break(resume): the decoder's HostBreaks (a captured pass splits there); eagerly, resume()
        self.host_break = host_break if host_break is not None else (lambda resume: resume())
        self.dequant_pipeline: DequantPipeline | None = None  # made at the first 8-bit CUBLAS_PER_EXPERT step
        # SiluMulHalves on the per-expert buffers, made at the first per-expert cuBLAS step
        self._swiglu: elementwise.SiluMulHalves | None = None
        self._dequant_into: dict[tuple[int, int], DequantInto] = {}  # by (experts buffer, scratch half)
        self.moe_layers = config.moe_layers
        self.bf16 = np.dtype(weights.dtype) == np.uint16
        self.quantized = weights.quantized
        # y rows in assignment order (the GEMV and GROUPED_MMA strategies' combine)
        workspace.identity_position.copy_to_device(
            np.arange(workspace.identity_position.shape[0], dtype=np.int32), stream=stream
        )
        # gate_fused's tickets: zero before its first launch, and every launch leaves them zero
        workspace.router_counter.copy_to_device(np.zeros(workspace.router_counter.shape[0], np.int32), stream=stream)

    def forward(self, i: int, x, h, T: int, next_norm=None, warm=None) -> bool:
        """Layer i's MoE block on x [T, D] (normed input), added into the residual h [T, D]. The top-k ids of
        MoE layer m stay in workspace.topk_ids[m] for the step's trace. next_norm: the next layer's input-norm
        weight [D]; unless a shared expert still reads x after the combine, the combine then also writes
        x = rmsnorm(h) with it (moe_combine_rmsnorm) and forward returns True (x holds the next layer's input) --
        for steps of FUSED_COMBINE_NORM_MIN_TOKENS or more, and for the all-experts combine at any size. warm: an
        L2Warmer to prefetch the picked experts and the next layer's q|k|v once the router has run (decode steps
        under CudaOptions.l2_prefetch)."""
        cfg, ws, st = self.config, self.ws, self.stream
        K = cfg.num_experts_per_tok
        n = T * K
        logits, router = ws.router_logits[:T], self.weights.layer(i, "router")
        moe_index = self.moe_layers.index(i)
        ids = ws.topk_ids.reshape(-1)[moe_index * n : (moe_index + 1) * n].reshape(T, K)
        weights = ws.topk_weights[:T]
        strategy = step_strategy(T, cfg, self.weights, self.cached, self.options)
        fuse_norm = (
            next_norm is not None
            and not cfg.shared_expert_intermediate_size
            and (strategy is MoeStrategy.ALL_EXPERTS or T >= FUSED_COMBINE_NORM_MIN_TOKENS)
        )
        combine = self._combiner(x, next_norm if fuse_norm else None)
        if self.planned:  # routing=lut: the plan's ids (staged with the step), weights from their gate logits
            planned = ws.routed_ids[moe_index * n : (moe_index + 1) * n].reshape(T, K)
            launch_gate_planned(x, router, planned, ids, weights, stream=st)
        elif fused_router(T, self.options):
            launch_gate_fused(x, router, ids, weights, cfg.norm_topk_prob, logits, ws.router_counter, stream=st)
        else:
            self.linear.linear(x, router, logits)
            launch_gate_topk(logits, ids, weights, cfg.norm_topk_prob, stream=st)
        if warm is not None:  # the experts one token streams by slot from the resident buffer
            warm.experts(i, ids, T == 1 and strategy in (MoeStrategy.GEMV, MoeStrategy.Q8))
        experts = self.weights.experts.get(i)
        if strategy in (MoeStrategy.GROUPED_MMA, MoeStrategy.Q8_MMA):
            q8 = strategy is MoeStrategy.Q8_MMA
            meta = self.weights.expert_meta[i] if q8 else None
            F, D, wgmma = cfg.moe_intermediate_size, cfg.hidden_size, self.options.wgmma_experts
            w8a8 = self._w8a8_kind(i, experts) if q8 else None
            run_grouped_mma(ws, st, x, h, ids, weights, experts, F, D, combine, meta, wgmma, w8a8)
        elif strategy is MoeStrategy.Q8:
            self._q8(i, x, h, T, ids, weights, experts, combine)
        elif strategy is MoeStrategy.GEMV:
            self._gemv(x, h, T, ids, weights, experts, combine)
        elif strategy is MoeStrategy.ALL_EXPERTS:
            self._all_experts(x, h, T, ids, weights, experts, combine)
        elif strategy is MoeStrategy.GROUPED:
            self._grouped(x, h, T, ids, weights, experts, combine)
        elif strategy is MoeStrategy.CUBLAS_PER_EXPERT:
            self._cublas_per_expert(x, h, T, ids, weights, experts, combine, self.weights.expert_meta.get(i))
        else:
            assert self.cached is not None  # choose_strategy picks a cached strategy only with the cache on
            large, gemv = strategy is MoeStrategy.CACHED_CUBLAS, strategy is MoeStrategy.CACHED_GEMV
            options, a8 = self.options, self.int8_activations(i)
            self.cached.run(
                i,
                x,
                h,
                T,
                ids,
                weights,
                large,
                combine,
                gemv,
                options.pipelined_waves,
                options.cached_mma,
                a8,
                self.layout(i),
            )
        if cfg.shared_expert_intermediate_size:
            self._shared_expert(i, x, h, T)
        return fuse_norm

    def runs_w8a8(self, i: int, T: int) -> bool:
        """Whether layer i's experts run W8A8 (8-bit activations, moe_gemm_w8a8) at a step of T tokens under the
        current options (benchmarks label their steps with it)."""
        cfg, experts = self.config, self.weights.experts.get(i)
        if experts is None:
            return False
        if step_strategy(T, cfg, self.weights, self.cached, self.options) is not MoeStrategy.Q8_MMA:
            return False
        kind = self._w8a8_kind(i, experts)
        n, E, F, D = T * cfg.num_experts_per_tok, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        return takes_w8a8(kind, step_tile(n, E, F, D, experts, True, self.options.wgmma_experts, kind), True)

    def _w8a8_kind(self, i: int, experts) -> W8A8Kind | None:
        """Layer i's W8A8Kind under the current options (CudaOptions.q8_activations on) where W8A8 can run it
        (moe_grouped_mma.w8a8_kind), else None."""
        if not self.options.q8_activations:
            return None
        cfg, kinds, stride = self.config, self.weights.expert_kinds[i], experts.shape[1]
        F, D = cfg.moe_intermediate_size, cfg.hidden_size
        return w8a8_kind(kinds, F, D, stride, self.options.w8a8_min_rows)

    @property
    def q8_mma(self) -> tuple[int, int] | None:
        """The step sizes that run Q8_MMA under the current options (q8_mma_tokens)."""
        w8a8 = w8a8_everywhere(self.weights, self.options)
        return q8_mma_tokens(self.config, self.weights.all_8bit, self.bf16, self.options, w8a8)

    @property
    def cached_grouped(self) -> int:
        """choose_strategy's cached_grouped under the current options (cached_grouped_tokens)."""
        return cached_grouped_tokens(
            self.config, self.weights.dtype, self.quantized, self.options, self.weights.all_8bit
        )

    def cached_large(self, T: int) -> bool:
        """Whether a cached step of T tokens runs CACHED_CUBLAS (per-expert GEMMs at a host break)."""
        cfg = self.config
        strategy = choose_strategy(
            T, cfg.num_experts_per_tok, cfg.num_experts, True, self.bf16, cached_grouped=self.cached_grouped
        )
        return strategy is MoeStrategy.CACHED_CUBLAS

    def _combiner(self, x, norm_weight):
        """combine(y, index, weights, h, dense=False): the layer's last op, h += the weighted expert outputs
        (moe_combine, or moe_combine_dense for y [E, T, D]); with norm_weight, also x = rmsnorm(h, norm_weight)
        in the same launch (moe_combine_rmsnorm: bitwise the same as the combine, then rmsnorm)."""
        st, eps = self.stream, self.config.rms_norm_eps

        def combine(y, index, weights, h, dense: bool = False) -> None:
            if norm_weight is not None:
                launch_moe_combine_rmsnorm(y, index, weights, h, norm_weight, eps, x, dense=dense, stream=st)
            elif dense:
                launch_moe_combine_dense(y, index, weights, h, stream=st)
            else:
                launch_moe_combine(y, index, weights, h, stream=st)

        return combine

    def int8_activations(self, i: int) -> bool:
        """Whether layer i's moe_q8 steps (and the expert cache's one-token ones) run on int8 activations:
        CudaOptions.q8_decode_activations on a layer wholly int8 per channel."""
        kinds = self.weights.expert_kinds.get(i)
        return self.options.q8_decode_activations and kinds == ((CODE_INT8, SCALE_CHANNEL),)

    def layout(self, i: int) -> tuple[int, ...] | None:
        """The meta row every expert of layer i shares, for moe_q8 launches to take as arguments
        (CudaOptions.q8_layout_at_launch), or None: the kernels read each expert's row."""
        return self.weights.expert_layout.get(i) if self.options.q8_layout_at_launch else None

    def _q8(self, i: int, x, h, T: int, ids, weights, experts, combine) -> None:
        """8-bit / mixed layers up to GROUPED_MAX_TOKENS: moe_q8 by slot (one token: out row k is slot k) or
        grouped (rows in grouped order, combined through position); a layer wholly int8 per channel runs the same
        on int8 activations under q8_decode_activations (moe_q8_dp4a, moe_q8_dp4a_grouped)."""
        cfg, ws, st = self.config, self.ws, self.stream
        F, D, K = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts_per_tok
        n = T * K
        meta, kinds, layout = self.weights.expert_meta[i], self.weights.expert_kinds[i], self.layout(i)
        gate, out = ws.moe_gate[:n], ws.moe_out[:n]
        int8_activations = self.int8_activations(i)
        part_max = ws.moe_gate_part_max[:n] if int8_activations else None
        if T == 1:
            if int8_activations:
                launch_dp4a_gate_up(x, ids, experts, meta, F, D, gate, part_max, stream=st)
                launch_dp4a_down(gate, part_max, ids, experts, meta, F, D, out, stream=st)
            else:
                launch_q8_gate_up(x, experts, meta, F, D, gate, ids=ids, stream=st, kinds=kinds, layout=layout)
                launch_q8_down(gate, experts, meta, F, D, out, ids=ids, stream=st, kinds=kinds, layout=layout)
            combine(out, ws.identity_position[:n], weights, h)
            return
        order, position, offsets = ws.order[:n], ws.position[:n], ws.offsets
        launch_expert_grouping(ids, ws.counts, offsets, order, position, stream=st)
        if int8_activations:
            xq, x_scale = ws.moe_x_q8[:T], ws.moe_x_scale[:T]
            launch_dp4a_quantize_tokens(x, xq, x_scale, stream=st)
            launch_dp4a_grouped_gate_up(xq, x_scale, order, offsets, K, experts, meta, F, D, gate, part_max, stream=st)
            launch_dp4a_grouped_down(gate, part_max, offsets, experts, meta, F, D, out, stream=st)
        else:
            grouped = dict(offsets=offsets, stream=st, kinds=kinds, layout=layout)
            launch_q8_gate_up(x, experts, meta, F, D, gate, order=order, **grouped)
            launch_q8_down(gate, experts, meta, F, D, out, **grouped)
        combine(out, position, weights, h)

    def _gemv(self, x, h, T: int, ids, weights, experts, combine) -> None:
        """One token: its K experts streamed, their ids read on the device."""
        cfg, ws, st = self.config, self.ws, self.stream
        F, D, n = cfg.moe_intermediate_size, cfg.hidden_size, T * cfg.num_experts_per_tok
        out = ws.moe_out[:n]
        launch_expert_gate_up(x, ids, experts, F, D, ws.moe_gate[:n], stream=st)
        launch_expert_down(ws.moe_gate[:n], ids, experts, F, D, out, stream=st)
        combine(out, ws.identity_position[:n], weights, h)

    def _all_experts(self, x, h, T: int, ids, weights, experts, combine) -> None:
        """Every expert on every token: gate/up/down as three strided-batched GEMMs over the expert blocks
        into y [E, T, D] (a packed view of the workspace), then the dense combine of each token's experts."""
        cfg, ws, st, blas = self.config, self.ws, self.stream, self.linear.cublas
        E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        stride = experts.shape[1]
        flat = experts.reshape(-1)
        gate, up = ws.all_experts_gate[: E * T * F], ws.all_experts_up[: E * T * F]
        xc = self.linear.as_weight_dtype(x)
        blas.linear_batched(xc, 0, flat, 0, stride, F, D, gate, T * F, E, T)
        blas.linear_batched(xc, 0, flat, F * D, stride, F, D, up, T * F, E, T)
        elementwise.launch_silu_mul(gate, up, gate, stream=st)
        hc = self.linear.as_weight_dtype(gate.reshape(E * T, F))
        y = ws.all_experts_out.reshape(-1)[: E * T * D]
        blas.linear_batched(hc, T * F, flat, 2 * F * D, stride, D, F, y, T * D, E, T)
        combine(y.reshape(E, T, D), ids, weights, h, dense=True)

    def _grouped(self, x, h, T: int, ids, weights, experts, combine) -> None:
        """Assignments sorted by expert on the device; each active expert's weights read once."""
        cfg, ws, st = self.config, self.ws, self.stream
        F, D, n = cfg.moe_intermediate_size, cfg.hidden_size, T * cfg.num_experts_per_tok
        order, position = ws.order[:n], ws.position[:n]
        launch_expert_grouping(ids, ws.counts, ws.offsets, order, position, stream=st)
        out = ws.moe_out[:n]
        launch_moe_gate_up(x, order, ws.offsets, experts, F, D, ws.moe_gate[:n], stream=st)
        launch_moe_down(ws.moe_gate[:n], order, ws.offsets, experts, F, D, out, stream=st)
        combine(out, position, weights, h)

    def _cublas_per_expert(self, x, h, T: int, ids, weights, experts, combine, meta=None) -> None:
        """Large steps: tokens gathered into grouped order in the weights' dtype, the expert offsets read back
        at a host break, per active expert two GEMMs on tensor cores around one SwiGLU for all experts
        (`_expert_gemms`), then the combine."""
        cfg, ws, st = self.config, self.ws, self.stream
        K = cfg.num_experts_per_tok
        n = T * K
        order, position = ws.order[:n], ws.position[:n]
        launch_expert_grouping(ids, ws.counts, ws.offsets, order, position, stream=st)
        launch_gather_rows(x, order, ws.expert_x[:n], divisor=K, stream=st)
        ws.offsets.copy_to_host(ws.host["offsets"], stream=st)
        self.host_break(functools.partial(self._expert_gemms, n, experts, meta))
        combine(ws.moe_out[:n], position, weights, h)

    def _expert_gemms(self, n: int, experts, meta=None) -> None:
        """The host part of CUBLAS_PER_EXPERT, once the step's expert offsets are on their way to the host: per
        active expert gate|up [rows, 2F] = x @ [gate; up]^T (one GEMM: the two matrices are adjacent in the
        expert's block), SwiGLU over every expert's rows at once into the weights' dtype, then down [rows, D] f32.
        8-bit layers (meta: the layer's expert_meta) run this per group of dequant_group active experts, each
        group first widened into a half of the dense scratch ws.dequant (dequant_experts), the next group's
        widening overlapping this group's GEMMs (DequantPipeline; CudaOptions.overlap_dequant)."""
        cfg, ws = self.config, self.ws
        F, D = cfg.moe_intermediate_size, cfg.hidden_size
        self.stream.synchronize()
        offsets = ws.host["offsets"]
        active = np.flatnonzero(np.diff(offsets))
        lo = offsets[active].astype(np.int64)
        # Rounded row counts (cublas_rows): an expert's extra rows are the next experts' rows, recomputed by
        # their own GEMMs issued after it on this stream, or rows past the step's (the buffers' slack; never read).
        room = min(b.shape[0] for b in (ws.expert_x, ws.expert_gate_up, ws.expert_h, ws.moe_out)) - lo
        rows = cublas_rows(np.diff(offsets)[active].astype(np.int64), room)
        item = np.dtype(self.weights.dtype).itemsize
        if meta is None:
            self._gemm_group(
                device_address(experts) + active.astype(np.int64) * experts.shape[1] * item, lo, rows, 0, n
            )
            return
        scratch = ws.dequant
        group, block = scratch.shape[0] // HALVES, scratch.shape[1] * item
        spans = [(first, min(group, active.size - first)) for first in range(0, active.size, group)]

        def widen(index: int, half: int, stream) -> None:
            first, g = spans[index]
            key = (device_address(experts), half)  # a layer's experts buffer, for the engine's life
            if key not in self._dequant_into:
                into = scratch[half * group : (half + 1) * group]
                self._dequant_into[key] = DequantInto(experts, meta, ws.offsets, F, D, into)
            self._dequant_into[key](first, g, stream)

        def gemms(index: int, half: int) -> None:
            first, g = spans[index]
            part = slice(first, first + g)
            gate = device_address(scratch) + (half * group + np.arange(g, dtype=np.int64)) * block
            self._gemm_group(gate, lo[part], rows[part], int(lo[first]), int(offsets[active[first + g - 1] + 1]))

        if self.dequant_pipeline is None:
            self.dequant_pipeline = DequantPipeline(self.stream)
        run = self.dequant_pipeline.run if self.options.overlap_dequant else self.dequant_pipeline.run_in_order
        run(len(spans), widen, gemms)

    def _gemm_group(self, gate, lo, rows, r0: int, r1: int) -> None:
        """gate|up GEMMs of the experts whose gate matrices are at device addresses `gate` (their rows from `lo`,
        `rows` of them), SwiGLU over rows [r0, r1), then their down GEMMs."""
        cfg, ws, blas = self.config, self.ws, self.linear.cublas
        F, D = cfg.moe_intermediate_size, cfg.hidden_size
        dtype = self.weights.dtype
        item = np.dtype(dtype).itemsize
        gu = ws.expert_gate_up  # bf16 for bf16 weights (f32's range), else f32: fp16 would overflow
        blas.linear_each(
            gate,
            device_address(ws.expert_x) + lo * D * item,
            device_address(gu) + lo * 2 * F * gu.dtype.itemsize,
            rows,
            2 * F,
            D,
            dtype,
            out_dtype=gu.dtype,
        )
        self._swiglu_rows(r0, r1)
        blas.linear_each(
            gate + 2 * F * D * item,
            device_address(ws.expert_h) + lo * F * item,
            device_address(ws.moe_out) + lo * D * 4,
            rows,
            D,
            F,
            dtype,
        )

    def _swiglu_rows(self, r0: int, r1: int) -> None:
        """SwiGLU of the per-expert rows [r0, r1), one launch on views made once (the host break is on the
        step's critical path: each device-array view made costs tens of microseconds there)."""
        if self._swiglu is None:
            self._swiglu = elementwise.SiluMulHalves(self.ws.expert_gate_up, self.ws.expert_h)
        self._swiglu(r0, r1, self.stream)

    def warm_cublas_shapes(self, max_tokens: int) -> None:
        """Runs the per-expert GEMM shapes of every rounded row count an expert can have in a step of up to
        max_tokens tokens (at most max_tokens rows: a token's K experts are distinct) once, so cuBLAS has chosen
        their kernels before serving. Writes only workspace rows."""
        cfg, ws, blas = self.config, self.ws, self.linear.cublas
        F, D = cfg.moe_intermediate_size, cfg.hidden_size
        counts = np.unique(cublas_rows(np.arange(1, max_tokens + 1), np.full(max_tokens, ws.moe_out.shape[0])))
        experts = self.weights.experts.get(self.moe_layers[0])
        # 8-bit layers' GEMMs read the dequant scratch (the raw blocks are smaller than a dense expert)
        w, dtype = device_address(self.ws.dequant if self.quantized else experts), self.weights.dtype
        one = np.ones(1, np.int64)
        for m in counts.tolist():  # as _expert_gemms: gate|up, then down
            blas.linear_each(
                w * one,
                device_address(ws.expert_x) * one,
                device_address(ws.expert_gate_up) * one,
                m * one,
                2 * F,
                D,
                dtype,
                out_dtype=ws.expert_gate_up.dtype,
            )
            blas.linear_each(
                w * one, device_address(ws.expert_h) * one, device_address(ws.moe_out) * one, m * one, D, F, dtype
            )
        self.stream.synchronize()

    def _shared_expert(self, i: int, x, h, T: int) -> None:
        ws, w, lin = self.ws, self.weights, self.linear
        g = ws.shared_gate[:T]
        lin.swiglu(x, w.layer(i, "shared_gate_proj"), w.layer(i, "shared_up_proj"), g, ws.shared_up[:T])
        lin.linear(g, w.layer(i, "shared_down_proj"), ws.shared_out[:T])
        lin.linear(x, w.layer(i, "shared_expert_gate"), ws.shared_logit[:T])
        elementwise.launch_sigmoid_gate_add(h, ws.shared_out[:T], ws.shared_logit[:T], stream=self.stream)

    def close(self) -> None:
        if self.dequant_pipeline is not None:
            self.dequant_pipeline.close()
            self.dequant_pipeline = None
