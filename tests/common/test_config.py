"""common.config: a config file's value that the setting's type cannot hold exactly is refused in one line, not
truncated (a YAML 2.5 for an int setting was read as 2, `true` as 1); a file's sections go each to its process, and
none is dropped unread."""

from __future__ import annotations

import re

import pytest

from common.config import load_config_file, resolve
from common.errors import ConfigError
from expert_service.engine.config import EngineConfig
from expert_service.serving.main import WorkerConfig
from router_service.config import RouterConfig


@pytest.mark.parametrize(
    "key, value",
    [("expert_cache_slots", 2.5), ("expert_cache_slots", True), ("expert_cache_gb", True), ("kv_block_size", 16.5)],
)
def test_file_values_a_number_setting_cannot_hold_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"^config file: {key}: cannot read {value!r} as ") as error:
        resolve(EngineConfig, file_values={key: value}, env={})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "cls, key",
    [(EngineConfig, "kv_block_size"), (EngineConfig, "prefetch"), (RouterConfig, "host"), (WorkerConfig, "port")],
)
def test_a_setting_left_without_a_value_is_refused(cls, key):
    """`kv_block_size:` with nothing after it is YAML null: it reached the dataclass as None, a traceback (a
    TypeError in its checks) or a bind of "None:0"."""
    with pytest.raises(ConfigError, match=rf"^config file: {key}: no value") as error:
        resolve(cls, file_values={key: None}, env={})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "key, value",
    [
        ("expert_cache_gb", "1_0"),
        ("expert_cache_slots", "1_6"),
        ("expert_cache_gb", "\u0661"),
        ("kv_block_size", "\u0661\u0666"),
        ("expert_cache_gb", "1e-400"),
    ],
)
def test_numbers_spelled_with_underscores_or_other_scripts_digits_are_refused(key, value):
    """float("1_0") is 10.0, int("١٦") is 16 and float("1e-400") is 0.0: a budget typed "1_0" silently meant ten
    GiB, and one of "1e-400" every expert resident."""
    env = {f"COLIBRI_{key.upper()}": value}
    for source in ({"file_values": {key: value}, "env": {}}, {"env": env}, {"flags": {key: value}, "env": {}}):
        with pytest.raises(ConfigError, match=rf"cannot read {re.escape(repr(value))} as (int|float)$"):
            resolve(EngineConfig, **source)


@pytest.mark.parametrize(
    "suffix, text, key, value",
    [
        (".yaml", "expert_cache_gb: 1_0\n", "expert_cache_gb", "1_0"),
        (".yaml", "expert_cache_slots: 1_6\n", "expert_cache_slots", "1_6"),
        (".yaml", "expert_cache_gb: 1_0.5\n", "expert_cache_gb", "1_0.5"),
        (".yaml", "expert_cache_gb: 1.0e-400\n", "expert_cache_gb", "1.0e-400"),
        (".json", '{"expert_cache_gb": 1e-400}', "expert_cache_gb", "1e-400"),
    ],
)
def test_a_config_files_numbers_are_held_to_the_same_rule(tmp_path, suffix, text, key, value):
    """YAML reads 1_0 as the number 10 and 1.0e-400 (JSON 1e-400) as 0.0 before the setting sees them: a file's
    budget of "1_0" still meant ten GiB, and one of "1.0e-400" every expert resident."""
    path = tmp_path / f"colibri{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^config file: {key}: cannot read {re.escape(repr(value))} as "):
        resolve(EngineConfig, file_values=load_config_file(path, "engine"), env={})
    path.write_text(text.replace(value, "0.5" if "gb" in key else "16"))  # plain numbers still read as before
    assert getattr(resolve(EngineConfig, file_values=load_config_file(path, "engine"), env={}), key) in (0.5, 16)


