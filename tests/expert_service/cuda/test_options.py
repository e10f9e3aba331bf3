"""CudaOptions reach the decoder through EngineConfig: the shipped paths by default, a config file's mapping
checked field by field (no GPU)."""

import pytest

from common.config import resolve
from common.errors import ConfigError
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import CudaOptions


def test_every_option_defaults_to_the_shipped_path():
    assert EngineConfig().cuda_options == CudaOptions()
    assert all(getattr(CudaOptions(), name) is True for name in CudaOptions.__dataclass_fields__)


def test_a_config_file_mapping_becomes_options():
    config = resolve(EngineConfig, file_values={"cuda_options": {"greedy_split": False, "fused_router": False}}, env={})
    assert config.cuda_options == CudaOptions(greedy_split=False, fused_router=False)


@pytest.mark.parametrize(
    "value,message",
    [
        ({"greedy": False}, "cuda_options: unknown option 'greedy' (known: fused_combine_norm,"),
        ({"greedy_split": "no"}, "cuda_options.greedy_split: must be true or false, got 'no'"),
        ("fast", "cuda_options: must be a mapping of CudaOptions fields, got 'fast'"),
    ],
)
def test_a_bad_config_file_value_is_one_line_naming_it(value, message):
    with pytest.raises(ConfigError) as error:
        resolve(EngineConfig, file_values={"cuda_options": value}, env={})
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
