"""Mixtral: Llama attention (no biases), softmax top-k routing always renormalised, every layer MoE."""

from common.model_config import ModelConfig, QKNorm
from common.models.hf_keys import MIXTRAL_NAMES as HF_NAMES
from common.models.hf_keys import require, shared_fields

__all__ = ["HF_DEFAULTS", "HF_NAMES", "config_from_hf"]

# What transformers' config class assumes for these keys when config.json leaves them out
HF_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8}


def config_from_hf(hf: dict) -> ModelConfig:
    shared = shared_fields(hf)
    n = shared["num_hidden_layers"]
    window = hf.get("sliding_window")
    ffn = int(require(hf, "intermediate_size"))
    return ModelConfig(
        family="mixtral",
        **shared,
        qkv_bias=False,
        o_bias=False,
        qk_norm=QKNorm.NONE,
        clip_qkv=None,
        num_experts=int(require(hf, "num_local_experts")),
        num_experts_per_tok=int(require(hf, "num_experts_per_tok")),
        moe_intermediate_size=ffn,
        norm_topk_prob=True,
        intermediate_size=ffn,
        sparse_layers=(True,) * n,
        shared_expert_intermediate_size=0,
        sliding_windows=(int(window) if window else None,) * n,
    )
