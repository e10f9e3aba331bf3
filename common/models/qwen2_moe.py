"""Qwen2-MoE: q/k/v biases, a shared expert behind a sigmoid gate, optional dense layers
(`mlp_only_layers`, `decoder_sparse_step`), `norm_topk_prob` (off in the released checkpoints)."""

from common.model_config import ModelConfig, QKNorm
from common.models.hf_keys import QWEN_STYLE_NAMES as HF_NAMES
from common.models.hf_keys import qwen_sliding_windows, qwen_sparse_layers, require, shared_fields

__all__ = ["HF_DEFAULTS", "HF_NAMES", "config_from_hf"]

# What transformers' config class assumes for these keys when config.json leaves them out
HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "num_key_value_heads": 16,
    "shared_expert_intermediate_size": 5632,
    "sliding_window": 4096,
    "max_window_layers": 28,
}


def config_from_hf(hf: dict) -> ModelConfig:
    num_experts = int(require(hf, "num_experts"))
    return ModelConfig(
        family="qwen2_moe",
        **shared_fields(hf),
        qkv_bias=bool(hf.get("qkv_bias", True)),
        o_bias=False,
        qk_norm=QKNorm.NONE,
        clip_qkv=None,
        num_experts=num_experts,
        num_experts_per_tok=int(require(hf, "num_experts_per_tok")),
        moe_intermediate_size=int(require(hf, "moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        intermediate_size=int(require(hf, "intermediate_size")),
        sparse_layers=qwen_sparse_layers(hf, num_experts),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        sliding_windows=qwen_sliding_windows(hf),
    )
