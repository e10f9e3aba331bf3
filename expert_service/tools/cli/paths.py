"""Path arguments of the offline subcommands."""

from __future__ import annotations

from common.errors import ConfigError


def given_path(value: str, name: str, what: str) -> str:
    """`value`, refused when empty or blank: Path("") is the working directory, so an unset shell variable
    (`colibri make-tiny $OUT`) wrote a model there, or read whatever model directory the command was run in."""
    if not value.strip():
        raise ConfigError(f"{name}: empty (name {what})")
    return value
