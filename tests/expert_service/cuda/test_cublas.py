"""expert_service/cuda/cublas.py without a GPU: the handle's setup calls, on a stand-in library."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import expert_service.cuda.cublas as cublas
import expert_service.cuda.driver as driver


class FakeLibrary:
    """Every cuBLAS entry point succeeds (status 0)."""

    def __getattr__(self, name):
        return lambda *args: 0


class Workspace(SimpleNamespace):
    pass


def test_the_handle_keeps_its_workspace_alive(monkeypatch):
    """cuBLAS holds the workspace's bare address: a caller that passes a temporary array (as bench/moe_gemm.py
    does) must not leave the handle a freed one."""
    monkeypatch.setattr(cublas, "_load_library", FakeLibrary)
    monkeypatch.setattr(driver, "stream_handle", lambda stream: 0)
    made = []

    def temporary() -> Workspace:
        workspace = Workspace(device_ctypes_pointer=SimpleNamespace(value=4096), nbytes=64)
        made.append(weakref.ref(workspace))
        return workspace

    blas = cublas.Cublas(None, temporary())
    gc.collect()
    assert made[0]() is not None
    blas.close()
