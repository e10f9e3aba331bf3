"""How a MoE layer of the cuda backend runs its routed experts (`MoeStrategy`), decided in one place.

The choice depends on the step's T tokens, the K of E experts each token is routed to, the weights' dtype and
whether every expert is resident on the device; `choose_strategy` decides from the thresholds defined beside it.
`ON_DEVICE` and `CAPTURABLE` say which strategies a CUDA graph captures (whole, or in pieces around a host break);
`reachable_strategies` lists those a model's steps can take (its workspace holds only their buffers);
`warmup_tokens` lists the step sizes whose warm-up loads every kernel; `ModelStrategies` derives all of these bounds
from one model's weights for the decoder. DeviceMoe (cuda/moe.py) runs them. What
each strategy launches, and the H200 measurements behind the thresholds, are in docs/kernels.md, section "MoE
strategy choice". Pure host code: no device is touched except by `few_expert_mma_tokens` and `w8a8_everywhere` (is
this an sm_90 GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import numpy as np

from common.model_config import ModelConfig
from expert_service.cuda.linear import GEMV_MAX_TOKENS
from expert_service.cuda.moe_grouped_mma import (
    WGMMA_MIN_ROWS,
    cached_mma_possible,
    grouped_tile,
    hopper,
    q8_mma_applies,
    wgmma_fits,
)
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels.moe_align import MAX_ASSIGNMENTS as ALIGN_MAX_ASSIGNMENTS
from expert_service.kernels.moe_align import MAX_E as ALIGN_MAX_E
from expert_service.kernels.moe_ffn import GROUPED_MAX_TOKENS
from expert_service.kernels.moe_gemm_mma import choose_config
from expert_service.kernels.moe_gemm_q8mma import choose_config as choose_q8_config

if TYPE_CHECKING:
    from expert_service.cuda.moe_cached import CachedExperts

ALL_EXPERTS_MAX_TOKENS = 64  # all experts on all tokens up to here (when T*K >= E); sizes its workspace
# Prefill sizes whose eager warm-up takes each resident strategy the model can reach (1: GEMV; 2 and 64:
# GROUPED or ALL_EXPERTS, by T*K against E; 65: CUBLAS_PER_EXPERT), so every kernel is loaded before serving.
WARMUP_TOKENS = (GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1, ALL_EXPERTS_MAX_TOKENS, GROUPED_MAX_TOKENS + 1)
# GROUPED_MMA for bf16 resident layers with at least this many experts (mixtral-like E = 8 stays on cuBLAS, where
# the mma.sync kernel measured 2-3.5x slower, except steps that take the wgmma kernel: few_expert_mma_tokens);
# 1 << 30 switches the strategy off.
GROUPED_MMA_MIN_EXPERTS = 32
GROUPED_MMA_SPARSE_STEPS = True  # layers of fewer experts take it for steps of T*K < E (choose_strategy)
GROUPED_MMA_MIN_TOKENS = 2  # one token keeps the GEMV strategy (T*K < E here)
# The fused router (gate_fused) up to this many tokens, with CudaOptions.fused_router; above, cuBLAS + gate_topk.
FUSED_ROUTER_MAX_TOKENS = 64


class WeightKinds(Protocol):
    """What the strategies read of a model's weights: DeviceWeights, or weights.ExpertFacts before any upload."""

    @property
    def dtype(self) -> np.dtype: ...
    @property
    def quantized(self) -> bool: ...
    @property
    def all_8bit(self) -> bool: ...
    @property
    def w8a8_layers(self) -> bool: ...


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


def q8_mma_tokens(
    config: ModelConfig, all_8bit: bool, bf16: bool, options: CudaOptions, w8a8: bool = False
) -> tuple[int, int] | None:
    """The step sizes (lo, hi) that run Q8_MMA on this model with these options, or None where the kernel does
    not apply: an expert that is not int8 / fp8 (a bf16 / fp16 / fp32 expert in a mixed layer: moe_q8 reads
    those), dense weights other than bf16 (the kernel's activations are bf16), D or F not a multiple of 16.
    Layers of few experts stop at q8_mma_max_tokens_few_experts, unless every layer runs W8A8 (w8a8_everywhere),
    which beats dequantising for cuBLAS at every size measured."""
    if not q8_mma_applies(config, all_8bit, bf16):
        return None
    many = w8a8 or config.num_experts >= GROUPED_MMA_MIN_EXPERTS
    return options.q8_mma_min_tokens, options.q8_mma_max_tokens if many else options.q8_mma_max_tokens_few_experts


