"""Model families: one module per HF ``model_type``, each turning ``config.json`` into a ``ModelConfig``
and naming the checkpoint tensors behind Colibri's canonical tensor names.

Canonical names (what the manifest and the engine use):

    embed_tokens [V, D]    final_norm [D]    lm_head [V, D] (absent when tie_word_embeddings)
    layers.{i}.input_norm [D]   layers.{i}.post_attn_norm [D]
    layers.{i}.q_proj [Hq*Hd, D]  k_proj / v_proj [Hkv*Hd, D]  o_proj [D, Hq*Hd]   (+ q/k/v/o _bias)
    layers.{i}.q_norm / k_norm   [Hd] (per_head) or [Hq*Hd] / [Hkv*Hd] (full)
    layers.{i}.router [E, D]     (MoE layers)
    layers.{i}.experts.{j}.gate_proj [F, D]  up_proj [F, D]  down_proj [D, F]   (expert files)
    layers.{i}.shared_gate_proj / shared_up_proj [Fs, D]  shared_down_proj [D, Fs]  shared_expert_gate [1, D]
    layers.{i}.gate_proj / up_proj [Fd, D]  down_proj [D, Fd]   (dense layers)

Matrices keep HF's [out, in] layout: row-major rows along the input dimension are what both numpy's
``x @ W.T`` and a GEMV kernel reading one output row per warp want.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from common.errors import ConfigError
from common.model_config import ModelConfig, QKNorm
from common.models import mixtral, olmoe, qwen2_moe, qwen3_moe

FAMILIES: dict[str, ModuleType] = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe,
}


def family_module(model_type: str | None) -> ModuleType:
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[model_type]


def config_from_hf(hf: dict) -> ModelConfig:
    return family_module(hf.get("model_type")).config_from_hf(hf)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str                 # canonical name
    hf_name: str              # name in the HF checkpoint
    shape: tuple[int, ...]
    layer: int | None = None
    expert: int | None = None  # set for routed-expert matrices (stored in the expert files)


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor a model of this config has, in storage order (experts: gate, up, down adjacent)."""
    names = family_module(config.family).HF_NAMES
    D, V = config.hidden_size, config.vocab_size
    specs = [TensorSpec("embed_tokens", names["embed_tokens"], (V, D))]
    for i in range(config.num_hidden_layers):
        def add(key: str, shape: tuple[int, ...], expert: int | None = None, **fmt):
            hf = names[key].format(i=i, j=expert, **fmt)
            canonical = f"layers.{i}.experts.{expert}.{key[7:]}" if expert is not None else f"layers.{i}.{key}"
            specs.append(TensorSpec(canonical, hf, shape, i, expert))
        add("input_norm", (D,))
        add("post_attn_norm", (D,))
        add("q_proj", (config.q_size, D))
        add("k_proj", (config.kv_size, D))
        add("v_proj", (config.kv_size, D))
        add("o_proj", (D, config.q_size))
        if config.qkv_bias:
            add("q_bias", (config.q_size,))
            add("k_bias", (config.kv_size,))
            add("v_bias", (config.kv_size,))
        if config.o_bias:
            add("o_bias", (D,))
        if config.qk_norm is QKNorm.PER_HEAD:
            add("q_norm", (config.head_dim,))
            add("k_norm", (config.head_dim,))
        elif config.qk_norm is QKNorm.FULL:
            add("q_norm", (config.q_size,))
            add("k_norm", (config.kv_size,))
        if not config.sparse_layers[i]:
            F = config.intermediate_size
            add("gate_proj", (F, D))
            add("up_proj", (F, D))
            add("down_proj", (D, F))
            continue
        add("router", (config.num_experts, D))
        if config.shared_expert_intermediate_size:
            Fs = config.shared_expert_intermediate_size
            add("shared_gate_proj", (Fs, D))
            add("shared_up_proj", (Fs, D))
            add("shared_down_proj", (D, Fs))
            add("shared_expert_gate", (1, D))
        F = config.moe_intermediate_size
        for j in range(config.num_experts):
            add("expert_gate_proj", (F, D), expert=j)
            add("expert_up_proj", (F, D), expert=j)
            add("expert_down_proj", (D, F), expert=j)
    specs.append(TensorSpec("final_norm", names["final_norm"], (D,)))
    if not config.tie_word_embeddings:
        specs.append(TensorSpec("lm_head", names["lm_head"], (V, D)))
    return specs
