"""Model families: one module per HF ``model_type``, each turning ``config.json`` into a ``ModelConfig``
and naming the checkpoint tensors behind Colibri's canonical tensor names.

Canonical names (what the manifest and the engine use):

    embed_tokens [V, D]    final_norm [D]    lm_head [V, D] (absent when tie_word_embeddings: tensor_specs lists
                           it only untied; an 8-bit head beside a tied embedding is common/head_format.py's)
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

import math
from dataclasses import dataclass
from types import ModuleType

from common.errors import ConfigError
from common.model_config import DEFAULT_ROPE_THETA, MAX_CONTEXT, MAX_VOCAB, ModelConfig, QKNorm
from common.models import mixtral, olmoe, qwen2_moe, qwen3_moe

FAMILIES: dict[str, ModuleType] = {
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe,
    "olmoe": olmoe,
}


def family_module(model_type: str | None) -> ModuleType:
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[model_type]


# Bounds on every numeric config.json key a family reads, checked before any of them sizes a loop, an
# array or a division: generous for real checkpoints, fatal for typos and hostile files.
_INT_BOUNDS = {
    "vocab_size": (1, MAX_VOCAB),
    "hidden_size": (1, 1 << 16),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1024),
    "intermediate_size": (0, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (0, 1 << 20),
    "num_experts": (1, 65535),
    "num_local_experts": (1, 65535),
    "num_experts_per_tok": (1, 65535),
    "max_position_embeddings": (1, MAX_CONTEXT),
    "decoder_sparse_step": (1, 1024),
    "sliding_window": (0, MAX_CONTEXT),
    "max_window_layers": (0, 1024),
}
_BOOL_KEYS = ("tie_word_embeddings", "qkv_bias", "attention_bias", "norm_topk_prob", "use_sliding_window")
_FLOAT_BOUNDS = {"rms_norm_eps": (0.0, 1.0), "rope_theta": (0.0, 1e12), "clip_qkv": (0.0, 1e30)}


def _check_numbers(hf: dict) -> None:
    for key, (lo, hi) in _INT_BOUNDS.items():
        value = hf.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config.json: {key} must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise ConfigError(f"config.json: {key} must be in [{lo}, {hi}], got {value}")
    for key, (low, high) in _FLOAT_BOUNDS.items():
        value = hf.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not low < value <= high
        ):
            raise ConfigError(f"config.json: {key} must be a finite number in ({low}, {high}], got {value!r}")
    for key in _BOOL_KEYS:  # bool("false") is True: a quoted flag would silently mean its opposite
        value = hf.get(key)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"config.json: {key} must be true or false, got {value!r}")
    for key in ("mlp_only_layers",):
        value = hf.get(key)
        value = [] if value is None else value  # "", 0, false or {} is no list of layers: refused, not read as none
        if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1024 for v in value
        ):
            raise ConfigError(f"config.json: {key} must be a list of layer indices, got {value!r}")
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = hf.get(key)
        for v in (value if isinstance(value, list) else [value]) if value is not None else []:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_VOCAB:
                raise ConfigError(f"config.json: {key} must be token ids in [0, vocab_size), got {value!r}")


def config_from_hf(hf: dict) -> ModelConfig:
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json: expected an object, got {type(hf).__name__}")
    module = family_module(hf.get("model_type"))
    # an absent key means what transformers' config class makes of it, and those defaults differ by family
    # null is no value (eps gave a TypeError, theta the generic 1e4), unless rope_parameters holds the theta
    for key in ("rms_norm_eps", "rope_theta"):
        given = isinstance(hf.get("rope_parameters"), dict) and hf["rope_parameters"].get(key) is not None
        if key in hf and hf[key] is None and not given:
            default = module.HF_DEFAULTS.get(key, DEFAULT_ROPE_THETA)  # every family names its eps
            raise ConfigError(
                f"config.json: {key} is null; leave it out for {hf['model_type']}'s default ({default:g})"
            )
    hf = {**module.HF_DEFAULTS, **hf}
    _check_numbers(hf)
    return module.config_from_hf(hf)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str  # canonical name
    hf_name: str  # name in the HF checkpoint
    shape: tuple[int, ...]
    layer: int | None = None
    expert: int | None = None  # set for routed-expert matrices (stored in the expert files)


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor a model of this config has, in storage order (experts: gate, up, down adjacent)."""
    names = family_module(config.family).HF_NAMES
    D, V = config.hidden_size, config.vocab_size
    specs = [TensorSpec("embed_tokens", names["embed_tokens"], (V, D))]
    for i in range(config.num_hidden_layers):

        def add(key: str, shape: tuple[int, ...], expert: int | None = None, i: int = i, **fmt):
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
