"""OLMoE: RMSNorm over the full q and k projections, optional `clip_qkv`, `norm_topk_prob`, every layer MoE."""

from common.model_config import ModelConfig, QKNorm
from common.models.hf_keys import QWEN_STYLE_NAMES as HF_NAMES
from common.models.hf_keys import require, shared_fields

__all__ = ["HF_DEFAULTS", "HF_NAMES", "config_from_hf"]

# What transformers' config class assumes for these keys when config.json leaves them out
HF_DEFAULTS = {"rms_norm_eps": 1e-5}


def config_from_hf(hf: dict) -> ModelConfig:
    shared = shared_fields(hf)
    bias = bool(hf.get("attention_bias", False))
    clip = hf.get("clip_qkv")
    ffn = int(require(hf, "intermediate_size"))
    return ModelConfig(
        family="olmoe",
        **shared,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=QKNorm.FULL,
        clip_qkv=float(clip) if clip is not None else None,
        num_experts=int(require(hf, "num_experts")),
        num_experts_per_tok=int(require(hf, "num_experts_per_tok")),
        moe_intermediate_size=ffn,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        intermediate_size=ffn,
        sparse_layers=(True,) * shared["num_hidden_layers"],
        shared_expert_intermediate_size=0,
        sliding_windows=(None,) * shared["num_hidden_layers"],
    )