def w8a8_everywhere(weights: WeightKinds, options: CudaOptions) -> bool:
    """Whether every MoE layer's experts run W8A8 on the wgmma tile (CudaOptions.q8_activations and wgmma_experts,
    an sm_90 device, DeviceWeights.w8a8_layers: resident, one 8-bit kind a layer that moe_gemm_w8a8 takes). Called
    per MoE layer of every eager step: the per-layer part is computed once, at load."""
    return options.q8_activations and options.wgmma_experts and weights.all_8bit and hopper() and weights.w8a8_layers


def few_expert_mma_tokens(config: ModelConfig, bf16: bool, options: CudaOptions) -> int:
    """choose_strategy's few_expert_mma: the largest step of a bf16 layer of fewer than GROUPED_MMA_MIN_EXPERTS
    experts that runs GROUPED_MMA (CudaOptions.grouped_mma_max_tokens_few_experts) where the wgmma kernel takes
    it (an sm_90 device, CudaOptions.wgmma_experts, dims it supports), else 0 (such layers keep per-expert cuBLAS,
    behind a host break, for large steps)."""
    E, F, D = config.num_experts, config.moe_intermediate_size, config.hidden_size
    limit = options.grouped_mma_max_tokens_few_experts
    if not (limit and bf16 and E < GROUPED_MMA_MIN_EXPERTS and options.wgmma_experts):
        return 0
    return limit if wgmma_fits(WGMMA_MIN_ROWS * E, E, F, D) and hopper() else 0


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
    few_expert_mma: int = 0,
) -> MoeStrategy:
    """How a step of T tokens, each routed to K of E experts, runs its experts (docs/kernels.md, "MoE strategy
    choice"); bf16: the weights are bfloat16; quantized: the experts are 8-bit or mixed (DeviceWeights.quantized);
    q8_mma: the step sizes that take Q8_MMA on such a model (q8_mma_tokens), None: none; cache_slots: the
    cache's slots per layer where its one-token GEMV may run (cached_gemv_slots), 0: never; cached_grouped: the
    largest cached step that runs the grouped waves (cached_grouped_tokens), larger ones per-expert cuBLAS;
    few_expert_mma: the largest step of a layer of few experts that runs GROUPED_MMA once it has WGMMA_MIN_ROWS
    rows an expert (few_expert_mma_tokens), 0: none."""
    n = T * K
    if cached:
        if T == 1 and n <= cache_slots:  # one token (CachedExperts._gemv's shapes), its experts always in wave 0
            return MoeStrategy.CACHED_GEMV
        return MoeStrategy.CACHED_CUBLAS if T > cached_grouped else MoeStrategy.CACHED_GROUPED
    if quantized:
        if q8_mma is not None and q8_mma[0] <= T <= q8_mma[1] and n <= ALIGN_MAX_ASSIGNMENTS:
            return MoeStrategy.Q8_MMA
        return MoeStrategy.CUBLAS_PER_EXPERT if T > GROUPED_MAX_TOKENS else MoeStrategy.Q8
    # Few large experts (mixtral-like) take it while a step routes to fewer assignments than experts (decode b=2
    # or 3 at K=2: it reads the routed experts alone, where ALL_EXPERTS reads all and GROUPED (moe_ffn) ran a
    # mixtral b=2 decode step at 1.9x b=4's time on the H200), and on the wgmma kernel up to few_expert_mma tokens.
    few = WGMMA_MIN_ROWS * E <= n and T <= few_expert_mma
    if (
        bf16
        and T >= GROUPED_MMA_MIN_TOKENS
        and (E >= GROUPED_MMA_MIN_EXPERTS or (GROUPED_MMA_SPARSE_STEPS and n < E) or few)
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


def step_strategy(
    T: int, config: ModelConfig, weights, cached: CachedExperts | None, options: CudaOptions
) -> MoeStrategy:
    """The strategy a step of T tokens takes on this model under these options: choose_strategy with every bound
    derived from the model's weights (DeviceWeights: dtype, quantized, all_8bit), its expert cache and the options,
    in one place, so the decoder and the MoE block cannot disagree."""
    bf16 = np.dtype(weights.dtype) == np.uint16
    return choose_strategy(
        T,
        config.num_experts_per_tok,
        config.num_experts,
        cached is not None,
        bf16,
        weights.quantized,
        q8_mma_tokens(config, weights.all_8bit, bf16, options, w8a8_everywhere(weights, options)),
        cached_gemv_slots(cached, options),
        cached_grouped_tokens(config, weights.dtype, weights.quantized, options, weights.all_8bit),
        few_expert_mma_tokens(config, bf16, options),
    )


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


def reachable_strategies(
    max_tokens: int,
    K: int,
    E: int,
    cached: bool,
    bf16: bool,
    quantized: bool = False,
    q8_mma: tuple[int, int] | None = None,
    cached_grouped: int = GROUPED_MAX_TOKENS,
    few_expert_mma: int = 0,
) -> set[MoeStrategy]:
    """Every strategy a step of 1..max_tokens tokens can take (the workspace holds only their buffers). The
    cache's one-token GEMV is left to CACHED_GROUPED here: it reads a subset of that layout's buffers, so the
    layout holds for either setting of CudaOptions.cached_gemv (set_options may switch it)."""
    return {
        choose_strategy(
            T, K, E, cached, bf16, quantized, q8_mma, cached_grouped=cached_grouped, few_expert_mma=few_expert_mma
        )
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
    few_expert_mma: int = 0,
) -> tuple[int, ...]:
    """Prefill sizes whose eager warm-up loads every kernel a resident step of up to max_tokens can launch:
    WARMUP_TOKENS and the smallest T of each (strategy, grouped-MMA tile config, router) combination; with
    cached_grouped (an expert-cache engine's choose_strategy bound, cached_grouped_tokens), the same for its
    cached steps, whose waves take the tile config of their size too when they run on the tensor-core kernel
    (cached_mma: CachedExperts.mma_possible with CudaOptions.cached_mma). dims: the experts' (F, D), which decide
    whether the wgmma kernel applies (None: the mma.sync tiles). few_expert_mma: choose_strategy's."""
    first: dict[tuple[MoeStrategy, object, bool], int] = {}  # (strategy, tile, router) -> smallest T
    for T in range(1, max_tokens + 1):
        router = fused_router(T, options)
        strategy = choose_strategy(T, K, E, False, bf16, quantized, q8_mma, few_expert_mma=few_expert_mma)
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


@dataclass(frozen=True, eq=False)
class ModelStrategies:
    """One model's bounds for choose_strategy under any options, derived from its config, its weights (DeviceWeights:
    dtype, quantized, all_8bit, w8a8_layers) and its largest step: the decoder lays out its workspace, checks
    set_options and plans its warm-up with them, so those three cannot disagree."""

    config: ModelConfig
    weights: WeightKinds
    max_tokens: int

    @property
    def bf16(self) -> bool:
        return np.dtype(self.weights.dtype) == np.uint16

    def q8_mma(self, options: CudaOptions) -> tuple[int, int] | None:
        w8a8 = w8a8_everywhere(self.weights, options)
        return q8_mma_tokens(self.config, self.weights.all_8bit, self.bf16, options, w8a8)

    def few_expert_mma(self, options: CudaOptions) -> int:
        return few_expert_mma_tokens(self.config, self.bf16, options)

    def cached_grouped(self, options: CudaOptions) -> int:
        w = self.weights
        return cached_grouped_tokens(self.config, w.dtype, w.quantized, options, w.all_8bit)

    @staticmethod
    def w8a8_min_rows(options: CudaOptions) -> int:
        """The rows an expert from which W8A8 steps quantise their activations, 0: never (the workspace's 8-bit rows)."""
        return options.w8a8_min_rows if options.q8_activations else 0

    def reachable(self, options: CudaOptions, cached: bool) -> set[MoeStrategy]:
        """The strategies steps of up to max_tokens take under `options` (cached: with the expert cache)."""
        cfg = self.config
        return reachable_strategies(
            self.max_tokens,
            cfg.num_experts_per_tok,
            cfg.num_experts,
            cached,
            self.bf16,
            self.weights.quantized,
            self.q8_mma(options),
            self.cached_grouped(options) if cached else GROUPED_MAX_TOKENS,
            self.few_expert_mma(options),
        )

    def warmup_tokens(self, options: CudaOptions, cached: CachedExperts | None) -> tuple[int, ...]:
        """warmup_tokens for this model: the prefill sizes whose warm-up loads every kernel its steps can launch."""
        cfg = self.config
        return warmup_tokens(
            self.max_tokens,
            cfg.num_experts_per_tok,
            cfg.num_experts,
            bf16=self.bf16,
            options=options,
            quantized=self.weights.quantized,
            q8_mma=self.q8_mma(options),
            cached_grouped=self.cached_grouped(options) if cached is not None else 0,
            cached_mma=cached is not None and cached.mma_possible and options.cached_mma,
            dims=(cfg.moe_intermediate_size, cfg.hidden_size),
            few_expert_mma=self.few_expert_mma(options),
        )
