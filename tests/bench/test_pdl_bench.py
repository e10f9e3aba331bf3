"""bench/pdl.py's chained GEMV kernel (with and without its griddepcontrol instructions, no-ops here) against the
bench's numpy chain, in the CUDA simulator: the figures it prints on the GPU are for a kernel that computes the
chain it claims to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from bench.pdl import WARP, bf16_bits, chain_kernel, reference, run_chain

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("pdl", [False, True])
def test_the_chain_kernel_computes_the_numpy_chain(pdl):
    rng = np.random.default_rng(1)
    k, n_rows, copies, launches = 8 * WARP, 260, 3, 3  # 260 rows: the last block's last 4 warps have none
    scale = np.float32(1 / np.sqrt(k))
    bits = [bf16_bits(rng.standard_normal((n_rows, k), dtype=np.float32) * scale) for _ in range(copies)]
    values = [(b.astype(np.uint32) << np.uint32(16)).view(np.float32) for b in bits]
    x0 = rng.standard_normal(n_rows, dtype=np.float32)
    stream = cuda.stream()
    weights = [cuda.to_device(b.reshape(-1).view(np.uint32)) for b in bits]
    buffers = [cuda.to_device(x0), cuda.to_device(np.full(n_rows, np.nan, np.float32))]
    run_chain(chain_kernel(pdl, k), weights, buffers, n_rows, stream, launches)
    got = buffers[launches % 2].copy_to_host()
    want = reference(values, x0, [j % copies for j in range(launches)])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_bf16_bits_round_to_nearest_even():
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38], np.float32)  # ties at 1 + 2^-8 and 1 + 3 * 2^-8
    assert bf16_bits(values).tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F62]


def test_the_pdl_kernel_loads_its_weights_before_the_wait_and_x_after_it():
    """bench/pdl.py --load-order (outside the simulator, no GPU): in the sm_90 SASS every weight load comes before
    griddepcontrol.wait and every load of x after it; ptxas hoists the wait above `.nc` loads, which would make
    the bench time a kernel that prefetches nothing."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run(
        [sys.executable, "bench/pdl.py", "--load-order"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    order = json.loads(done.stdout)
    assert len(order["weights"]) == 8 and len(order["x"]) == 16 and len(order["wait"]) == 1, order
