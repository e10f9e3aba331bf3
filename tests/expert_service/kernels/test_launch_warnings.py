"""Numba's low-occupancy hint is silenced for this package's launches; other warnings still come through.
Checked in a fresh interpreter: pytest puts its own filters in front of a module's for each test."""

import subprocess
import sys

SCRIPT = """
import warnings
from numba.core.errors import NumbaPerformanceWarning
import expert_service.kernels
warnings.warn(NumbaPerformanceWarning("Grid size 1 will likely result in GPU under-utilization due to low occupancy."))
warnings.warn(NumbaPerformanceWarning("Host array used in CUDA kernel will incur copy overhead"))
"""


def test_the_low_occupancy_hint_is_dropped_and_nothing_else():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Grid size" not in done.stderr
    assert "Host array used in CUDA kernel will incur copy overhead" in done.stderr
