"""common.config: a config file's value that the setting's type cannot hold exactly is refused in one line, not
truncated (a YAML 2.5 for an int setting was read as 2, `true` as 1)."""

from __future__ import annotations

import pytest

from common.config import resolve
from common.errors import ConfigError
from expert_service.engine.config import EngineConfig


@pytest.mark.parametrize(
    "key, value",
    [("expert_cache_slots", 2.5), ("expert_cache_slots", True), ("expert_cache_gb", True), ("kv_block_size", 16.5)],
)
def test_file_values_a_number_setting_cannot_hold_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"^config file: {key}: cannot read {value!r} as ") as error:
        resolve(EngineConfig, file_values={key: value}, env={})
    assert "\n" not in str(error.value)


def test_whole_numbers_still_read():
    config = resolve(EngineConfig, file_values={"expert_cache_slots": 2.0, "expert_cache_gb": 1}, env={})
    assert config.expert_cache_slots == 2 and type(config.expert_cache_slots) is int
    assert config.expert_cache_gb == 1.0
    assert resolve(EngineConfig, env={"COLIBRI_EXPERT_CACHE_SLOTS": "3"}).expert_cache_slots == 3
