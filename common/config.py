"""Configuration: one frozen dataclass per concern, resolved as defaults < config file < environment < flags.

A field's metadata names its environment variables (``COLIBRI_*`` first, then the TGI-style names from
docs/configuration.md) and its help text; ``add_flags`` turns the fields into argparse flags, so a setting
has one definition. Values are validated by each dataclass's ``__post_init__``; every error is one line
naming the setting, the source and the expected value.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from common.errors import ConfigError
from common.files import read_setting_file
from common.unique_keys import DuplicateKeyError, UniqueKeyLoader, unique_pairs

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
log = logging.getLogger("colibri.config")
# Both services' log level, and `colibri serve`'s own (it refuses a bad one before starting them).
LOG_LEVEL_ENV = ("COLIBRI_LOG_LEVEL", "LOG_LEVEL")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def setting(default: Any, help: str, env: tuple[str, ...] = (), flag: str | None = None) -> Any:
    """A dataclass field with its env names, help text and (optional) flag name."""
    return dataclasses.field(default=default, metadata={"help": help, "env": env, "flag": flag})


def _base_type(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _read_number(text: str, base: type) -> Any:
    """int(text) or float(text), refusing (ValueError) what those read but is a typo, not a number: "1_0" (10),
    other scripts' digits ("١" as 1) and a float so small it underflows to 0 ("1e-400": a budget of 0 means
    "none", not "tiny")."""
    if not text.isascii() or "_" in text:
        raise ValueError
    number = base(text)
    if base is float and _underflows(text, number):
        raise ValueError
    return number


def _underflows(text: str, number: float) -> bool:
    """A float written with a nonzero digit before its exponent that came out 0."""
    return number == 0 and re.search(r"[1-9]", text.lower().split("e")[0]) is not None


def _flag_type(base: type) -> Any:
    """argparse's type for a number setting's flag: _read_number, so a flag is read as a file's or the
    environment's text is (argparse's float() took --expert-cache-gb 1_0 as 10 before the setting saw it)."""

    def read(text: str) -> Any:
        return _read_number(text, base)

    read.__name__ = base.__name__  # argparse words a refusal "invalid float value: '1_0'"
    return read


def coerce_value(value: Any, tp: Any, where: str) -> Any:
    """`value` (a --config file's text, the environment's, a flag's or a JSON value) as type `tp`, by the settings'
    rules; ConfigError naming `where` when it cannot be read so. Settings and the values inside a setting's mapping
    (cuda_options) are read by it."""
    base = _base_type(tp)
    if value is None:  # a YAML key with nothing after it: the setting would reach the dataclass as None
        raise ConfigError(f"{where}: no value (leave the setting out for its default)")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError
        if isinstance(base, type) and issubclass(base, enum.Enum):
            try:
                return base(str(value).strip().lower())
            except ValueError:
                raise ConfigError(
                    f"{where}: must be one of {', '.join(m.value for m in base)}, got {value!r}"
                ) from None
        if base in (int, float) and isinstance(value, bool):  # int(True) is 1: a JSON `true` is no number
            raise ValueError
        if base is int and isinstance(value, float) and not value.is_integer():  # int(2.5) would truncate
            raise ValueError
        if base in (int, float) and isinstance(value, str):
            return _read_number(value, base)
        if base is str and isinstance(value, (dict, list)):  # str() would read a YAML list as "[1, 2]"
            raise ValueError
        if base in (int, float, str):
            return base(value)
        if typing.get_origin(base) is tuple or base is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            inner = (typing.get_args(base) or (str,))[0]
            return tuple(inner(x) for x in items if str(x).strip() != "")
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: cannot read {value!r} as {getattr(base, '__name__', base)}") from None
    return value


# Kubernetes injects, for every Service named e.g. `colibri` in the namespace (unless the pod sets
# enableServiceLinks: false): COLIBRI_SERVICE_HOST, COLIBRI_SERVICE_PORT[_NAME], COLIBRI_PORT=tcp://IP:PORT and
# COLIBRI_PORT_<N>_<PROTO>[_PROTO|_PORT|_ADDR]. Such a value is never a setting: it is ignored with a warning.
_SERVICE_LINK_VALUE = re.compile(r"^(tcp|udp|sctp)://", re.IGNORECASE)
_SERVICE_LINK_NAME = re.compile(r"_SERVICE_(HOST|PORT)(_[A-Z0-9_]+)?$|_PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?$")


def _is_service_link(var: str, value: str) -> bool:
    if not (_SERVICE_LINK_VALUE.match(value.strip()) or _SERVICE_LINK_NAME.search(var)):
        return False
    log.warning(
        "environment %s=%r looks like a Kubernetes service link (a Service's address, not a Colibri "
        "setting): ignored; set enableServiceLinks: false in the pod spec to silence this",
        var,
        value,
    )
    return True


SECTIONS = ("router", "worker", "engine")
YAML_SUFFIXES = (".yaml", ".yml")


class _SettingsLoader(UniqueKeyLoader):
    """A --config file's YAML, whose plain scalars stay the text written (null aside): each setting reads it as it
    reads an environment variable's. PyYAML follows YAML 1.1, which made 010 the number 8, 0x10 16, 1:20 80 and
    yes True before any setting saw them, for a text setting (a model named 010 became "8") as for a number."""


# Null stays None, so a key with no value is refused as such; '<<' merges keep working.
_KEPT_TAGS = ("tag:yaml.org,2002:null", "tag:yaml.org,2002:merge")
_SettingsLoader.yaml_implicit_resolvers = {
    first: kept
    for first, resolvers in UniqueKeyLoader.yaml_implicit_resolvers.items()
    if (kept := [(tag, pattern) for tag, pattern in resolvers if tag in _KEPT_TAGS])
}


def _scalar_text(loader: _SettingsLoader, node: yaml.ScalarNode) -> str:
    return loader.construct_scalar(node)


# An explicit tag (`!!int 0x10`) does not get around the settings' rule either.
for _tag in ("int", "float", "bool"):
    _SettingsLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _scalar_text)


def _file_float(text: str) -> Any:
    """A JSON file's float: its text where it underflows to 0 (1e-400), for the setting to refuse."""
    number = float(text)
    return text if _underflows(text, number) else number


def load_config_file(path: str | os.PathLike | None, section: str) -> dict:
    """The `section` mapping of a JSON or YAML file: empty when the file has other sections but not this one, the
    whole file when it has no sections at all."""
    if not path:
        return {}
    data = _read_config_file(Path(path))
    return dict(data.get(section) or {}) if _has_sections(data, Path(path)) else dict(data)


def load_process_config(
    path: str | os.PathLike | None, classes: Mapping[str, type], sections_needed: str = ""
) -> dict[str, dict]:
    """The file's values for each section one process reads (section name -> its dataclass). A file without sections
    is shared out by the classes' fields (or, given `sections_needed`, the reason, refused), and a setting of one of
    them found in another's section is refused naming where it goes: either was 'unknown setting' for a setting the
    process has."""
    if not path:
        return {section: {} for section in classes}
    p = Path(path)
    data = _read_config_file(p)
    fields = {section: {f.name for f in dataclasses.fields(cls)} for section, cls in classes.items()}
    if not _has_sections(data, p):
        if sections_needed and data:
            raise ConfigError(f"--config: {p} has no router:, worker: or engine: section: {sections_needed}")
        known = set().union(*fields.values())
        if unknown := sorted(set(data) - known):
            owners = " or ".join(cls.__name__ for cls in classes.values())
            raise ConfigError(
                f"config file: unknown setting {unknown[0]!r} for {owners} (known: {', '.join(sorted(known))})"
            )
        return {section: {k: v for k, v in data.items() if k in names} for section, names in fields.items()}
    for section, names in fields.items():
        for key in data.get(section) or {}:
            homes = " or ".join(f"{other}:" for other, theirs in fields.items() if key in theirs)
            if key not in names and homes:
                raise ConfigError(f"--config: {p}: {key!r} belongs in {homes}, not {section}:")
    return {section: dict(data.get(section) or {}) for section in classes}


def _read_config_file(p: Path) -> dict:
    try:  # opened without blocking: a FIFO there is refused, never waited on
        text = read_setting_file(p, "--config").decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config: {p} is not UTF-8 text (byte {e.start})") from None
    is_yaml = p.suffix.lower() in YAML_SUFFIXES  # colibri.YAML is YAML too
    try:
        if is_yaml:
            data = yaml.load(text, Loader=_SettingsLoader)
        else:
            data = json.loads(text, object_pairs_hook=unique_pairs, parse_float=_file_float)
    except DuplicateKeyError as e:  # one of the two values would be dropped without a word
        raise ConfigError(f"--config: {p}: {e}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        # a colibri.toml (or a YAML file named otherwise) is read as JSON: say what the name decides
        hint = "" if is_yaml or p.suffix.lower() == ".json" else " (names ending in .yaml or .yml are read as YAML)"
        raise ConfigError(
            f"--config: {p} is not valid {'YAML' if is_yaml else 'JSON'}{hint}: {str(e).splitlines()[0]}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {p} must hold a mapping")
    return data


def _has_sections(data: dict, p: Path) -> bool:
    """Whether the file is of sections (checked: each a mapping, none unknown) rather than settings read whole."""
    # A section is a mapping (or empty) under one of these names; RouterConfig's `worker: HOST:PORT` is a setting,
    # while `router:` and `engine:` name no setting: `router: [...]` is a section that is no mapping.
    if not any(
        name in data and (name != "worker" or data[name] is None or isinstance(data[name], dict)) for name in SECTIONS
    ):
        return False
    # One file serves both processes, each reading its own sections: a section it lacks is empty, and a section
    # nobody reads (a typo) or one that holds no settings is refused rather than dropped.
    for name, values in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"--config: {p}: unknown section {name!r} (expected {', '.join(SECTIONS)})")
        if values is not None and not isinstance(values, dict):
            raise ConfigError(
                f"--config: {p}: section {name!r} must hold a mapping of settings, got {type(values).__name__}"
            )
    return True


def resolve(
    cls: type[T],
    *,
    file_values: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> T:
    """Builds `cls` from its defaults, then the file, then the environment, then flags (None = not given)."""
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in (file_values or {}).items():
        if key not in fields:
            raise ConfigError(
                f"config file: unknown setting {key!r} for {cls.__name__} (known: {', '.join(sorted(fields))})"
            )
        values[key] = coerce_value(value, hints[key], f"config file: {key}")
    for name, f in fields.items():
        if (found := env_value(f.metadata.get("env", ()), env)) is not None:
            var, value = found
            values[name] = coerce_value(value, hints[name], f"environment {var}")
        if flags is not None and flags.get(name) is not None:
            values[name] = coerce_value(flags[name], hints[name], f"--{flag_name(f)}")
    return cls(**values)


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def check_distinct_ports(label: str, endpoints: dict[str, tuple[str, int]]) -> None:
    """Refuses two endpoints of one process (name: (host, port); port 0 = off or any free one) on one port of
    overlapping hosts: the second bind failed as 'in use', which sent the operator looking for another process."""
    named = [(name, host, port) for name, (host, port) in endpoints.items() if port]
    for i, (name, host, port) in enumerate(named):
        for other, other_host, other_port in named[:i]:
            if port == other_port and (host == other_host or host in WILDCARD_HOSTS or other_host in WILDCARD_HOSTS):
                raise ConfigError(f"{label}{name} must differ from {other} (both {port})")


# The worker's default --max-message-bytes: what a router assumes of a worker whose Info does not report its limit.
WORKER_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def check_message_limit(label: str, value: int) -> None:
    """A gRPC message limit in bytes. gRPC takes it as a 32-bit int (2^31 stopped a server with an OverflowError),
    and a limit under a KiB refuses even health checks' and errors' messages."""
    if not 1024 <= value < 2**31:
        raise ConfigError(f"{label} must be in [1024, 2^31), got {value}")


def env_value(names: tuple[str, ...], env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(name, value) of the first of these environment variables that is set, as `resolve` reads a setting's:
    an empty one, or one that is a Kubernetes service link, counts as unset."""
    env = os.environ if env is None else env
    for var in names:
        if env.get(var) not in (None, "") and not _is_service_link(var, env[var]):
            return var, env[var]
    return None


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag (without dashes) of a setting."""
    return f.metadata.get("flag") or f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One `--flag` per field of `cls`; every flag defaults to None so `resolve` can tell it was not given."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        base = _base_type(hints[f.name])
        env = f.metadata.get("env") or ()
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{f.metadata['help']} (default: {default}" + (f"; env: {', '.join(env)})" if env else ")")
        kind = (
            str
            if base is bool
            or typing.get_origin(base) is tuple
            or isinstance(base, type)
            and issubclass(base, enum.Enum)
            else base
        )
        if base in (int, float):
            kind = _flag_type(base)
        metavar = "BOOL" if base is bool else None
        group.add_argument(f"--{flag_name(f)}", dest=f.name, type=kind, default=None, metavar=metavar, help=help_text)


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
