"""Which of the cuda backend's alternative kernel paths a decoder takes: one frozen value, given to the decoder
(EngineConfig.cuda_options) and swapped only through CudaDecoder.set_options, which drops the captured graphs
(a graph keeps the path it was captured with). Every default is the shipped path; turning one off restores the
path it replaced, for comparisons (bench/profile_step.py) and to rule a new kernel out quickly. The EXPERIMENTAL
switches are the exception: new paths, off until measured. It imports
nothing but dataclasses: EngineConfig holds it, and the cpu backend must not load numba. The integer fields are
the step-size thresholds of kernels whose crossover is measured on the GPU (bench/engine.py --q8-mma-sweep
sweeps them without code changes)."""

from __future__ import annotations

from dataclasses import dataclass

# Paths built and tested (simulator, GPU suite) whose H200 figures are not in yet: off by default until they are.
# Every other switch defaults to the shipped path.
EXPERIMENTAL: frozenset[str] = frozenset(
    {
        "decode_splits_per_step",
        "q8_decode_activations",
        "shared_prefix_attention",
        "l2_prefetch",
        "programmatic_launch",
    }
)


@dataclass(frozen=True, slots=True)
class CudaOptions:
    # non-decode steps pad to a token bucket and replay its graph where capturable (False: unpadded and eager)
    prefill_graphs: bool = True
    # the head's argmax: greedy_split, two passes with many blocks per row (False: greedy, one block per row)
    greedy_split: bool = True
    # RoPE and the KV write in one launch, rope_kv_write (False: rope, then kv_write)
    fused_rope_kv: bool = True
    # per-head q/k norms (Qwen3-MoE) in the RoPE + KV-write launch, qk_norm_rope_kv_write, where the head size
    # allows and fused_rope_kv is on (False: two rmsnorm launches first)
    fused_qk_norm: bool = True
    # one-token steps: one GEMV over the stacked q|k|v weight rows where the format stores them (False: three)
    fused_qkv: bool = True
    # decode attention on attention_decode_tiled where it applies (bf16 pools, head size 64/128; 1.2-4.2x faster
    # on the H200, docs/kernels.md) (False: attention_decode everywhere)
    tiled_decode_attention: bool = True
    # decode steps of 2+ sequences on tensor cores, attention_decode_mma, where it applies (bf16 pools, head size
    # 16/32/64/128, at most 16 query heads per kv head); elsewhere tiled_decode_attention decides
    mma_decode_attention: bool = True
    # EXPERIMENTAL: decode attention's split-K parts sized for the step's own sequences (attention_decode.decode_splits
    # of S: one sequence over a long context gets up to ~66 parts), each sequence using as many as its context needs
    # (False: the parts of the largest batch at every size, 2 at 64 sequences, so a lone sequence runs its whole
    # context in 2 blocks per head group)
    decode_splits_per_step: bool = False
    # the fewest keys a decode-attention split part holds (a multiple of 32, the tiled and tensor-core kernels' key
    # tile): a short context is cut into fewer, longer parts. 64: one sequence over 129 keys runs parts of 65 and 64
    # keys (3 and 2 tiles one after another); 32 (with decode_splits_per_step) 5 parts of at most one tile, for a
    # reduce of 5 parts instead of 2 (docs/kernels.md, "Parts of one key tile"); H100: qwen3moe-shape b = 1 1.3-1.8 %
    # faster, b = 16 and mixtral-shape equal within noise (b = 64 not measured yet)
    decode_part_keys: int = 64
    # EXPERIMENTAL: decode steps whose sequences share cached prompt blocks (a system prompt, the samples of one
    # request) attend those blocks once per group of up to 16 / (heads per kv head) sequences, their query heads side
    # by side in the tensor-core kernel's rows (attention_decode_shared), where attention_decode_mma applies and the
    # layer has no sliding window; the groups are read from the step's block tables. H200: 1.08x the unshared kernel
    # at 16 sequences over 2,048 shared tokens, 0.7x at short prefixes or 64 sequences (docs/kernels.md), so off.
    # Laid out only when the engine's config has it on (False: every sequence reads its whole context)
    shared_prefix_attention: bool = False
    # EXPERIMENTAL: decode steps prefetch weights into L2 a kernel or two before they are streamed (cuda/l2_warm.py:
    # after q|k|v, the layer's o and router rows; after the router, the picked experts of a one-token step and the
    # next layer's q|k|v), so the HBM stays busy through the short kernels in between. Outputs are unchanged (a
    # prefetch is a hint). Measured slower (H100: one warp issues ~0.2 TB/s and stalls the stream behind it; a
    # qwen3moe-shape int8 one-token step 1.7x longer) (False: every weight stream starts cold)
    l2_prefetch: bool = False
    # a MoE layer's combine also writes the next layer's input RMSNorm, moe_combine_rmsnorm, where cuda/moe.py
    # finds it pays (FUSED_COMBINE_NORM_MIN_TOKENS) (False: rmsnorm at the next layer's start)
    fused_combine_norm: bool = True
    # steps of up to moe_strategy.FUSED_ROUTER_MAX_TOKENS route with gate_fused: router GEMV, softmax, top-k and
    # normalisation in one launch (False: DeviceLinear + gate_topk at every size)
    fused_router: bool = True
    # EXPERIMENTAL: decode steps launch the kernels of their one-token chain (embedding, norms, GEMVs, RoPE + KV
    # write, decode attention and its reduce, router, 8-bit projections and experts, combine, argmax) in variants
    # that captured graphs join by programmatic edges (sm_90: a kernel's blocks start while the one before drains;
    # kernels/programmatic.py), the same bits. 1: every kernel waits for its predecessor first (measured slower, H100:
    # qwen3moe-shape b = 1 steps 5-8 % longer, b = 16 equal; docs/kernels.md); 2: only the dense GEMVs wait, after
    # issuing their first weight loads, the other kernels only let them start (not measured yet). Engines with an
    # expert cache, and devices before sm_90, run the plain kernels (0: every kernel starts when the one before ends)
    programmatic_launch: int = 0
    # on an sm_90 device, grouped-MMA steps (bf16 and 8-bit) with at least moe_grouped_mma.WGMMA_MIN_ROWS rows per
    # routed expert run the warpgroup-MMA kernels (moe_gemm_wgmma, moe_gemm_q8wgmma) (False: the mma.sync kernels
    # moe_gemm_mma / moe_gemm_q8mma at every size)
    wgmma_experts: bool = True
    # expert-cache steps of one token whose K experts fit a layer's slots (so one wave) run the resident GEMV
    # kernels on the slot buffer, moe_q8 by slot on 8-bit layers (False: grouping + the grouped kernels through
    # the wave's slot map, as larger cached steps)
    cached_gemv: bool = True
    # expert-cache steps in grouped waves (2..moe_ffn.GROUPED_MAX_TOKENS tokens, two slots a layer at least): waves
    # of half the slots, wave w + 1's copies on a copy stream while wave w computes (False: waves of every slot,
    # copies and kernels in turn on the compute stream)
    pipelined_waves: bool = True
    # expert-cache prefetch copies wait while a demand copy runs, so a miss the step waits for has the link to
    # itself instead of half of it (kernels/expert_fetch.py) (False: both copy at once, sharing the link)
    prefetch_yields: bool = True
    # expert-cache grouped steps on bf16 layers (up to moe_align's limits) run each wave on the tensor-core grouped
    # kernel (moe_gemm_mma through a tile -> slot map, tile_slots.py) instead of moe_ffn's CUDA-core kernels (False:
    # moe_ffn through the wave's slot map; H200 figures in docs/expert-cache.md)
    cached_mma: bool = True
    # with cached_mma, expert-cache steps of every size on such layers run those waves too (the sorted rows laid
    # out for the engine's largest step), so a prefill chunk under a budget is captured whole (with its prefetch
    # under EngineConfig.prefetch_large_steps), instead of reading the waves back at a host break per layer for
    # per-expert cuBLAS GEMMs on each expert's exact row count (False: steps above moe_ffn.GROUPED_MAX_TOKENS take
    # that CACHED_CUBLAS path; H200, qwen3moe-shape at 25 %: prefill 1x512 7.3x faster with it, decode
    # unchanged); laid out only when the engine's config has it on
    cached_mma_large: bool = True
    # 8-bit layers' per-expert cuBLAS steps widen the next group of experts on a side stream while this group's
    # GEMMs run (cuda/dequant_pipeline.py) (False: widening and GEMMs in turn on the compute stream)
    overlap_dequant: bool = True
    # 8-bit expert layers (every expert int8 / fp8, bf16 dense weights): steps of q8_mma_min_tokens up to
    # q8_mma_max_tokens tokens run the grouped tensor-core kernel (moe_gemm_q8mma); smaller ones moe_q8, larger
    # ones dequantise + per-expert cuBLAS. Layers with fewer than moe_strategy.GROUPED_MMA_MIN_EXPERTS experts (mixtral-like:
    # few, large experts, where cuBLAS wins big steps) stop at q8_mma_max_tokens_few_experts instead.
    # q8_mma_min_tokens above every step size turns the kernel off.
    q8_mma_min_tokens: int = 2
    q8_mma_max_tokens: int = 1 << 20
    q8_mma_max_tokens_few_experts: int = 512
    # bf16 layers with fewer than moe_strategy.GROUPED_MMA_MIN_EXPERTS experts (mixtral-like), on an sm_90 device
    # with wgmma_experts: steps of up to this many tokens with at least moe_grouped_mma.WGMMA_MIN_ROWS rows per
    # expert run GROUPED_MMA on the wgmma kernel, captured whole, instead of per-expert cuBLAS GEMMs behind a host
    # break per MoE layer (0: never). 1,024: on an H100 a mixtral-shape 1 x 512 prefill 1.19x faster, 1,024-token
    # steps even; 2,048-token ones 8 % slower, so they stay on cuBLAS (docs/kernels.md, "MoE strategy choice")
    grouped_mma_max_tokens_few_experts: int = 1024
    # Q8_MMA steps on the warpgroup-MMA tiles (an sm_90 device, wgmma_experts, at least w8a8_min_rows rows an
    # expert) of layers whose experts share one 8-bit type and scale scheme quantize each expert input row
    # (and each SwiGLU output row) to that type with its own scale and multiply on the 8-bit tensor cores
    # (moe_gemm_w8a8, W8A8) instead of widening the weights to bf16: an approximation of the activations (held-out
    # perplexity within 0.15 % of bf16 experts; H200 mixtral-shape int8 prefill 1.30-1.48x bf16, widened 0.67-0.79x;
    # docs/quantization.md).
    # Where every MoE layer runs it, layers of few experts take Q8_MMA at every size (q8_mma_max_tokens). Laid out
    # only when the engine's config has it on (False: the weights widened to bf16 at every size)
    q8_activations: bool = True
    # EXPERIMENTAL: moe_q8 steps (one token; grouped ones up to 64 tokens that Q8_MMA does not take) of layers whose
    # experts are all int8 per channel round the tokens and each expert's SwiGLU rows to int8 per row and sum on
    # dp4a (moe_q8_dp4a, moe_q8_dp4a_grouped), the same activation rounding as q8_activations, where moe_q8 widens
    # each weight to float32 (H200, one token: 1.08-1.12x moe_q8; off until the GPU tests that compare int8 steps
    # with the exact cpu backend take it off) (False: moe_q8)
    q8_decode_activations: bool = False
    # 8-bit weight streams (moe_q8 and linear_q8: experts of layers whose experts share one block layout, the 8-bit
    # LM head and attention projections) take their block offsets as launch arguments, so at one token the weights'
    # addresses wait on no load but the routed expert's id; the same bits; H100 qwen3moe-shape int8 b = 1 1.4-3.2 %
    # faster, b = 16 0-1 % slower (docs/kernels.md, "Block layout at launch") (False: each launch reads its
    # meta row on the device first, one more memory round trip before the stream)
    q8_layout_at_launch: bool = True
    # rows per routed expert from which such a step runs W8A8: on the 128-row tile from
    # moe_grouped_mma.WGMMA_MIN_ROWS (96), on the 64-row one below it. 32: the 64-row tile ran 0.97-2.7x the widening
    # mma.sync kernel at 32-95 rows (H100; qwen3moe-shape int8 prefill 1 x 512 1.2x faster in the engine), 0.76x at 16
    w8a8_min_rows: int = 32
    # models with 8-bit attention projections: steps of at least this many tokens widen each projection into a
    # dense scratch (kernels/dequant_matrix.py) for cuBLAS instead of running it on 8-bit rows (linear_q8 up to 4
    # rows, moe_gemm_q8mma past), which reads the matrix once a tile of rows. 64: H100 per layer, widened against
    # the 8-bit GEMM, mixtral-shape 88.5 / 67.8 µs at 16 rows, 87.1 / 74.4 at 32, 88.8 / 100.3 at 64, 144 / 348
    # at 512; qwen3moe-shape 55 / 55, 56 / 60, 58 / 79, 85 / 237 (bench/attention_8bit.py). 0: never. The
    # scratch is laid out only when the engine's value widens some step it can take.
    attention_8bit_dense_rows: int = 64

    def __post_init__(self) -> None:
        for name in ("q8_mma_min_tokens", "q8_mma_max_tokens", "q8_mma_max_tokens_few_experts", "w8a8_min_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cuda_options.{name}: must be a positive integer, got {value!r}")
        keys = self.decode_part_keys
        if isinstance(keys, bool) or not isinstance(keys, int) or not 32 <= keys < 1 << 31 or keys % 32:
            raise ValueError(f"cuda_options.decode_part_keys: must be a positive multiple of 32, got {keys!r}")
        level = self.programmatic_launch
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ValueError(f"cuda_options.programmatic_launch: must be 0, 1 or 2, got {level!r}")
        for name in ("grouped_mma_max_tokens_few_experts", "attention_8bit_dense_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"cuda_options.{name}: must be an integer >= 0, got {value!r}")
