"""bench/pcie_fetch.py in the simulator: the fetch kernel copies the blocks of every case from mapped host memory
(the pinned fallback: the simulator registers nothing), the copy engine's copies (stubbed: they write the bytes
they were asked for) go block by block, and the JSON holds every case and its ratio."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cuda.bindings import driver as drv
from numba import cuda

import expert_service.backends as backends
import expert_service.cuda.driver as driver
from bench import pcie_fetch


@pytest.fixture
def copy_engine(monkeypatch) -> list[int]:
    """The driver stubbed for the simulator: device addresses are fake bases, the copy engine's copies write the
    bytes asked for; returns the list of copied sizes."""
    arrays: dict[int, object] = {}  # fake device address -> the simulator array behind it
    copies: list[int] = []

    def address(array) -> int:
        base = (len(arrays) + 1) << 32
        arrays[base] = array
        return base

    def copy(dst, src, nbytes, stream):
        base = dst >> 32 << 32
        words = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint32 * (nbytes // 4)).from_address(src))
        start = (dst - base) // 4
        arrays[base][start : start + nbytes // 4] = words
        copies.append(nbytes)
        return (drv.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    monkeypatch.setattr(driver, "device_address", address)
    monkeypatch.setattr(driver, "stream_handle", lambda stream: None)
    monkeypatch.setattr(driver, "check", lambda result: None)
    monkeypatch.setattr(driver, "pin_readonly", lambda array, mapped=False: False)
    monkeypatch.setattr(drv, "cuMemcpyHtoDAsync", copy)
    return copies


def test_pcie_fetch_measures_every_case(tmp_path, monkeypatch, copy_engine):
    blocks = {"small": 256, "large": 1024}
    monkeypatch.setattr(pcie_fetch, "BLOCKS", blocks)
    copies = copy_engine
    monkeypatch.setattr(cuda, "event_elapsed_time", lambda start, end: 1.0, raising=False)  # ms
    out = tmp_path / "pcie.json"
    assert pcie_fetch.main(["--out", str(out), "--repeats", "1"]) == 0
    result = json.loads(out.read_text())
    assert list(result) == list(blocks)
    for shape, block in blocks.items():
        runs = result[shape]["runs"]
        assert result[shape]["source"] == "mapped pinned"
        assert list(runs) == [*map(str, pcie_fetch.COPIES), "concurrent"]
        for count in pcie_fetch.COPIES:
            assert runs[str(count)]["bytes"] == count * block and runs[str(count)]["kernel_over_copy_engine"] == 1
    # per case, a timed copy and a warm-up of each block; both at once: the other half's blocks
    repeats = 2
    per_shape = sum(pcie_fetch.COPIES) * repeats + max(pcie_fetch.COPIES) // 2 * repeats
    assert sorted(copies) == sorted([b for b in blocks.values() for _ in range(per_shape)])


def test_fetch_kernel_rate_against_the_copy_engine(monkeypatch, copy_engine):
    """The rate bench/offload.py records: the kernel's time and the copy engine's over the same bytes (the kernel
    timed at 2 ms, the copy engine at 1 ms: 0.5x), both copies complete."""
    times = iter([2.0] * 4 + [1.0] * 4)  # the kernel's warm-up and 3 repeats, then the copy engine's
    monkeypatch.setattr(cuda, "event_elapsed_time", lambda start, end: next(times), raising=False)
    kernel, engine = pcie_fetch.fetch_kernel_bytes_per_s(256, copies=3, repeats=3)
    assert kernel == 3 * 256 / 2e-3 and engine == 3 * 256 / 1e-3
    assert copy_engine == [256] * 3 * 4


def test_grid_sweep_times_each_grid_and_restores_the_shipped_one(tmp_path, monkeypatch, copy_engine):
    from expert_service.kernels import expert_fetch

    monkeypatch.setattr(pcie_fetch, "BLOCKS", {"small": 256})
    monkeypatch.setattr(pcie_fetch, "COPIES", (1, 2))
    seen = []
    launch = expert_fetch.launch_expert_fetch

    def counting(*args, **kwargs):
        seen.append(expert_fetch.CTAS)
        return launch(*args, **kwargs)

    monkeypatch.setattr(expert_fetch, "launch_expert_fetch", counting)
    monkeypatch.setattr(cuda, "event_elapsed_time", lambda start, end: 1.0, raising=False)
    shipped = expert_fetch.CTAS
    out = tmp_path / "pcie.json"
    assert pcie_fetch.main(["--out", str(out), "--repeats", "1", "--grids", "1,3"]) == 0
    grids = json.loads(out.read_text())["grids"]
    assert list(grids) == ["small"] and list(grids["small"]) == ["1", "3"]
    assert grids["small"]["1"] == 2 * 256 / 1e-3 / 1e9  # 2 blocks in 1 ms
    assert seen[-4:] == [1, 1, 3, 3] and expert_fetch.CTAS == shipped


def test_grids_that_are_no_counts_are_refused(tmp_path, capsys):
    for bad in ("0", "a,b", "", "66,-1"):
        with pytest.raises(SystemExit):
            pcie_fetch.main(["--out", str(tmp_path / "x.json"), "--grids", bad])
        assert "--grids" in capsys.readouterr().err
