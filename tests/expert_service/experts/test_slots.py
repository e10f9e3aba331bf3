"""plan_slots: how many expert slots each MoE layer gets from --expert-cache-gb / --expert-cache-slots, on bf16,
int8 and mixed-dtype models whose layers have different expert strides."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from common.model_format import ModelDir
from expert_service.experts.slots import GIB, plan_slots
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, ModelDir]:
    """The tiny mixtral (2 MoE layers of 4 experts) with bf16, int8, and int8-in-layer-0-only experts."""
    tmp = tmp_path_factory.mktemp("slots")
    hf = write_tiny_checkpoint(tmp / "hf", "mixtral", seed=1)
    (tmp / "mixed.yaml").write_text("default: bfloat16\nlayers: {0: int8}\n")
    kinds = {
        "bf16": dict(expert_dtype="bfloat16"),
        "int8": dict(expert_dtype="int8"),
        "mixed": dict(expert_dtype_file=tmp / "mixed.yaml"),
    }
    return {name: ModelDir.open(convert(hf, tmp / name, "bfloat16", False, **kw)) for name, kw in kinds.items()}


def slot_row_bytes(model: ModelDir) -> int:
    """One slot in every MoE layer, each at its layer's own stride (what the device allocates)."""
    return sum(model.expert_strides[layer] for layer in model.config.moe_layers)


def test_the_layers_really_differ(models):
    mixed = models["mixed"]
    assert mixed.expert_strides[0] < mixed.expert_strides[1] == models["bf16"].expert_strides[1]
    assert models["int8"].expert_strides[0] == mixed.expert_strides[0]


