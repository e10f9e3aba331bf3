"""config.json variants of the four families against transformers: each one Colibri accepts must give HF's
logits and greedy tokens on the CPU backend. The reference is what transformers makes of the very
config.json file that `colibri convert` reads (the edits below are applied to the saved file, then HF reloads
it), so keys a config class does not declare, absent keys (class defaults) and legacy `rope_scaling`
entries are compared as a checkpoint on disk would have them."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
import transformers

from common.model_format import ModelDir
from common.models import config_from_hf
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.convert import convert
from tests.helpers import rel_error
from tests.hf_reference import CONFIG_CLASSES, hf_greedy, hf_logits, make_hf_model, save_and_convert

TOLERANCE = 1e-4  # test_parity_hf's
VOCAB = 211

BASE = {
    "mixtral": dict(
        hidden_size=48,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        hidden_size=48,
        intermediate_size=36,
        moe_intermediate_size=20,
        shared_expert_intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=5,
        num_experts_per_tok=2,
    ),
    "qwen3_moe": dict(
        hidden_size=48,
        intermediate_size=36,
        moe_intermediate_size=20,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=5,
        num_experts_per_tok=2,
    ),
    "olmoe": dict(
        hidden_size=48,
        intermediate_size=36,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=5,
        num_experts_per_tok=2,
    ),
}


def legacy_rope(scaling: dict | None = None, theta: float = 10000.0, **top) -> Callable[[dict], None]:
    """The hub's spelling: `rope_theta` (+ `rope_scaling`, + keys beside them) instead of `rope_parameters`."""

    def edit(cfg: dict) -> None:
        cfg.pop("rope_parameters", None)
        cfg.update(rope_theta=theta, **top)
        if scaling is not None:
            cfg["rope_scaling"] = scaling

    return edit


def drop(*keys: str) -> Callable[[dict], None]:
    return lambda cfg: [cfg.pop(k, None) for k in keys] and None


def update(**values) -> Callable[[dict], None]:
    return lambda cfg: cfg.update(values)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# name: (family, constructor overrides, edit of the saved config.json or None)
