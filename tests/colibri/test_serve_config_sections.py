"""serve gives its --config file to both processes, each reading its own sections: a file without sections, which
each child would read whole, is refused before either starts, and a setting in another process's section is named
with the section it belongs in (both read as 'unknown setting ... for RouterConfig')."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import serve_env


def _serve_refusal(tmp_path, tiny_model, config: str) -> list[str]:
    path = tmp_path / "colibri.yaml"
    path.write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "serve", "--model", str(tiny_model), "--config", str(path)],
        env=serve_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, lines[-3:]
    return lines


@pytest.mark.parametrize("config", ["kv_block_size: 16\n", "max_batch_tokens: 4096\n"])
def test_a_file_without_sections_is_refused(tmp_path, tiny_model, config):
    path = tmp_path / "colibri.yaml"
    assert _serve_refusal(tmp_path, tiny_model, config) == [
        f"colibri serve: error: --config: {path} has no router:, worker: or engine: section: serve gives it to both "
        "processes, and each reads its own sections"
    ]


@pytest.mark.parametrize(
    "config, key, homes, section",
    [
        ("router:\n  step_timeout_s: 5\n", "step_timeout_s", "worker:", "router:"),
        ("worker:\n  max_batch_tokens: 64\n", "max_batch_tokens", "router: or engine:", "worker:"),
        ("engine:\n  http_port: 8080\n", "http_port", "router:", "engine:"),
    ],
)
def test_a_setting_in_another_section_names_where_it_belongs(tmp_path, tiny_model, config, key, homes, section):
    path = tmp_path / "colibri.yaml"
    assert _serve_refusal(tmp_path, tiny_model, config) == [
        f"colibri serve: error: --config: {path}: {key!r} belongs in {homes}, not {section}"
    ]