@pytest.mark.parametrize("name", ["bf16", "int8", "mixed"])
def test_a_budget_gives_as_many_slots_as_it_holds_and_never_more(models, name):
    """Every budget from one slot row to beyond every expert, byte by byte around each whole number of rows: the
    slots fit the budget at each layer's own stride, and one more slot in every layer would not."""
    model = models[name]
    row, experts = slot_row_bytes(model), model.config.num_experts
    for rows in range(1, experts + 2):
        for budget in (rows * row - 1, rows * row, rows * row + row // 2):
            if budget < row:
                continue
            plan = plan_slots(model, budget / GIB, 0)
            assert plan.budget_bytes <= budget  # never rounded up
            assert 1 <= plan.slots_per_layer <= experts
            assert plan.slots_per_layer * row <= plan.budget_bytes, (name, budget, plan)
            if plan.slots_per_layer < experts:
                assert (plan.slots_per_layer + 1) * row > plan.budget_bytes, (name, budget, plan)
            assert plan.is_cached == (plan.budget_bytes < experts * row)


def test_a_budget_holding_every_expert_of_a_mixed_model_keeps_them_resident(models):
    """The int8 layer's experts take less room than the bf16 one's: the budget of both experts files is enough."""
    model = models["mixed"]
    plan = plan_slots(model, model.config.num_experts * slot_row_bytes(model) / GIB, 0)
    assert not plan.is_cached and plan.slots_per_layer == model.config.num_experts


def test_int8_experts_fit_about_twice_as_many_slots_as_bf16_in_the_same_budget(models):
    budget = 2 * slot_row_bytes(models["bf16"])  # half the bf16 experts
    bf16, int8 = (plan_slots(models[n], budget / GIB, 0).slots_per_layer for n in ("bf16", "int8"))
    assert bf16 == 2 and int8 == 3  # 4096-byte strides: an int8 block of this tiny shape takes 20480 of 36864


@pytest.mark.parametrize("budget_bytes", [1, 1000, "row - 1"])
def test_a_budget_below_one_slot_per_layer_is_refused_in_one_line(models, budget_bytes):
    """Not one slot the budget cannot hold, and not every expert resident because it rounds to 0 bytes."""
    model = models["mixed"]
    row = slot_row_bytes(model)
    gb = (row - 1 if budget_bytes == "row - 1" else budget_bytes) / GIB
    with pytest.raises(ConfigError, match=rf"^expert_cache_gb: .*needs {row} bytes") as error:
        plan_slots(model, gb, 0)
    assert "\n" not in str(error.value)


def test_explicit_slots(models):
    model = models["mixed"]
    row = slot_row_bytes(model)
    assert plan_slots(model, 0, 3).slots_per_layer == 3
    assert plan_slots(model, 0, 4).slots_per_layer == 4 and not plan_slots(model, 0, 4).is_cached
    assert plan_slots(model, 3 * row / GIB, 3).slots_per_layer == 3  # both given: the slots fit the budget


def test_more_slots_than_experts_are_refused_in_one_line(models):
    with pytest.raises(ConfigError, match=r"^expert_cache_slots: 5 .*4 experts") as error:
        plan_slots(models["bf16"], 0, 5)
    assert "\n" not in str(error.value)


def test_explicit_slots_over_a_given_budget_are_refused_in_one_line(models):
    model = models["mixed"]
    row = slot_row_bytes(model)
    with pytest.raises(ConfigError, match=r"^expert_cache_slots: 3 .*holds 2") as error:
        plan_slots(model, (3 * row - 1) / GIB, 3)
    assert "\n" not in str(error.value)


def test_the_plan_states_what_a_budget_came_to(models):
    """A budget is floored to whole slots per layer, and one holding every expert runs no cache: the start-up log
    line (SlotPlan.describe) says so, with the bytes the slots take and what is left of the budget."""
    model = models["mixed"]
    row, experts = slot_row_bytes(model), model.config.num_experts
    budget = 2 * row + row // 2
    line = plan_slots(model, budget / GIB, 0).describe()
    assert f"2 of {experts} slots in each of 2 MoE layers, {2 * row} bytes" in line, line
    assert f"({budget} bytes)" in line and f"{budget - 2 * row} bytes of the budget unused" in line, line
    line = plan_slots(model, (experts + 1) * row / GIB, 0).describe()
    assert line.startswith(f"expert cache: off, all {experts} experts") and f"{experts * row} bytes" in line, line
    assert plan_slots(model, 0, 0).describe().endswith("; no --expert-cache-gb)")
    assert "no --expert-cache-gb" in plan_slots(model, 0, 3).describe()


@pytest.fixture(scope="module")
def dense_only(tmp_path_factory) -> ModelDir:
    """A Qwen2-MoE checkpoint whose every layer is in mlp_only_layers: experts in its config, no MoE layer."""
    import json

    from safetensors.numpy import save

    from expert_service.tools.tiny_model import tiny_hf_config, tiny_weights

    tmp = tmp_path_factory.mktemp("dense")
    hf = write_tiny_checkpoint(tmp / "hf", "qwen2_moe")
    config = {**tiny_hf_config("qwen2_moe"), "mlp_only_layers": [0, 1]}
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "model.safetensors").write_bytes(save(tiny_weights(config), metadata={"format": "pt"}))
    return ModelDir.open(convert(hf, tmp / "model", "bfloat16", False))


@pytest.mark.parametrize("gb,slots", [(0, 1), (0, 3), (0.001, 1), (0.001, 0)])
def test_a_model_without_moe_layers_has_nothing_to_cache_whatever_the_settings(dense_only, gb, slots):
    """--expert-cache-slots below the experts of a model with no MoE layer planned a cache of zero layers, and the
    cpu backend's copy engine then failed on its first MoE layer (an IndexError traceback before any step)."""
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    assert dense_only.config.moe_layers == [] and dense_only.config.num_experts == 4
    plan = plan_slots(dense_only, gb, slots)
    assert not plan.is_cached and plan.num_moe_layers == 0
    assert plan.describe().startswith("expert cache: off"), plan.describe()
    config = EngineConfig(backend="cpu", kv_cache_tokens=256, expert_cache_gb=gb, expert_cache_slots=slots)
    engine = build_engine(dense_only, config)
    try:
        assert engine.slot_plan == plan
    finally:
        engine.close()
