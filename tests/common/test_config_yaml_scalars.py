"""A --config YAML file's plain values are read as the environment's text is. PyYAML follows YAML 1.1: 010 was the
octal 8, 0x10 16, 0b101 5 and 1:20 the sexagesimal 80 before any setting saw them, for a number setting and a
text one alike (a model named 010 was served as "8", one named yes as "True")."""

from __future__ import annotations

import dataclasses
import re

import pytest

from common.config import load_config_file, resolve
from common.errors import ConfigError
from expert_service.engine.config import EngineConfig
from router_service.config import RouterConfig

ROUTER = {"worker": "127.0.0.1:50052"}


def _from_file(tmp_path, cls, key: str, written: str):
    path = tmp_path / "colibri.yaml"
    path.write_text(f"{key}: {written}\n")
    return getattr(resolve(cls, file_values={**load_config_file(path, "router"), **ROUTER}, env={}), key)


def _env_name(cls, key: str) -> str:
    return next(f.metadata["env"][0] for f in dataclasses.fields(cls) if f.name == key)


def _from_env(cls, key: str, text: str):
    return getattr(resolve(cls, file_values=ROUTER, env={_env_name(cls, key): text}), key)


@pytest.mark.parametrize(
    "key, text, value",
    [
        ("max_batch_size", "010", 10),  # YAML 1.1: octal 8
        ("max_batch_size", "08", 8),
        ("max_batch_size", "+12", 12),
        ("max_batch_size", "0x10", None),  # YAML 1.1: 16
        ("max_batch_size", "0o10", None),
        ("max_batch_size", "0b101", None),  # YAML 1.1: 5
        ("max_batch_size", "1:20", None),  # YAML 1.1: 80
        ("max_batch_size", "1_000", None),  # YAML 1.1: 1000
        ("max_batch_size", "1.50", None),
        ("max_batch_size", "yes", None),  # YAML 1.1: true
        ("queue_timeout_s", "010", 10.0),  # YAML 1.1: 8.0
        ("queue_timeout_s", "1e1", 10.0),  # YAML 1.1: a string, read as 10 all the same
        ("queue_timeout_s", ".5", 0.5),
        ("queue_timeout_s", "0x10", None),
        ("queue_timeout_s", "1:20.5", None),  # YAML 1.1: 80.5
        ("queue_timeout_s", "1_0.5", None),
        ("queue_timeout_s", ".inf", None),  # YAML 1.1: infinity
    ],
)
def test_a_number_in_a_yaml_file_is_read_as_the_environment_reads_it(tmp_path, key, text, value):
    if value is None:
        refusal = re.escape(f"cannot read {text!r} as ")
        with pytest.raises(ConfigError, match=rf"^config file: {key}: {refusal}"):
            _from_file(tmp_path, RouterConfig, key, text)
        with pytest.raises(ConfigError, match=rf"^environment {_env_name(RouterConfig, key)}: {refusal}"):
            _from_env(RouterConfig, key, text)
        return
    assert _from_file(tmp_path, RouterConfig, key, text) == value == _from_env(RouterConfig, key, text)
    assert type(_from_file(tmp_path, RouterConfig, key, text)) is type(value)


@pytest.mark.parametrize(
    "text",
    ["010", "0x10", "0o10", "0b101", "1:20", "1_000", "1.50", "1e3", ".inf", "yes", "No", "off", "2024-01-02", "="],
)
def test_a_text_setting_keeps_the_text_as_written(tmp_path, text):
    assert _from_file(tmp_path, RouterConfig, "model_name", text) == text


def test_a_yaml_explicit_key_is_read(tmp_path):
    """'?' starting a token (an explicit key, or text such as ?x) raised a TypeError: the loader's key hook shadowed
    the YAML scanner's method of the same name."""
    path = tmp_path / "colibri.yaml"
    path.write_text("? model_name\n: m\n")
    assert load_config_file(path, "router") == {"model_name": "m"}
    assert _from_file(tmp_path, RouterConfig, "model_name", "?x") == "?x"


@pytest.mark.parametrize("text, value", [("yes", True), ("on", True), ("1", True), ("off", False), ("false", False)])
def test_a_switch_reads_the_environment_s_words(tmp_path, text, value):
    assert _from_file(tmp_path, RouterConfig, "warmup", text) is value is _from_env(RouterConfig, "warmup", text)


@pytest.mark.parametrize("text", ["", "~", "null", "Null"])
def test_yaml_null_is_still_no_value(tmp_path, text):
    with pytest.raises(ConfigError, match="^config file: model_name: no value"):
        _from_file(tmp_path, RouterConfig, "model_name", text)


@pytest.mark.parametrize("written", ["!!int 0x10", "!!float 1:20", "!!int 1_0"])
def test_an_explicit_tag_does_not_get_around_the_rule(tmp_path, written):
    text = written.split()[1]
    with pytest.raises(ConfigError, match=rf"^config file: expert_cache_slots: cannot read {re.escape(repr(text))}"):
        path = tmp_path / "colibri.yaml"
        path.write_text(f"engine:\n  expert_cache_slots: {written}\n")
        resolve(EngineConfig, file_values=load_config_file(path, "engine"), env={})


def test_quoted_text_and_nested_values_are_read_as_before(tmp_path):
    path = tmp_path / "colibri.yaml"
    path.write_text("router:\n  model_name: '010'\n  <<: {max_batch_size: 16}\nengine:\n  expert_cache_gb: 0.5\n")
    assert load_config_file(path, "router") == {"model_name": "010", "max_batch_size": "16"}
    config = resolve(RouterConfig, file_values={**load_config_file(path, "router"), **ROUTER}, env={})
    assert (config.model_name, config.max_batch_size) == ("010", 16)
    assert resolve(EngineConfig, file_values=load_config_file(path, "engine"), env={}).expert_cache_gb == 0.5
