"""config.json keys written but empty or zero (0, "", [], {}, false) are values to check, never taken for absent:
`x.get(key) or default` read them as missing and put a default, or another key's value, in their place."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from common.models import config_from_hf
from expert_service.tools.tiny_model import tiny_hf_config

FALSY = [0, "", [], {}, False]


def refused(hf: dict) -> str:
    with pytest.raises(ConfigError) as raised:
        config_from_hf(hf)
    message = str(raised.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("value", FALSY)
def test_a_qwen3_expert_count_of_zero_is_refused_not_replaced_by_num_local_experts(value):
    message = refused({**tiny_hf_config("qwen3_moe"), "num_experts": value, "num_local_experts": 4})
    assert message.startswith("config.json: num_experts must be"), message


def test_qwen3_expert_counts_under_both_names_must_agree():
    """Which of two spellings wins is up to the reader; neither is picked in silence."""
    hf = {**tiny_hf_config("qwen3_moe"), "num_local_experts": 4}
    assert config_from_hf({**hf, "num_experts": None}).num_experts == 4
    assert config_from_hf({**hf, "num_experts": 4}).num_experts == 4
    del hf["num_experts"]
    assert config_from_hf(hf).num_experts == 4
    message = refused({**hf, "num_experts": 8})
    assert message == "config.json: num_experts 8 and num_local_experts 4 disagree; give one of them", message


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("value", [v for v in FALSY if v != []])
def test_an_empty_but_not_list_mlp_only_layers_is_refused(family, value):
    message = refused({**tiny_hf_config(family), "mlp_only_layers": value})
    assert message == f"config.json: mlp_only_layers must be a list of layer indices, got {value!r}", message


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_an_empty_or_null_mlp_only_layers_keeps_every_layer_sparse(family):
    for value in ([], None):
        assert all(config_from_hf({**tiny_hf_config(family), "mlp_only_layers": value}).sparse_layers)


@pytest.mark.parametrize("value", [[], "", 0, False, {}])
def test_an_empty_layer_types_is_refused_not_replaced_by_the_default(value):
    hf = {**tiny_hf_config("qwen2_moe"), "use_sliding_window": True, "sliding_window": 8, "layer_types": value}
    message = refused(hf)
    assert message.startswith("config.json: layer_types must list one kind per layer (2), got"), message
    del hf["layer_types"]
    assert config_from_hf(hf).sliding_windows == (8, None)  # absent: the default
    assert config_from_hf({**hf, "layer_types": None}).sliding_windows == (8, None)


@pytest.mark.parametrize("key", ["num_key_value_heads", "head_dim", "decoder_sparse_step"])
@pytest.mark.parametrize("value", FALSY)
def test_a_zero_or_empty_count_is_refused_not_defaulted(key, value):
    message = refused({**tiny_hf_config("qwen2_moe"), key: value})
    assert message.startswith(f"config.json: {key} must be"), message
