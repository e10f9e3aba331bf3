"""EngineConfig's expert-cache settings as a careless operator gives them: every bad value is refused in one line
naming the setting, and every accepted one can be planned and reported."""

from __future__ import annotations

import math

import pytest

from common.config import resolve
from common.errors import ConfigError
from common.model_format import ModelDir
from expert_service.engine.config import MAX_EXPERT_CACHE_GB, EngineConfig
from expert_service.experts.slots import plan_slots
from expert_service.serving import wire


@pytest.mark.parametrize("gb", [1e11, 1e300, MAX_EXPERT_CACHE_GB, -1.0, math.nan, math.inf])
def test_a_budget_whose_bytes_cannot_be_held_or_reported_is_refused_in_one_line(gb):
    """1e300 GiB overflowed to an infinite float when planned (a traceback), 1e11 GiB to more bytes than Info's
    uint64 budget_bytes holds (Info failed with "Value out of range" once the worker was up)."""
    with pytest.raises(ConfigError, match=r"^expert_cache_gb: must be") as error:
        EngineConfig(expert_cache_gb=gb)
    assert "\n" not in str(error.value)


def test_the_same_from_the_environment_names_the_setting():
    with pytest.raises(ConfigError, match=r"^expert_cache_gb: must be below 2\^33 GiB"):
        resolve(EngineConfig, env={"COLIBRI_EXPERT_CACHE_GB": "1e300"})


@pytest.mark.parametrize("gb", [1e9, math.nextafter(MAX_EXPERT_CACHE_GB, 0)])
def test_the_largest_budgets_plan_every_expert_resident_and_report_in_info(tiny_model, gb):
    config = EngineConfig(expert_cache_gb=gb)
    model = ModelDir.open(tiny_model)
    plan = plan_slots(model, config.expert_cache_gb, config.expert_cache_slots)
    assert not plan.is_cached and plan.slots_per_layer == model.config.num_experts
    assert wire.slot_plan(plan, config.expert_cache_policy, config.prefetch_sources).budget_bytes == plan.budget_bytes


@pytest.mark.parametrize(
    ("name", "given", "expected"),
    [("expert_cache_policy", "LFU", "lfu"), ("expert_cache_policy", " Lru ", "lru"), ("prefetch", "PLAN", "plan")],
)
def test_the_cache_policy_and_prefetch_are_read_case_insensitively_like_the_enum_settings(name, given, expected):
    """--backend CUDA and --routing LUT were accepted while --expert-cache-policy LFU and --prefetch PLAN were
    refused: the flag, the environment and the config file all read them the same way now."""
    env_var = {"expert_cache_policy": "COLIBRI_EXPERT_CACHE_POLICY", "prefetch": "COLIBRI_PREFETCH"}[name]
    for config in (
        resolve(EngineConfig, env={}, flags={name: given}),
        resolve(EngineConfig, env={env_var: given}),
        resolve(EngineConfig, env={}, file_values={name: given}),
    ):
        assert getattr(config, name) == expected
    assert resolve(EngineConfig, env={}, flags={"prefetch": "Plan,LOOKAHEAD"}).prefetch_sources == {
        "plan",
        "lookahead",
    }


def test_cuda_options_from_a_yaml_config_file_are_read_as_settings_are(tmp_path):
    """A --config YAML file's values arrive as the text written; the cuda_options mapping reads its switches and
    thresholds by the settings' rules (a YAML false or 4 once arrived as a bool and an int), and refuses what they
    refuse, naming the option."""
    from common.config import load_config_file

    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  cuda_options: {greedy_split: false, fused_router: On, q8_mma_min_tokens: 4}\n")
    options = EngineConfig(**load_config_file(path, "engine")).cuda_options
    assert (options.greedy_split, options.fused_router, options.q8_mma_min_tokens) == (False, True, 4)
    for written, why in (
        ("greedy_split: maybe", "greedy_split: cannot read"),
        ("w8a8_min_rows: 0x10", "w8a8_min_rows: cannot read"),
    ):
        path.write_text(f"engine:\n  cuda_options: {{{written}}}\n")
        with pytest.raises(ConfigError, match=f"cuda_options.{why}"):
            EngineConfig(**load_config_file(path, "engine"))
    with pytest.raises(ConfigError, match="greedy_split: must be true or false, got 1"):
        EngineConfig(cuda_options={"greedy_split": 1})  # JSON's 1 is no switch
