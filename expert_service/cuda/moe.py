"""The MoE block on the cuda backend: router -> top-k -> the routed experts -> the shared expert (`DeviceMoe`).

How a layer runs its routed experts (`MoeStrategy`) depends on the step's T tokens, the K of E experts each
token is routed to, the weights' dtype and whether every expert is resident on the device; `choose_strategy`
decides, in one place, from the thresholds defined beside it. `capturable` and `ON_DEVICE` say which
strategies a CUDA graph captures (whole, or in pieces around a host break); `warmup_tokens` lists the step
sizes whose warm-up loads every kernel. The fused router and the combine that also writes the next layer's
input norm are CudaOptions (engine/cuda_options.py). What each strategy launches, and the H200 measurements behind
the thresholds, are in docs/kernels.md, section "MoE strategy choice".
"""

from __future__ import annotations

import functools
from enum import Enum

import numpy as np

from common.model_config import ModelConfig
from expert_service.cuda.dequant_pipeline import HALVES, DequantPipeline
from expert_service.cuda.driver import device_address
from expert_service.cuda.linear import GEMV_MAX_TOKENS, DeviceLinear
from expert_service.cuda.moe_cached import CachedExperts
from expert_service.cuda.moe_grouped_mma import cached_mma_possible, grouped_tile, q8_mma_applies, run_grouped_mma
from expert_service.cuda.weights import DeviceWeights
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels import elementwise
from expert_service.kernels.dequant_experts import DequantInto
from expert_service.kernels.expert_grouping import launch_expert_grouping
from expert_service.kernels.gate_fused import launch_gate_fused
from expert_service.kernels.gate_planned import launch_gate_planned
from expert_service.kernels.gate_topk import launch_gate_topk
from expert_service.kernels.gather import launch_gather_rows
from expert_service.kernels.gemv import launch_expert_down, launch_expert_gate_up
from expert_service.kernels.moe_align import MAX_ASSIGNMENTS as ALIGN_MAX_ASSIGNMENTS
from expert_service.kernels.moe_align import MAX_E as ALIGN_MAX_E
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_combine_dense import launch_moe_combine_dense
from expert_service.kernels.moe_combine_rmsnorm import launch_moe_combine_rmsnorm
from expert_service.kernels.moe_ffn import GROUPED_MAX_TOKENS, launch_moe_down, launch_moe_gate_up
from expert_service.kernels.moe_gemm_mma import choose_config
from expert_service.kernels.moe_gemm_q8mma import choose_config as choose_q8_config
from expert_service.kernels.moe_q8 import launch_q8_down, launch_q8_gate_up

ALL_EXPERTS_MAX_TOKENS = 64  # all experts on all tokens up to here (when T*K >= E); sizes its workspace
# Prefill sizes whose eager warm-up takes each resident strategy the model can reach (1: GEMV; 2 and 64:
# GROUPED or ALL_EXPERTS, by T*K against E; 65: CUBLAS_PER_EXPERT), so every kernel is loaded before serving.
WARMUP_TOKENS = (GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1, ALL_EXPERTS_MAX_TOKENS, GROUPED_MAX_TOKENS + 1)
# GROUPED_MMA for bf16 resident layers with at least this many experts (mixtral-like E = 8 stays on cuBLAS,
# where the tensor-core kernel measured 2-3.5x slower); 1 << 30 switches the strategy off.
GROUPED_MMA_MIN_EXPERTS = 32
GROUPED_MMA_SPARSE_STEPS = True  # layers of fewer experts take it for steps of T*K < E (choose_strategy)
GROUPED_MMA_MIN_TOKENS = 2  # one token keeps the GEMV strategy (T*K < E here)
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
# The fused router (gate_fused) up to this many tokens, with CudaOptions.fused_router; above, cuBLAS + gate_topk.
FUSED_ROUTER_MAX_TOKENS = 64


class MoeStrategy(Enum):
    GROUPED_MMA = "grouped_mma"
    GEMV = "gemv"
    ALL_EXPERTS = "all_experts"
    GROUPED = "grouped"
    CUBLAS_PER_EXPERT = "cublas_per_expert"
    CACHED_GROUPED = "cached_grouped"
    CACHED_GEMV = "cached_gemv"  # one token, its K experts in one wave: GEMV (moe_q8 by slot) on the slot buffer
    CACHED_CUBLAS = "cached_cublas"
    Q8 = "q8"  # 8-bit / mixed layers: moe_q8, by slot at one token, grouped above
    Q8_MMA = "q8_mma"  # every expert 8-bit: grouped tensor-core GEMM on the 8-bit tiles (moe_gemm_q8mma)