@pytest.mark.parametrize(
    "flag, value", [("--expert-cache-gb", "1_0"), ("--expert-cache-gb", "1e-400"), ("--expert-cache-slots", "\u0661")]
)
def test_a_flags_number_is_held_to_the_same_rule(flag, value, capsys):
    """argparse read a flag's number with float() or int() before the setting saw it: --expert-cache-gb 1_0 was
    10 GiB, 1e-400 every expert resident."""
    import argparse

    from expert_service.serving.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", flag, value])
    assert f"argument {flag}: invalid " in capsys.readouterr().err
    args = parser.parse_args(["--model", "m", "--expert-cache-gb", "1e-3", "--expert-cache-slots", " 5 "])
    assert (args.expert_cache_gb, args.expert_cache_slots) == (0.001, 5)


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}])
def test_a_list_or_mapping_for_a_text_setting_is_refused(value):
    """It was read as its Python spelling ("[1, 2]")."""
    with pytest.raises(ConfigError, match=rf"^config file: host: cannot read {re.escape(repr(value))} as str$"):
        resolve(RouterConfig, file_values={"host": value}, env={})


def test_whole_numbers_still_read():
    config = resolve(EngineConfig, file_values={"expert_cache_slots": 2.0, "expert_cache_gb": 1}, env={})
    assert config.expert_cache_slots == 2 and type(config.expert_cache_slots) is int
    assert config.expert_cache_gb == 1.0
    assert resolve(EngineConfig, env={"COLIBRI_EXPERT_CACHE_SLOTS": "3"}).expert_cache_slots == 3


# --- config file sections ------------------------------------------------------------------------------
def _write(tmp_path, text: str, name: str = "colibri.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_section_the_file_lacks_is_empty(tmp_path):
    """`colibri serve --config` gives one file to both processes: a worker must not read a file of `router:` and
    `engine:` sections whole (as settings named router and engine)."""
    path = _write(tmp_path, "router:\n  max_batch_tokens: 4096\nengine:\n  kv_block_size: 16\n")
    assert load_config_file(path, "worker") == {}
    assert load_config_file(path, "router") == {"max_batch_tokens": "4096"}  # as written: the setting reads it
    assert resolve(WorkerConfig, file_values=load_config_file(path, "worker"), env={}) == WorkerConfig()


def test_an_empty_section_is_empty(tmp_path):
    path = _write(tmp_path, "router:\nengine:\n  kv_block_size: 16\n")
    assert load_config_file(path, "router") == {}


@pytest.mark.parametrize("value", ["5", "[max_batch_tokens]", "max_batch_tokens=4096"])
def test_a_section_that_is_no_mapping_is_refused(tmp_path, value):
    """Its settings were silently dropped."""
    path = _write(tmp_path, f"router: {value}\nengine:\n  kv_block_size: 16\n")
    with pytest.raises(
        ConfigError, match=rf"^--config: {re.escape(str(path))}: section 'router' must hold a mapping"
    ) as error:
        load_config_file(path, "router")
    assert "\n" not in str(error.value)


def test_an_unknown_section_next_to_known_ones_is_refused(tmp_path):
    """A misspelt section was silently dropped by every process."""
    path = _write(tmp_path, '{"routr": {"max_batch_tokens": 4096}, "engine": {"kv_block_size": 16}}', "c.json")
    for section in ("router", "worker", "engine"):
        with pytest.raises(
            ConfigError, match=rf"^--config: {re.escape(str(path))}: unknown section 'routr' \(expected "
        ):
            load_config_file(path, section)


def test_a_file_without_sections_is_read_whole(tmp_path):
    # RouterConfig has a setting named worker (the worker's address): a string there is no section.
    path = _write(tmp_path, "worker: localhost:50052\nmax_batch_tokens: 4096\n")
    assert load_config_file(path, "router") == {"worker": "localhost:50052", "max_batch_tokens": "4096"}
    config = resolve(RouterConfig, file_values=load_config_file(path, "router"), env={})
    assert (config.worker, config.max_batch_tokens) == ("localhost:50052", 4096)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.mkdir(), "is not a file"),  # was "file ... not found": it is there
        (lambda p: p.write_bytes(b'{"router": {"port": 1}}\n\xff\n'), r"is not UTF-8 text \(byte 24\)"),  # a traceback
    ],
)
def test_a_config_path_that_cannot_be_read_as_text_is_one_line(tmp_path, make, message):
    path = tmp_path / "colibri.yaml"
    make(path)
    with pytest.raises(ConfigError, match=rf"^--config: {re.escape(str(path))} {message}$"):
        load_config_file(path, "router")


