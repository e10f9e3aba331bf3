"""CudaOptions reach the decoder through EngineConfig: the shipped paths by default, a config file's mapping
checked field by field (no GPU)."""

from dataclasses import fields

import pytest

from common.config import resolve
from common.errors import ConfigError
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import EXPERIMENTAL, CudaOptions


def test_every_option_defaults_to_the_shipped_path():
    assert EngineConfig().cuda_options == CudaOptions()
    switches = [f.name for f in fields(CudaOptions) if f.type in (bool, "bool")]
    shipped = [name for name in switches if name not in EXPERIMENTAL]
    assert shipped and all(getattr(CudaOptions(), name) is True for name in shipped)
    # experimental switches are off; an experimental level (programmatic_launch) is 0
    assert EXPERIMENTAL <= {f.name for f in fields(CudaOptions)}
    assert all(getattr(CudaOptions(), name) in (False, 0) for name in EXPERIMENTAL)
    assert all(name in switches or getattr(CudaOptions(), name) == 0 for name in EXPERIMENTAL)


def test_the_programmatic_launch_level_is_checked():
    config = resolve(EngineConfig, file_values={"cuda_options": {"programmatic_launch": 2}}, env={})
    assert config.cuda_options.programmatic_launch == 2
    for bad in (3, -1, True, "yes"):
        with pytest.raises(ConfigError) as error:
            resolve(EngineConfig, file_values={"cuda_options": {"programmatic_launch": bad}}, env={})
        assert "cuda_options.programmatic_launch" in str(error.value) and "\n" not in str(error.value)


def test_thresholds_come_from_a_config_file_and_are_checked():
    config = resolve(EngineConfig, file_values={"cuda_options": {"q8_mma_min_tokens": 17}}, env={})
    assert config.cuda_options == CudaOptions(q8_mma_min_tokens=17)
    for bad in (0, -3, True, 2.5, "0"):
        with pytest.raises(ConfigError) as error:
            resolve(EngineConfig, file_values={"cuda_options": {"q8_mma_max_tokens": bad}}, env={})
        got = 0 if bad == "0" else bad
        assert str(error.value) == f"cuda_options.q8_mma_max_tokens: must be a positive integer, got {got!r}"
    for name in ("attention_8bit_dense_rows", "grouped_mma_max_tokens_few_experts"):  # 0: never
        config = resolve(EngineConfig, file_values={"cuda_options": {name: 0}}, env={})
        assert getattr(config.cuda_options, name) == 0
        with pytest.raises(ConfigError) as error:
            resolve(EngineConfig, file_values={"cuda_options": {name: -1}}, env={})
        assert str(error.value) == f"cuda_options.{name}: must be an integer >= 0, got -1"
    config = resolve(EngineConfig, file_values={"cuda_options": {"decode_part_keys": 96}}, env={})
    assert config.cuda_options.decode_part_keys == 96  # whole key tiles of 32
    for bad in (0, 16, 48, -32, True):
        with pytest.raises(ConfigError) as error:
            resolve(EngineConfig, file_values={"cuda_options": {"decode_part_keys": bad}}, env={})
        assert str(error.value) == f"cuda_options.decode_part_keys: must be a positive multiple of 32, got {bad!r}"
    # a YAML file's values arrive as the text written, read by the settings' rule for numbers
    config = resolve(EngineConfig, file_values={"cuda_options": {"q8_mma_max_tokens": "8"}}, env={})
    assert config.cuda_options.q8_mma_max_tokens == 8
    with pytest.raises(ConfigError, match=r"^cuda_options.q8_mma_max_tokens: cannot read '0x10' as int$"):
        resolve(EngineConfig, file_values={"cuda_options": {"q8_mma_max_tokens": "0x10"}}, env={})


def test_a_config_file_mapping_becomes_options():
    values = {"greedy_split": False, "fused_router": False, "cached_gemv": False}
    config = resolve(EngineConfig, file_values={"cuda_options": values}, env={})
    assert config.cuda_options == CudaOptions(greedy_split=False, fused_router=False, cached_gemv=False)


@pytest.mark.parametrize(
    "value,message",
    [
        (
            {"greedy": False},
            "cuda_options: unknown option 'greedy' (known: " + ", ".join(sorted(f.name for f in fields(CudaOptions))),
        ),
        ({"greedy_split": "maybe"}, "cuda_options.greedy_split: cannot read 'maybe' as bool"),
        ({"greedy_split": 0}, "cuda_options.greedy_split: must be true or false, got 0"),
        ("fast", "cuda_options: must be a mapping of CudaOptions fields, got 'fast'"),
    ],
)
def test_a_bad_config_file_value_is_one_line_naming_it(value, message):
    with pytest.raises(ConfigError) as error:
        resolve(EngineConfig, file_values={"cuda_options": value}, env={})
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
