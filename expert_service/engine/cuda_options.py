"""Which of the cuda backend's alternative kernel paths a decoder takes: one frozen value, given to the decoder
(EngineConfig.cuda_options) and swapped only through CudaDecoder.set_options, which drops the captured graphs
(a graph keeps the path it was captured with). Every default is the shipped path; turning one off restores the
path it replaced, for comparisons (bench/profile_step.py) and to rule a new kernel out quickly. It imports
nothing but dataclasses: EngineConfig holds it, and the cpu backend must not load numba."""

from __future__ import annotations

from dataclasses import dataclass


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
    # a MoE layer's combine also writes the next layer's input RMSNorm, moe_combine_rmsnorm, where cuda/moe.py
    # finds it pays (FUSED_COMBINE_NORM_MIN_TOKENS) (False: rmsnorm at the next layer's start)
    fused_combine_norm: bool = True
    # steps of up to moe.FUSED_ROUTER_MAX_TOKENS route with gate_fused: router GEMV, softmax, top-k and
    # normalisation in one launch (False: DeviceLinear + gate_topk at every size)
    fused_router: bool = True
