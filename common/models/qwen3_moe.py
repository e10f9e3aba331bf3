"""Qwen3-MoE: explicit `head_dim`, RMSNorm on each q/k head before RoPE, `norm_topk_prob`, no shared expert,
one sliding window for every layer when `use_sliding_window`."""

from common.errors import ConfigError
from common.model_config import ModelConfig, QKNorm
from common.models.hf_keys import QWEN_STYLE_NAMES as HF_NAMES
from common.models.hf_keys import qwen_sparse_layers, require, shared_fields

__all__ = ["HF_DEFAULTS", "HF_NAMES", "config_from_hf"]

# What transformers' config class assumes for these keys when config.json leaves them out
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "num_key_value_heads": 4, "sliding_window": 4096}


def config_from_hf(hf: dict) -> ModelConfig:
    num_experts = _num_experts(hf)
    bias = bool(hf.get("attention_bias", False))
    shared = shared_fields(hf)
    # transformers' Qwen3-MoE slides every layer when use_sliding_window: unlike Qwen2-MoE it reads neither
    # max_window_layers nor layer_types
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return ModelConfig(
        family="qwen3_moe",
        **shared,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=QKNorm.PER_HEAD,
        clip_qkv=None,
        num_experts=num_experts,
        num_experts_per_tok=int(require(hf, "num_experts_per_tok")),
        moe_intermediate_size=int(require(hf, "moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        intermediate_size=int(hf.get("intermediate_size") or 0),  # null or 0: no dense layer's size
        sparse_layers=qwen_sparse_layers(hf, num_experts),
        shared_expert_intermediate_size=0,
        sliding_windows=(int(window) if window else None,) * shared["num_hidden_layers"],
    )


def _num_experts(hf: dict) -> int:
    """Hub checkpoints say `num_experts`; transformers 5 writes `num_local_experts`. A key written (0 included: the
    bounds check refuses it) is never replaced by the other, and two that disagree are refused, not picked from."""
    given, local = hf.get("num_experts"), hf.get("num_local_experts")
    if given is None:
        return int(require(hf, "num_local_experts"))
    if local is not None and local != given:
        raise ConfigError(f"config.json: num_experts {given} and num_local_experts {local} disagree; give one of them")
    return int(given)
