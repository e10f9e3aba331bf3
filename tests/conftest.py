"""Shared fixtures: the embedded tiny model and an in-process expert worker on loopback."""
from __future__ import annotations

import os

# Kernel tests run in Numba's CUDA simulator unless a GPU run asks otherwise (`COLIBRI_TEST_GPU=1 pytest -m gpu`).
# It must be chosen before numba is first imported, hence here, at the top of the root conftest.
if os.environ.get("COLIBRI_TEST_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import asyncio
import threading
from pathlib import Path

import pytest

from expert_service.tiny_model import make_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", family="mixtral", seed=0)


class BackgroundWorker:
    """Runs `expert_service.main.serve` on its own event loop in a thread; `.address` once ready."""

    def __init__(self, model_dir: Path, port: int = 0, metrics_port: int = 0, tracer_provider=None,
                 **engine_overrides):
        from expert_service.config import EngineConfig
        from expert_service.main import WorkerConfig
        self.config = WorkerConfig(port=port, metrics_port=metrics_port, warmup_tokens=8)
        self.engine_config = EngineConfig(**{"backend": "cpu", "kv_block_size": 4, "kv_cache_tokens": 4096,
                                             **engine_overrides})
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self.exit_code: int | None = None
        self.servicer = None
        # A private provider unless a test brings one: the process-global one can be set only once.
        from common.tracing import make_tracer_provider
        self.tracer_provider = tracer_provider or make_tracer_provider("test-worker")
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        from expert_service.main import serve
        asyncio.set_event_loop(self.loop)

        def on_ready(port: int, servicer):
            self.port, self.servicer = port, servicer
            self._ready.set()

        async def main():
            self._stop = asyncio.Event()
            return await serve(str(self.model_dir), self.config, self.engine_config, stop=self._stop,
                               on_ready=on_ready, tracer_provider=self.tracer_provider)
        try:
            self.exit_code = self.loop.run_until_complete(main())
        finally:
            self._ready.set()

    def start(self) -> "BackgroundWorker":
        self._thread.start()
        assert self._ready.wait(120), "worker did not start in time"
        assert self.port, f"worker failed to start (exit code {self.exit_code})"
        return self

    @property
    def engine(self):
        return self.servicer.engine

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        return self.exit_code


@pytest.fixture
def worker(tiny_model):
    w = BackgroundWorker(tiny_model).start()
    yield w
    w.stop()
