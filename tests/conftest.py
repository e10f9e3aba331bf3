"""Fixtures (the embedded tiny model, an in-process expert worker on loopback, the byte-level tokenizer) and
the skip of `@pytest.mark.gpu` tests where no GPU is visible. Functions shared by tests are in tests/helpers.py."""
from __future__ import annotations

import os

# Kernel tests run in Numba's CUDA simulator unless a GPU run asks otherwise (`COLIBRI_TEST_GPU=1 pytest -m gpu`).
# It must be chosen before numba is first imported, hence here, at the top of the root conftest.
if os.environ.get("COLIBRI_TEST_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from pathlib import Path

import pytest

from expert_service.tools.tiny_model import make_tiny
from tests.helpers import BackgroundWorker, has_gpu


@pytest.hookimpl(trylast=True)     # after `-m` deselection: a CPU-only run never probes for a GPU
def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests are skipped where no GPU is visible."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with COLIBRI_TEST_GPU=1 pytest -m gpu)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", family="mixtral", seed=0)


@pytest.fixture
def worker(tiny_model):
    w = BackgroundWorker(tiny_model).start()
    yield w
    w.stop()


@pytest.fixture(scope="session")
def tokenizer():
    """The router's Tokenizer over the tiny model's byte-level tokenizer (tests.helpers.byte_ids)."""
    from expert_service.tools.tiny_model import byte_tokenizer
    from router_service.tokenizer import Tokenizer
    return Tokenizer(byte_tokenizer())
