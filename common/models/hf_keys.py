"""Reading the HF ``config.json`` keys the four families share; each family module adds its own."""

from __future__ import annotations

from common.errors import ConfigError
from common.model_config import RopeConfig

_LLAMA_NAMES = {
    "embed_tokens": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o_bias": "model.layers.{i}.self_attn.o_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}

# Qwen2-MoE, Qwen3-MoE and OLMoE name their MoE block `mlp` with HF's gate/up/down projection names.
QWEN_STYLE_NAMES = {
    **_LLAMA_NAMES,
    "router": "model.layers.{i}.mlp.gate.weight",
    "expert_gate_proj": "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
    "expert_up_proj": "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
    "expert_down_proj": "model.layers.{i}.mlp.experts.{j}.down_proj.weight",
    "shared_gate_proj": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "shared_up_proj": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "shared_down_proj": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate.weight",
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}

MIXTRAL_NAMES = {
    **_LLAMA_NAMES,
    "router": "model.layers.{i}.block_sparse_moe.gate.weight",
    "expert_gate_proj": "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
    "expert_up_proj": "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
    "expert_down_proj": "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight",
}


def require(hf: dict, key: str):
    if hf.get(key) is None:
        raise ConfigError(f"config.json: missing required key {key!r} for model_type {hf.get('model_type')!r}")
    return hf[key]


def _given(hf: dict, key: str, default):
    """hf[key], or `default` when the key is absent or null. Never `hf.get(key) or default`: that read a written 0,
    "" or [] as absent, so a value to refuse took the default's place."""
    value = hf.get(key)
    return default if value is None else value


def token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def shared_fields(hf: dict) -> dict:
    """Keys every family reads the same way (Llama-style attention + RMSNorm + RoPE)."""
    hidden, heads = int(require(hf, "hidden_size")), int(require(hf, "num_attention_heads"))
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (supported: silu)")
    return dict(
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=int(require(hf, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(_given(hf, "num_key_value_heads", heads)),
        head_dim=int(_given(hf, "head_dim", hidden // heads)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(require(hf, "max_position_embeddings")),
        rope=RopeConfig.from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_ids=token_ids(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
    )


def qwen_sparse_layers(hf: dict, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style dense/MoE layer choice: `mlp_only_layers` and every `decoder_sparse_step`-th layer."""
    step = int(_given(hf, "decoder_sparse_step", 1))
    dense = set(_given(hf, "mlp_only_layers", []))
    return tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(int(hf["num_hidden_layers"]))
    )


def qwen_sliding_windows(hf: dict) -> tuple[int | None, ...]:
    """Qwen2-MoE's `use_sliding_window` + `layer_types` (or `max_window_layers`) choose which layers slide."""
    n = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or not window:
        return (None,) * n
    layer_types = hf.get("layer_types")
    if layer_types is None:  # absent or null only: a written [] or "" is refused below, not replaced
        layer_types = [
            "sliding_attention" if (i + 1) % 2 and i < int(hf.get("max_window_layers", n)) else "full_attention"
            for i in range(n)
        ]
    # Any other kind (a linear-attention layer, a typo) would silently run as full attention
    if not isinstance(layer_types, list) or len(layer_types) != n:
        raise ConfigError(f"config.json: layer_types must list one kind per layer ({n}), got {layer_types!r}")
    for i, kind in enumerate(layer_types):
        if kind not in ("sliding_attention", "full_attention"):
            raise ConfigError(
                f"config.json: layer_types[{i}] must be sliding_attention or full_attention, got {kind!r}"
            )
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
