"""bench/cublas_host.py's timing without a GPU: host time counts the calls alone, the device time the wait too."""

from __future__ import annotations

import json
import time
import weakref
from types import SimpleNamespace

import pytest
from numba import cuda

import expert_service.cuda.cublas as cublas_module
import expert_service.cuda.driver as driver
from bench import cublas_host


def test_host_time_leaves_the_wait_out():
    calls, syncs = [], []
    row = cublas_host.timed(lambda: calls.append(1), 10, lambda: (syncs.append(1), time.sleep(0.02)))
    assert len(calls) == 11 and len(syncs) == 2  # one warm-up call and sync, then the timed loop and its sync
    assert row["host_us"] < 1000 <= row["with_device_us"]  # 20 ms of waiting over 10 calls: >= 2,000 us a call


def test_the_cases_are_mixtral_expert_gemms():
    shapes = {(n, k) for _, n, k, _ in cublas_host.CASES}
    assert {(2 * 14336, 4096), (4096, 14336)} <= shapes  # gate|up and down of a mixtral-shape expert


ADDRESSED: list = []  # weak references to every array whose address main took


def fake_address(array) -> int:
    ADDRESSED.append(weakref.ref(array))
    return id(array)


class FakeCublas:
    """Records the GEMMs main issues (the simulator has no cuBLAS); each call checks that the workspace and the
    arrays whose addresses it gets are still alive (cuBLAS holds bare addresses, no references)."""

    def __init__(self, stream, workspace):
        self._zero = 0.0
        self.calls = []
        self.workspace = weakref.ref(workspace)

    def _gemm(self, *args):
        assert self.workspace() is not None, "the cuBLAS workspace was freed while in use"
        assert all(ref() is not None for ref in ADDRESSED), "a GEMM operand was freed while in use"
        self.calls.append(args)

    def close(self):
        pass


@pytest.mark.parametrize("name", ["NVIDIA H200", b"NVIDIA H200"])  # numba-cuda 0.30's str, older releases' bytes
def test_main_writes_the_device_name_and_every_case(tmp_path, monkeypatch, name):
    ADDRESSED.clear()
    monkeypatch.setattr(cublas_module, "Cublas", FakeCublas)
    monkeypatch.setattr(driver, "device_address", fake_address)  # simulator arrays have no device address
    monkeypatch.setattr(cublas_host, "CASES", [(2, 8, 4, "f32"), (2, 8, 4, "bf16")])
    monkeypatch.setattr(cuda, "get_current_device", lambda: SimpleNamespace(name=name))
    out = tmp_path / "cublas_host.json"
    assert cublas_host.main(["--out", str(out), "--calls", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "NVIDIA H200"
    assert [(r["m"], r["n"], r["k"], r["out"]) for r in result["gemm"]] == cublas_host.CASES
    assert result["numba_launch"]["host_us"] > 0
