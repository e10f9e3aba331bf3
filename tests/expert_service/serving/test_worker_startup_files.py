"""Files the worker reads at start-up are checked before it binds its ports: a bad one stops it in seconds with one
line naming the setting and the file, not after it listened (and verified and loaded the model)."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.model_format import ModelDir
from common.routing_table import HEADER_SIZE, model_digest, write_routing_table
from tests.expert_service.serving.worker_process import worker_env


def _plan_tables(model: ModelDir, tmp_path: Path) -> dict[str, tuple[Path, int, str]]:
    """name -> (file, exit code, what the error names): tables that do not fit the model, a file that is none, no
    file; each drawn afresh."""
    cfg, rng, digest = model.config, np.random.default_rng(), model_digest(model.path)
    L, V, E = len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts

    def table(layers: int, vocab: int, top_k: int) -> np.ndarray:
        return np.stack([[rng.choice(E, top_k, replace=False) for _ in range(vocab)] for _ in range(layers)])

    good = write_routing_table(tmp_path / "good.bin", table(L, V, 2), E, digest)
    another_model = "sha256:" + secrets.token_hex(32)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(good.read_bytes()[: int(rng.integers(HEADER_SIZE, good.stat().st_size))])
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(rng.bytes(int(rng.integers(HEADER_SIZE, 4096))))
    return {
        "layers": (write_routing_table(tmp_path / "layers.bin", table(L + 1, V, 2), E, digest), 3, "num_layers"),
        "vocab": (write_routing_table(tmp_path / "vocab.bin", table(L, V - 1, 2), E, digest), 3, "vocab_size"),
        "experts": (write_routing_table(tmp_path / "experts.bin", table(L, V, 2), E + 1, digest), 3, "num_experts"),
        "model": (write_routing_table(tmp_path / "model.bin", table(L, V, 2), E, another_model), 3, "model digest"),
        "truncated": (truncated, 3, "body size"),
        "garbage": (garbage, 3, "magic"),
        "missing": (tmp_path / "missing.bin", 2, "is not a file"),
    }


@pytest.mark.parametrize("case", ["layers", "vocab", "experts", "model", "truncated", "garbage", "missing"])
def test_a_bad_plan_table_stops_the_worker_before_it_binds(tiny_model, tmp_path, case):
    """The worker bound its ports, verified and loaded the model and only then read --plan-table: with its port
    taken it exited 7 (the port) instead of naming the table, and a bad table was found minutes into a large
    model's start. Now the table's header is checked against the model first."""
    path, code, named = _plan_tables(ModelDir.open(tiny_model, verify=False), tmp_path)[case]
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    flags = ["--backend", "cpu", "--expert-cache-slots", "2", "--prefetch", "plan", "--plan-table", str(path)]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "colibri.cli", "worker", "--model", str(tiny_model), *flags]
            + ["--port", str(taken.getsockname()[1]), "--metrics-port", "0"],
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        taken.close()
    assert result.returncode == code, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"colibri worker: error: plan_table: {path}") and named in last, last
    assert "Traceback" not in result.stderr and "listening" not in result.stderr
