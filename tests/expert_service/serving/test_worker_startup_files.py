"""Files the worker reads at start-up are checked before it binds its ports: a bad one stops it in seconds with one
line naming the setting and the file, not after it listened (and verified and loaded the model)."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.model_format import ModelDir
from common.model_identity import MANIFEST
from common.routing_table import HEADER_SIZE, RoutingTable, RoutingTableError, model_digest, write_routing_table
from tests.expert_service.serving.worker_process import worker_env
from tests.helpers import BackgroundWorker

# what the plan prefetch reads a table under: an expert cache (2 of the tiny model's experts) and --prefetch plan
PLAN_PREFETCH = {"expert_cache_slots": 2, "prefetch": "plan"}


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


def _table(model: ModelDir, path: Path, digest: str) -> Path:
    cfg, rng = model.config, np.random.default_rng()
    ids = np.argsort(rng.random((len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts)), axis=2)[:, :, :2]
    return write_routing_table(path, ids, cfg.num_experts, digest)


def test_the_worker_hashes_its_manifest_once_at_start_up(tiny_model, tmp_path, monkeypatch):
    """colibri.json was read and hashed three times at start-up: for Info's model digest, for the --plan-table check
    and for the table's load. The digest of the bytes ModelDir.open parsed now serves all three."""
    model = ModelDir.open(tiny_model, verify=False)
    table = _table(model, tmp_path / "table.bin", model_digest(tiny_model))
    manifest, real_sha256, hashed = (tiny_model / MANIFEST).read_bytes(), hashlib.sha256, []

    def sha256(data=b"", **kwargs):
        if memoryview(data).nbytes == len(manifest) and bytes(data) == manifest:
            hashed.append(1)
        return real_sha256(data, **kwargs)

    monkeypatch.setattr(hashlib, "sha256", sha256)
    worker = BackgroundWorker(tiny_model, **PLAN_PREFETCH, plan_table=str(table)).start()
    try:
        assert worker.engine.decoder.plan_lookup is not None  # the table was checked, then loaded
        assert worker.servicer.digests.manifest == "sha256:" + real_sha256(manifest).hexdigest()
    finally:
        worker.stop()
    assert len(hashed) == 1


def test_a_table_of_another_model_is_refused_in_the_line_its_check_gives(tiny_model, tmp_path):
    """The digest the worker checks a table against comes from its start-up now, not from colibri.json read again:
    a table built for another model is refused as before, in the one line RoutingTable.check gives."""
    from expert_service.engine.config import EngineConfig
    from expert_service.serving.main import WorkerConfig, serve

    model = ModelDir.open(tiny_model, verify=False)
    other = _table(model, tmp_path / "other.bin", "sha256:" + secrets.token_hex(32))
    with pytest.raises(RoutingTableError) as expected:
        RoutingTable.check(other, model.config, model_digest(tiny_model))
    config = EngineConfig(backend="cpu", kv_cache_tokens=256, **PLAN_PREFETCH, plan_table=str(other))
    with pytest.raises(RoutingTableError) as refused:
        asyncio.run(serve(str(tiny_model), WorkerConfig(port=0, metrics_port=0), config))
    assert str(refused.value) == f"plan_table: {expected.value}" and "\n" not in str(refused.value)