def q8_mma_tokens(config: ModelConfig, all_8bit: bool, bf16: bool, options: CudaOptions) -> tuple[int, int] | None:
    """The step sizes (lo, hi) that run Q8_MMA on this model with these options, or None where the kernel does
    not apply: an expert that is not int8 / fp8 (a bf16 / fp16 / fp32 expert in a mixed layer: moe_q8 reads
    those), dense weights other than bf16 (the kernel's activations are bf16), D or F not a multiple of 16."""
    if not q8_mma_applies(config, all_8bit, bf16):
        return None
    many = config.num_experts >= GROUPED_MMA_MIN_EXPERTS
    return options.q8_mma_min_tokens, options.q8_mma_max_tokens if many else options.q8_mma_max_tokens_few_experts


def choose_strategy(
    T: int,
    K: int,
    E: int,
    cached: bool,
    bf16: bool = False,
    quantized: bool = False,
    q8_mma: tuple[int, int] | None = None,
    cache_slots: int = 0,
    cached_grouped: int = GROUPED_MAX_TOKENS,
) -> MoeStrategy:
    """How a step of T tokens, each routed to K of E experts, runs its experts (docs/kernels.md, "MoE strategy
    choice"); bf16: the weights are bfloat16; quantized: the experts are 8-bit or mixed (DeviceWeights.quantized);
    q8_mma: the step sizes that take Q8_MMA on such a model (q8_mma_tokens), None: none; cache_slots: the
    cache's slots per layer where its one-token GEMV may run (cached_gemv_slots), 0: never; cached_grouped: the
    largest cached step that runs the grouped waves (cached_grouped_tokens), larger ones per-expert cuBLAS."""
    n = T * K
    if cached:
        if T == 1 and n <= cache_slots:  # one token (CachedExperts._gemv's shapes), its experts always in wave 0
            return MoeStrategy.CACHED_GEMV
        return MoeStrategy.CACHED_CUBLAS if T > cached_grouped else MoeStrategy.CACHED_GROUPED
    if quantized:
        if q8_mma is not None and q8_mma[0] <= T <= q8_mma[1] and n <= ALIGN_MAX_ASSIGNMENTS:
            return MoeStrategy.Q8_MMA
        return MoeStrategy.CUBLAS_PER_EXPERT if T > GROUPED_MAX_TOKENS else MoeStrategy.Q8
    # Few large experts (mixtral-like) take it only while a step routes to fewer assignments than experts (decode
    # b=2 or 3 at K=2): it reads the routed experts alone, where ALL_EXPERTS reads all and GROUPED (moe_ffn) ran a
    # mixtral b=2 decode step at 1.9x b=4's time on the H200.
    if (
        bf16
        and T >= GROUPED_MMA_MIN_TOKENS
        and (E >= GROUPED_MMA_MIN_EXPERTS or (GROUPED_MMA_SPARSE_STEPS and n < E))
        and E <= ALIGN_MAX_E
        and n <= ALIGN_MAX_ASSIGNMENTS
    ):
        return MoeStrategy.GROUPED_MMA
    if T <= GEMV_MAX_TOKENS and n < E:
        return MoeStrategy.GEMV
    if n >= E and T <= ALL_EXPERTS_MAX_TOKENS:
        return MoeStrategy.ALL_EXPERTS
    if T <= GROUPED_MAX_TOKENS:
        return MoeStrategy.GROUPED
    return MoeStrategy.CUBLAS_PER_EXPERT


# Strategies whose launches read every data-dependent size on the device, so a CUDA graph can capture them whole
# (the expert cache's grouped strategy too: its slot map, copies and waves are decided on the device).
ON_DEVICE = frozenset(
    {
        MoeStrategy.GROUPED_MMA,
        MoeStrategy.GEMV,
        MoeStrategy.ALL_EXPERTS,
        MoeStrategy.GROUPED,
        MoeStrategy.Q8,
        MoeStrategy.Q8_MMA,
        MoeStrategy.CACHED_GROUPED,
        MoeStrategy.CACHED_GEMV,
    }
)
# ... and those a graph captures in pieces around a host break (driver.HostBreaks).
CAPTURABLE = ON_DEVICE | {MoeStrategy.CUBLAS_PER_EXPERT, MoeStrategy.CACHED_CUBLAS}


def capturable(
    T: int, K: int, E: int, cached: bool, bf16: bool, quantized: bool = False, q8_mma: tuple[int, int] | None = None
) -> bool:
    """Whether a step of T tokens can replay CUDA graphs: its MoE blocks on the device, or split at host breaks."""
    return choose_strategy(T, K, E, cached, bf16, quantized, q8_mma) in CAPTURABLE


