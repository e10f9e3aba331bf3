"""docs/configuration.md's tables name every setting of RouterConfig, WorkerConfig and EngineConfig with the flag,
environment variables and default the code has (the router's --pipeline-depth was missing from them)."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

import pytest

from common.config import flag_name
from expert_service.engine.config import EngineConfig
from expert_service.serving.main import WorkerConfig
from router_service.config import RouterConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def doc_rows(section: str) -> dict[str, list[str]]:
    """The rows of the table under the heading of `section:`, by their flag cell (`--flag`)."""
    rows: dict[str, list[str]] = {}
    current = False
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            current = re.search(rf"section `{section}:`", line) is not None
        elif current and line.startswith("| `--"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip("`")] = cells
    return rows


def shown(value: object) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    return "(empty)" if value == "" else str(value)


@pytest.mark.parametrize("section, cls", [("router", RouterConfig), ("worker", WorkerConfig), ("engine", EngineConfig)])
def test_configuration_tables_match_the_settings(section, cls):
    rows = doc_rows(section)
    assert rows, f"docs/configuration.md: no table for section {section}"
    flags = set()
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:  # no flag (a secret, or a mapping such as cuda_options)
            continue
        flag = f"--{flag_name(f)}"
        flags.add(flag)
        assert flag in rows, f"docs/configuration.md ({section}): {flag} is missing"
        _, env, default, _ = rows[flag]
        assert env == (", ".join(f"`{e}`" for e in f.metadata.get("env", ())) or "—"), f"{flag}: environment variables"
        assert default == f"`{shown(f.default)}`", f"{flag}: default"
    assert set(rows) == flags, f"docs/configuration.md ({section}): no such setting: {sorted(set(rows) - flags)}"


def section_text(section: str) -> str:
    """The text under the heading of `section:` up to the next heading."""
    text, current = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            current = re.search(rf"section `{section}:`", line) is not None
        elif current:
            text.append(line)
    return "\n".join(text)


@pytest.mark.parametrize("section, cls", [("router", RouterConfig), ("worker", WorkerConfig), ("engine", EngineConfig)])
def test_settings_without_a_flag_are_documented_as_config_keys(section, cls):
    """A setting with no flag (a secret, a mapping) is still a key of its config-file section: the section's text
    names it as one (the engine's cuda_options, the router's worker_token were named nowhere in this file)."""
    text = section_text(section)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            assert f"`{f.name}`" in text, f"docs/configuration.md ({section}): config key {f.name} is not named"
