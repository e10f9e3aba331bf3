"""The worker reads two sections of a --config file, `worker:` and `engine:`. A file without sections is shared out
between them by setting name, and a setting of one found in the other's section is refused naming where it goes:
both were refused as 'unknown setting' of the worker, for settings the worker has."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import serve_env


def _worker_refusal(tmp_path, config: str, name: str = "colibri.json") -> str:
    (tmp_path / name).write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "worker", "--model", str(tmp_path / "no-model"), "--port", "0",
         "--metrics-port", "0", "--config", str(tmp_path / name)],
        env=serve_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, lines[-3:]
    return lines[-1]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"step_timeout_s": 100, "kv_block_size": 0}, "kv_block_size: must be > 0, got 0"),  # reached EngineConfig
        ({"step_timeout_s": -1, "kv_block_size": 16}, "step_timeout_s: must be > 0, got -1.0"),  # and WorkerConfig
    ],
)
def test_a_file_without_sections_gives_each_setting_to_its_own(tmp_path, values, message):
    assert _worker_refusal(tmp_path, json.dumps(values)) == f"colibri worker: error: {message}"


def test_a_setting_no_section_has_is_named_as_unknown_to_both(tmp_path):
    line = _worker_refusal(tmp_path, json.dumps({"step_timeout_s": 100, "kv_blok_size": 16}))
    assert line.startswith(
        "colibri worker: error: config file: unknown setting 'kv_blok_size' for WorkerConfig or EngineConfig (known: "
    ), line


def test_an_engine_setting_in_the_worker_section_names_its_section(tmp_path):
    line = _worker_refusal(tmp_path, "worker:\n  kv_block_size: 16\n", "colibri.yaml")
    assert line == (
        f"colibri worker: error: --config: {tmp_path / 'colibri.yaml'}: 'kv_block_size' belongs in engine:, not worker:"
    )