def reachable_strategies(
    max_tokens: int,
    K: int,
    E: int,
    cached: bool,
    bf16: bool,
    quantized: bool = False,
    q8_mma: tuple[int, int] | None = None,
    cached_grouped: int = GROUPED_MAX_TOKENS,
) -> set[MoeStrategy]:
    """Every strategy a step of 1..max_tokens tokens can take (the workspace holds only their buffers). The
    cache's one-token GEMV is left to CACHED_GROUPED here: it reads a subset of that layout's buffers, so the
    layout holds for either setting of CudaOptions.cached_gemv (set_options may switch it)."""
    return {
        choose_strategy(T, K, E, cached, bf16, quantized, q8_mma, cached_grouped=cached_grouped)
        for T in range(1, max_tokens + 1)
    }


def cached_gemv_slots(cached: CachedExperts | None, options: CudaOptions) -> int:
    """choose_strategy's cache_slots: the slots per layer with the cache's one-token GEMV on, else 0."""
    return cached.slots.slots_per_layer if cached is not None and options.cached_gemv else 0


def cached_grouped_tokens(
    config: ModelConfig, weight_dtype, quantized: bool, options: CudaOptions, all_8bit: bool = False
) -> int:
    """choose_strategy's cached_grouped: every step moe_align can sort (its assignment limit) with
    CudaOptions.cached_mma and cached_mma_large on layers whose waves run on a tensor-core kernel
    (cached_mma_possible; all_8bit: DeviceWeights.all_8bit), else GROUPED_MAX_TOKENS (moe_ffn's or moe_q8's
    grouped kernels; CACHED_CUBLAS above)."""
    E, K = config.num_experts, config.num_experts_per_tok
    q8 = q8_mma_applies(config, all_8bit, np.dtype(weight_dtype) == np.uint16)
    if options.cached_mma and options.cached_mma_large and cached_mma_possible(weight_dtype, quantized, E, q8):
        return ALIGN_MAX_ASSIGNMENTS // K
    return GROUPED_MAX_TOKENS