@pytest.mark.parametrize(
    "cls, values, message",
    [
        (RouterConfig, {"port": 9100, "metrics_port": 9100}, "router: metrics_port must differ from port (both 9100)"),
        (
            RouterConfig,
            {"http_port": 8000, "metrics_port": 8000, "metrics_host": "0.0.0.0"},
            "router: metrics_port must differ from http_port (both 8000)",
        ),
        (RouterConfig, {"port": 9100, "health_port": 9100}, "router: health_port must differ from port (both 9100)"),
        (
            RouterConfig,
            {"health_port": 9200, "http_port": 9200},
            "router: http_port must differ from health_port (both 9200)",
        ),
        (WorkerConfig, {"port": 50052, "health_port": 50052}, "health_port must differ from port (both 50052)"),
        (WorkerConfig, {"health_port": 9091}, "metrics_port must differ from health_port (both 9091)"),
    ],
)
def test_two_endpoints_of_a_process_on_one_port_are_refused_in_one_line(cls, values, message):
    """The second bind failed as 'in use' (exit 7), which named no setting and sent the operator looking for another
    process holding the port."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        cls(**{"worker": "127.0.0.1:50052", **values} if cls is RouterConfig else values)


def test_one_port_on_distinct_hosts_or_an_unused_port_is_no_clash():
    RouterConfig(worker="127.0.0.1:50052", host="127.0.0.2", port=9100, metrics_host="127.0.0.1", metrics_port=9100)
    WorkerConfig(socket="/run/colibri/worker.sock", port=50053, health_port=50053)  # the port is unused with a socket


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("colibri.yaml", "router:\n  max_batch_tokens: 4096\n  max_batch_tokens: 64\n", "duplicate key 'max_batch_tokens' (line 3, column 3)"),
        ("colibri.yaml", "router:\n  port: 1\nengine: {}\nrouter:\n  port: 2\n", "duplicate key 'router' (line 4, column 1)"),
        ("colibri.json", '{"router": {"port": 1, "port": 2}}', "duplicate key 'port'"),
    ],
)  # fmt: skip
def test_a_setting_given_twice_in_the_file_is_refused(tmp_path, name, text, message):
    """YAML and JSON keep the last of two values silently: the file's author meant one of them."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="^" + re.escape(f"--config: {path}: {message}") + "$"):
        load_config_file(path, "router")


def test_a_yaml_merge_may_still_override(tmp_path):
    """'<<' merges are how YAML shares settings; the key written beside one wins, by YAML's own rule."""
    path = tmp_path / "colibri.yaml"
    path.write_text("router:\n  <<: {port: 1, max_batch_tokens: 64}\n  port: 2\n")
    assert load_config_file(path, "router") == {"port": "2", "max_batch_tokens": "64"}


def test_two_yaml_merges_in_one_mapping_are_refused(tmp_path):
    """'<<' written twice in one mapping is a key written twice: PyYAML kept the first merge's values and dropped
    the second's (an override meant to win lost) without a word."""
    path = tmp_path / "colibri.yaml"
    path.write_text("router:\n  <<: {port: 1}\n  <<: {port: 2}\n")
    message = f"--config: {path}: duplicate key '<<' (line 3, column 3)"
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        load_config_file(path, "router")


def test_the_suffix_decides_yaml_whatever_its_case_and_other_names_are_told_so(tmp_path):
    """colibri.YAML was read as JSON ('Expecting value'); colibri.toml gets told which names are read as YAML."""
    path = tmp_path / "colibri.YAML"
    path.write_text("router:\n  port: 1\n")
    assert load_config_file(path, "router") == {"port": "1"}
    toml = tmp_path / "colibri.toml"
    toml.write_text("[router]\nport = 1\n")
    message = f"--config: {toml} is not valid JSON (names ending in .yaml or .yml are read as YAML): Expecting value"
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config_file(toml, "router")


@pytest.mark.parametrize("value", ["[1, 2]", "5"])
def test_a_lone_router_or_engine_key_that_is_no_mapping_is_a_section_refused(tmp_path, value):
    """With no other section beside it, the file was read whole: 'unknown setting 'router' for RouterConfig'."""
    for section in ("router", "engine"):
        path = _write(tmp_path, f"{section}: {value}\n")
        with pytest.raises(ConfigError, match=rf"^--config: {re.escape(str(path))}: section '{section}' must hold a"):
            load_config_file(path, "router")