CASES: dict[str, tuple[str, dict, Callable[[dict], None] | None]] = {
    # Qwen3-MoE's attention and mask slide every layer when use_sliding_window (no max_window_layers there)
    "qwen3_moe-sliding": ("qwen3_moe", dict(num_hidden_layers=3), update(use_sliding_window=True, sliding_window=5)),
    "qwen3_moe-sliding-max-window-layers": (
        "qwen3_moe",
        dict(num_hidden_layers=3),
        update(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen2_moe-sliding-max-window-layers": (
        "qwen2_moe",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        None,
    ),
    "qwen2_moe-sliding-layer-types": (
        "qwen2_moe",
        dict(num_hidden_layers=3),
        update(
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        ),
    ),
    # Absent keys take the config class's defaults: Mixtral's rope_theta is 1e6, Mixtral's and OLMoE's eps 1e-5
    "mixtral-no-rope-theta": ("mixtral", {}, drop("rope_parameters", "rope_theta")),
    "mixtral-no-rms-norm-eps": ("mixtral", dict(rms_norm_eps=0.3), drop("rms_norm_eps")),
    "olmoe-no-rms-norm-eps": ("olmoe", dict(rms_norm_eps=0.3), drop("rms_norm_eps")),
    "qwen2_moe-no-rope-theta": ("qwen2_moe", {}, drop("rope_parameters", "rope_theta")),
    # yarn's attention factor from mscale / mscale_all_dim (DeepSeek's spelling)
    "olmoe-yarn-mscale": (
        "olmoe",
        {},
        update(rope_parameters={"rope_theta": 10000.0, **YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),
    ),
    "qwen3_moe-yarn-mscale-legacy": ("qwen3_moe", {}, legacy_rope({**YARN, "mscale": 1.0, "mscale_all_dim": 0.5})),
    "qwen3_moe-yarn-mscale-alone": ("qwen3_moe", {}, legacy_rope({**YARN, "mscale": 2.0})),
    # a top-level original_max_position_embeddings wins over the rope entry's (Phi-3's spelling)
    "qwen3_moe-yarn-top-level-original": (
        "qwen3_moe",
        {},
        legacy_rope({"rope_type": "yarn", "factor": 4.0}, original_max_position_embeddings=64),
    ),
    "mixtral-llama3-top-level-original": (
        "mixtral",
        {},
        legacy_rope(LLAMA3, theta=500.0, original_max_position_embeddings=64),
    ),
    "qwen2_moe-yarn-attention-factor": (
        "qwen2_moe",
        {},
        update(rope_parameters={"rope_theta": 10000.0, **YARN, "attention_factor": 0.8, "beta_fast": 16.0}),
    ),
    "qwen2_moe-linear-legacy": ("qwen2_moe", {}, legacy_rope({"type": "linear", "factor": 2.0}, theta=500.0)),
    "qwen3_moe-llama3": (
        "qwen3_moe",
        {},
        update(rope_parameters={"rope_theta": 10000.0, **LLAMA3, "original_max_position_embeddings": 64}),
    ),
    # head_dim other than hidden_size / num_attention_heads (Qwen2-MoE's config class keeps it as an extra key)
    "mixtral-head-dim": ("mixtral", dict(head_dim=16), None),
    "qwen2_moe-head-dim": ("qwen2_moe", dict(head_dim=16), None),
    "mixtral-tied": ("mixtral", dict(tie_word_embeddings=True), None),
    "qwen3_moe-tied-bias": ("qwen3_moe", dict(tie_word_embeddings=True, attention_bias=True), None),
    "olmoe-bias-mha": ("olmoe", dict(attention_bias=True, num_key_value_heads=4), None),
    "qwen2_moe-no-qkv-bias-mqa": ("qwen2_moe", dict(qkv_bias=False, num_key_value_heads=1), None),
    "qwen2_moe-sparse-step-mlp-only": (
        "qwen2_moe",
        dict(num_hidden_layers=4, decoder_sparse_step=3, mlp_only_layers=[2, 7]),
        None,
    ),
    # training-only keys: no effect in eval
    "mixtral-dropout-jitter": (
        "mixtral",
        dict(attention_dropout=0.5, router_jitter_noise=0.5, output_router_logits=True),
        None,
    ),
}


def hf_and_engine(name: str, tmp_path):
    family, overrides, edit = CASES[name]
    hf = make_hf_model(family, {**BASE[family], **overrides}, seed=sorted(CASES).index(name))
    if edit is not None:  # edit the saved file, then let transformers read it back as a user would
        hf_dir = tmp_path / "hf"
        hf.save_pretrained(hf_dir)
        config = json.loads((hf_dir / "config.json").read_text())
        edit(config)
        (hf_dir / "config.json").write_text(json.dumps(config))
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    if edit is None:
        model_dir = save_and_convert(hf, tmp_path)
    else:  # convert the edited file, not a re-save of what transformers made of it
        model_dir = convert(tmp_path / "hf", tmp_path / "model", progress=False)
    engine = build_engine(ModelDir.open(model_dir), EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=512))
    return hf, engine


@pytest.mark.parametrize("name", sorted(CASES))
def test_variant_matches_transformers(name, tmp_path):
    hf, engine = hf_and_engine(name, tmp_path)
    ids = np.random.default_rng(7).integers(0, VOCAB, size=24).tolist()  # past every window above
    err = rel_error(engine.prompt_logits(ids), hf_logits(hf, ids))
    assert err <= TOLERANCE, f"{name}: prefill logits relative error {err:.2e} > {TOLERANCE}"
    assert engine.generate(ids[:6], max_new_tokens=10)[0] == hf_greedy(hf, ids[:6], 10), name


@pytest.mark.parametrize("family", sorted(BASE))
def test_absent_keys_mean_what_the_transformers_config_class_says(family):
    """Only the keys every family requires: the rest (eps, rope theta, kv heads, sliding windows and
    max_window_layers with use_sliding_window) take the config class's defaults, which differ by family."""
    required = ("vocab_size", "hidden_size", "num_attention_heads", "max_position_embeddings")
    required += (
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
    )
    hf_class = CONFIG_CLASSES[family]
    minimal = {k: v for k, v in hf_class().to_dict().items() if k in required}
    minimal.update(model_type=family, num_hidden_layers=30, use_sliding_window=True)
    ref, ours = hf_class(**minimal), config_from_hf(minimal)
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.rope.theta == ref.rope_parameters["rope_theta"]
    assert ours.num_key_value_heads == ref.num_key_value_heads
    windows = getattr(ref, "layer_types", None) or ["sliding_attention"] * 30  # Qwen3-MoE / Mixtral: every layer
    window = getattr(ref, "sliding_window", None)  # OLMoE has none
    want = tuple(window if kind == "sliding_attention" else None for kind in windows)
    assert ours.sliding_windows == want
