"""config.json values the model config must refuse in one line rather than crash on or misread: rope settings of
the wrong type or that would divide by zero, and flags written as strings."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from common.models import config_from_hf
from expert_service.tools.tiny_model import tiny_hf_config


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(rope_scaling=[1, 2]), "rope_scaling must be an object, got [1, 2]"),
        (dict(rope_scaling="linear"), "rope_scaling must be an object, got 'linear'"),
        (dict(rope_parameters=[1]), "rope_parameters must be an object, got [1]"),
        (dict(rope_scaling={"rope_type": "linear", "factor": "abc"}), "rope setting factor must be a finite number, got 'abc'"),
        (dict(rope_scaling={"rope_type": "linear", "factor": "2"}), "rope setting factor must be a finite number, got '2'"),
        (dict(rope_parameters={"rope_theta": "x"}), "rope setting rope_theta must be a finite number, got 'x'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": "1"}), "rope setting attention_factor must be a finite number"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": "false"}), "rope setting truncate must be true or false, got 'false'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}), "rope type yarn needs original_max_position_embeddings > 0, got 0"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}), "rope llama3 needs 0 < low_freq_factor < high_freq_factor, got 4.0 and 4.0"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512.5}), "rope setting original_max_position_embeddings must be an integer, got 512.5"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": -43.4}), "rope yarn needs mscale and mscale_all_dim >= 0, got 1.0 and -43.4"),
        (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
        (dict(norm_topk_prob=1), "norm_topk_prob must be true or false, got 1"),
        (dict(attention_bias="true"), "attention_bias must be true or false, got 'true'"),
        (dict(use_sliding_window="no"), "use_sliding_window must be true or false, got 'no'"),
        (dict(use_sliding_window=True, sliding_window=8, layer_types=["linear_attention", "full_attention"]), "layer_types[0] must be sliding_attention or full_attention, got 'linear_attention'"),
        (dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]), "layer_types must list one kind per layer (2), got ['full_attention']"),
    ],
)  # fmt: skip
def test_malformed_values_are_one_line_config_errors(change, message):
    with pytest.raises(ConfigError) as raised:
        config_from_hf({**tiny_hf_config("qwen2_moe"), **change})
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_well_formed_rope_settings_still_load():
    llama3 = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "truncate": False}
    for scaling in (llama3, yarn, {"rope_type": "linear", "factor": 2.0, "beta_fast": None}):
        rope = config_from_hf({**tiny_hf_config("qwen3_moe"), "rope_scaling": scaling}).rope
        inv_freq, _ = rope.inverse_frequencies(24)
        assert rope.rope_type == scaling.get("rope_type", scaling.get("type"))
        assert inv_freq.shape == (12,) and (inv_freq > 0).all()
    assert config_from_hf({**tiny_hf_config("mixtral"), "tie_word_embeddings": True}).tie_word_embeddings


def test_layer_types_choose_the_sliding_layers():
    hf = {**tiny_hf_config("qwen2_moe"), "use_sliding_window": True, "sliding_window": 8}
    config = config_from_hf({**hf, "layer_types": ["full_attention", "sliding_attention"]})
    assert config.sliding_windows == (None, 8)


def test_qwen3_moe_slides_every_layer():
    """As transformers' Qwen3-MoE does: its attention reads neither layer_types nor max_window_layers."""
    hf = {**tiny_hf_config("qwen3_moe"), "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    assert config_from_hf({**hf, "layer_types": ["full_attention", "sliding_attention"]}).sliding_windows == (8, 8)
    assert config_from_hf({**hf, "use_sliding_window": False}).sliding_windows == (None, None)


def test_yarn_zero_betas_take_the_defaults():
    """transformers reads `beta_fast or 32` and `beta_slow or 1`; 0 used to divide by zero at load."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    zero = config_from_hf({**tiny_hf_config("qwen3_moe"), "rope_scaling": {**yarn, "beta_fast": 0, "beta_slow": 0}})
    plain = config_from_hf({**tiny_hf_config("qwen3_moe"), "rope_scaling": yarn})
    assert (zero.rope.inverse_frequencies(24)[0] == plain.rope.inverse_frequencies(24)[0]).all()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta"])
def test_a_null_eps_or_theta_is_refused_naming_the_default(family, key):
    """rms_norm_eps: null was a TypeError traceback; rope_theta: null ran the generic 1e4 where an absent key means
    the family's (Mixtral: 1e6). A theta in rope_parameters still counts."""
    hf = {k: v for k, v in tiny_hf_config(family).items() if k not in ("rope_parameters", "rope_scaling")}
    with pytest.raises(
        ConfigError, match=rf"^config\.json: {key} is null; leave it out for {family}'s default \("
    ) as e:
        config_from_hf({**hf, key: None})
    assert "\n" not in str(e.value)
    if key == "rope_theta":
        assert config_from_hf({**hf, key: None, "rope_parameters": {"rope_theta": 5e5}}).rope.theta == 5e5