def dequant_group(E: int, F: int, D: int, itemsize: int) -> int:
    """Experts dequantised at a time for per-expert cuBLAS on 8-bit layers (the scratch holds HALVES such groups)."""
    return max(1, min(E, DEQUANT_SCRATCH_BYTES // HALVES // (3 * F * D * itemsize)))


def cublas_rows(rows: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Rows each per-expert GEMM computes: `rows` rounded up (multiples of CUBLAS_ROW_QUANTUM, above
    CUBLAS_LARGE_ROWS of CUBLAS_ROW_QUANTUM_LARGE), at most `room` (the buffer rows from the expert's first)."""
    quantum = np.where(rows <= CUBLAS_LARGE_ROWS, CUBLAS_ROW_QUANTUM, CUBLAS_ROW_QUANTUM_LARGE)
    return np.minimum(-(-rows // quantum) * quantum, room)


def fused_router(T: int, options: CudaOptions) -> bool:
    """Whether a step of T tokens routes with gate_fused (else DeviceLinear + gate_topk)."""
    return options.fused_router and T <= FUSED_ROUTER_MAX_TOKENS


def warmup_tokens(
    max_tokens: int,
    K: int,
    E: int,
    bf16: bool,
    options: CudaOptions,
    quantized: bool = False,
    q8_mma: tuple[int, int] | None = None,
    cached_grouped: int = 0,
    cached_mma: bool = False,
    dims: tuple[int, int] | None = None,
) -> tuple[int, ...]:
    """Prefill sizes whose eager warm-up loads every kernel a resident step of up to max_tokens can launch:
    WARMUP_TOKENS and the smallest T of each (strategy, grouped-MMA tile config, router) combination; with
    cached_grouped (an expert-cache engine's choose_strategy bound, cached_grouped_tokens), the same for its
    cached steps, whose waves take the tile config of their size too when they run on the tensor-core kernel
    (cached_mma: CachedExperts.mma_possible with CudaOptions.cached_mma). dims: the experts' (F, D), which decide
    whether the wgmma kernel applies (None: the mma.sync tiles)."""
    first: dict[tuple[MoeStrategy, object, bool], int] = {}  # (strategy, tile, router) -> smallest T
    for T in range(1, max_tokens + 1):
        router = fused_router(T, options)
        strategy = choose_strategy(T, K, E, False, bf16, quantized, q8_mma)
        tile = None
        if strategy in (MoeStrategy.GROUPED_MMA, MoeStrategy.Q8_MMA):
            q8 = strategy is MoeStrategy.Q8_MMA
            chooser = choose_q8_config if q8 else choose_config
            tile = chooser(T * K, E) if dims is None else grouped_tile(T * K, E, *dims, q8, options.wgmma_experts)
        first.setdefault((strategy, tile, router), T)
        if cached_grouped:
            strategy = choose_strategy(T, K, E, True, bf16, quantized, q8_mma, cached_grouped=cached_grouped)
            tile = None
            if strategy is MoeStrategy.CACHED_GROUPED and cached_mma:  # the waves' tile config of this size
                tile = choose_q8_config(T * K, E) if quantized else choose_config(T * K, E)
            first.setdefault((strategy, tile, router), T)
    return tuple(sorted(set(WARMUP_TOKENS) | set(first.values())))


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

    def forward(self, i: int, x, h, T: int, next_norm=None) -> bool:
        """Layer i's MoE block on x [T, D] (normed input), added into the residual h [T, D]. The top-k ids of
        MoE layer m stay in workspace.topk_ids[m] for the step's trace. next_norm: the next layer's input-norm
        weight [D]; unless a shared expert still reads x after the combine, the combine then also writes
        x = rmsnorm(h) with it (moe_combine_rmsnorm) and forward returns True (x holds the next layer's input) --
        for steps of FUSED_COMBINE_NORM_MIN_TOKENS or more, and for the all-experts combine at any size."""
        cfg, ws, st = self.config, self.ws, self.stream
        K, E = cfg.num_experts_per_tok, cfg.num_experts
        n = T * K
        logits, router = ws.router_logits[:T], self.weights.layer(i, "router")
        moe_index = self.moe_layers.index(i)
        ids = ws.topk_ids.reshape(-1)[moe_index * n : (moe_index + 1) * n].reshape(T, K)
        weights = ws.topk_weights[:T]
        strategy = choose_strategy(
            T,
            K,
            E,
            self.cached is not None,
            self.bf16,
            self.quantized,
            self.q8_mma,
            self.cache_slots,
            self.cached_grouped,
        )
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
        experts = self.weights.experts.get(i)
        if strategy in (MoeStrategy.GROUPED_MMA, MoeStrategy.Q8_MMA):
            meta = self.weights.expert_meta[i] if strategy is MoeStrategy.Q8_MMA else None
            F, D, wgmma = cfg.moe_intermediate_size, cfg.hidden_size, self.options.wgmma_experts
            run_grouped_mma(ws, st, x, h, ids, weights, experts, F, D, combine=combine, meta=meta, wgmma=wgmma)
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
            options = self.options
            self.cached.run(i, x, h, T, ids, weights, large, combine, gemv, options.pipelined_waves, options.cached_mma)
        if cfg.shared_expert_intermediate_size:
            self._shared_expert(i, x, h, T)
        return fuse_norm

    @property
    def q8_mma(self) -> tuple[int, int] | None:
        """The step sizes that run Q8_MMA under the current options (q8_mma_tokens)."""
        return q8_mma_tokens(self.config, self.weights.all_8bit, self.bf16, self.options)

    @property
    def cache_slots(self) -> int:
        """choose_strategy's cache_slots under the current options (cached_gemv_slots)."""
        return cached_gemv_slots(self.cached, self.options)

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

    def _q8(self, i: int, x, h, T: int, ids, weights, experts, combine) -> None:
        """8-bit / mixed layers up to GROUPED_MAX_TOKENS: moe_q8 by slot (one token: out row k is slot k) or
        grouped (rows in grouped order, combined through position)."""
        cfg, ws, st = self.config, self.ws, self.stream
        F, D, n = cfg.moe_intermediate_size, cfg.hidden_size, T * cfg.num_experts_per_tok
        meta, kinds = self.weights.expert_meta[i], self.weights.expert_kinds[i]
        gate, out = ws.moe_gate[:n], ws.moe_out[:n]
        if T == 1:
            launch_q8_gate_up(x, experts, meta, F, D, gate, ids=ids, stream=st, kinds=kinds)
            launch_q8_down(gate, experts, meta, F, D, out, ids=ids, stream=st, kinds=kinds)
            combine(out, ws.identity_position[:n], weights, h)
            return
        order, position = ws.order[:n], ws.position[:n]
        launch_expert_grouping(ids, ws.counts, ws.offsets, order, position, stream=st)
        launch_q8_gate_up(x, experts, meta, F, D, gate, order=order, offsets=ws.offsets, stream=st, kinds=kinds)
        launch_q8_down(gate, experts, meta, F, D, out, offsets=ws.offsets, stream=st, kinds=kinds)
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
