"""Fixtures (the CUDA simulator's pacing, the embedded tiny model, an in-process expert worker on loopback, the
byte-level tokenizer), the skip of `@pytest.mark.gpu` tests where no GPU is visible, and the `serial` mark of tests
reading device memory. Functions shared by tests are in tests/helpers.py."""

from __future__ import annotations

import os

# Kernel tests run in Numba's CUDA simulator unless a GPU run asks otherwise (`COLIBRI_TEST_GPU=1 pytest -m gpu`).
# It must be chosen before numba is first imported, hence here, at the top of the root conftest.
if os.environ.get("COLIBRI_TEST_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import faulthandler
import inspect
from pathlib import Path

import pytest

from expert_service.tools.tiny_model import make_tiny
from tests.helpers import BackgroundWorker, has_gpu
from tests.simulator import paced_simulator

# Calls that read the whole device's free memory: another process's allocations move it, so a test making them
# cannot share the GPU with other test processes (`make test-gpu` runs these `serial` tests in a pass of their own).
DEVICE_MEMORY_READS = ("cuMemGetInfo", "get_memory_info", "mem_get_info")


def pytest_itemcollected(item):
    """A test whose body reads the device's free memory is marked `serial` (before `-m` selects on it)."""
    function = getattr(item, "function", None)
    if function is None or item.get_closest_marker("serial"):
        return
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return
    if any(call in source for call in DEVICE_MEMORY_READS):
        item.add_marker(pytest.mark.serial)


@pytest.hookimpl(trylast=True)  # after `-m` deselection: a CPU-only run never probes for a GPU
def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests are skipped where no GPU is visible, and `@pytest.mark.slow` tests run first: the
    xdist workers take tests in this order, so a long test never starts last and keeps one worker busy alone."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with COLIBRI_TEST_GPU=1 pytest -m gpu)")
        for item in gpu_items:
            item.add_marker(skip)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files keep their order


# An xdist worker on the GPU still running this long after its last test dumps every thread's stack to stderr and
# exits: a shutdown held by a thread join or a driver call must not hold `make test-gpu` until a job's time limit.
# A worker that is done waits in execnet until the controller ends the session, i.e. until the slowest worker's
# last test (the whole suite takes under 6 minutes on an H200): the grace must outlast that wait.
WORKER_EXIT_GRACE_S = 600


def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("COLIBRI_TEST_GPU") == "1":
        faulthandler.dump_traceback_later(WORKER_EXIT_GRACE_S, exit=True)


@pytest.fixture(autouse=True, scope="session")
def simulator_pacing():
    """Simulated kernels wait at barriers on a condition variable instead of a busy poll (tests/simulator.py)."""
    with paced_simulator():
        yield


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


@pytest.fixture(scope="session")
def default_model(tmp_path_factory) -> Path:
    """The shipped default model (training/default-model-hf: a real BPE tokenizer of 4,096 ids), converted to
    bfloat16 once per session."""
    from expert_service.tools.convert import convert

    hf = Path(__file__).resolve().parents[1] / "training" / "default-model-hf"
    return convert(hf, tmp_path_factory.mktemp("default-model"), dtype="bfloat16", progress=False)
