"""bench/hbm_rate.py without a GPU: the streaming-read kernel reads every word once (its XOR folds equal numpy's, in
the CUDA simulator), it compiles for sm_90 to 16-byte loads with no local memory, and the roofline denominator is the
override, the measured rate or (simulator) the H200 reference, recorded with all three."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from bench import hbm_rate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("chunks", [3 * 96 * 4 + 37, 50, 0])  # unrolled loop and tail; fewer chunks than threads
def test_the_folds_xor_every_word_once(chunks):
    words = np.random.default_rng(chunks).integers(0, 1 << 32, 4 * chunks, dtype=np.uint32)
    folds = cuda.to_device(np.full(3 * 32, 0xDEADBEEF, np.uint32))  # every thread must write its fold
    hbm_rate.launch_stream_read(cuda.to_device(words), folds, block=32)
    assert np.bitwise_xor.reduce(folds.copy_to_host()) == np.bitwise_xor.reduce(words)


def test_a_launch_that_would_skip_words_is_refused():
    with pytest.raises(ValueError, match="6 words is not a multiple of 4"):
        hbm_rate.launch_stream_read(np.zeros(6, np.uint32), np.zeros(32, np.uint32), block=32)


PTX_PROBE = """
from numba import cuda
from bench import hbm_rate
(fn, sig), = hbm_rate.sm90_signatures()
ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
print(ptx.count("ld.global.nc.L1::no_allocate.v4.u32"), int(".local" in ptx))
"""


def test_the_kernel_compiles_for_sm90_to_16_byte_loads():
    """Outside the simulator, no GPU needed: four v4 loads in the unrolled loop and one in the tail; a narrower load
    or a spilled array would measure a slower rate than the weight-streaming kernels reach."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", PTX_PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["5", "0"]


def test_the_roofline_is_the_override_the_measured_rate_or_the_h200_reference(monkeypatch):
    monkeypatch.setattr("numba.config.ENABLE_CUDASIM", True)  # on a GPU run too: the simulator's fallback
    simulated = hbm_rate.roofline()
    assert simulated.bytes_per_s == hbm_rate.HBM_H200_REFERENCE and simulated.device == "simulator"
    assert simulated.record()["hbm_read_bytes_per_s_measured"] is None
    measured = hbm_rate.Measured("NVIDIA H100 80GB HBM3", 3.2e12, 2.9e12)
    monkeypatch.setattr(hbm_rate, "measure", lambda: measured)
    monkeypatch.setattr("numba.config.ENABLE_CUDASIM", False)
    assert hbm_rate.roofline().bytes_per_s == 3.2e12
    old = hbm_rate.roofline(4.3e12)
    assert old.record() == {
        "device": "NVIDIA H100 80GB HBM3",
        "hbm_bytes_per_s": 4.3e12,
        "hbm_bytes_per_s_source": "--hbm-bytes-per-s",
        "hbm_read_bytes_per_s_measured": 3.2e12,
        "hbm_copy_bytes_per_s_measured": 2.9e12,
        "hbm_bytes_per_s_h200_reference": 4.3e12,
    }
    assert old.summary().startswith("HBM roofline 4.30 TB/s (--hbm-bytes-per-s) on NVIDIA H100 80GB HBM3")
    assert "read 3.20, copy 2.90 TB/s" in old.summary()


@pytest.mark.parametrize("text", ["0", "-1e12", "nan", "inf", "fast"])
def test_a_rate_that_is_not_positive_is_refused_in_one_line(text, capsys):
    parser = argparse.ArgumentParser()
    hbm_rate.add_argument(parser)
    assert parser.parse_args(["--hbm-bytes-per-s", "3.35e12"]).hbm_bytes_per_s == 3.35e12
    assert parser.parse_args([]).hbm_bytes_per_s is None
    with pytest.raises(SystemExit):
        parser.parse_args([f"--hbm-bytes-per-s={text}"])
    assert "not a positive number of bytes a second" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.gpu
def test_on_the_gpu_the_fold_is_exact_and_the_rates_are_hbm_rates():
    """The real 16-byte loads read every word once too (64 MiB, a grid of many blocks), and the measured rates are
    what an HBM GPU streams (H100 about 3 TB/s, H200 about 4.3), not an L2 or a launch-bound figure."""
    words = np.random.default_rng(1).integers(0, 1 << 32, 1 << 24, dtype=np.uint32)
    folds = cuda.device_array(1024 * hbm_rate.THREADS, np.uint32)
    hbm_rate.launch_stream_read(cuda.to_device(words), folds)
    assert np.bitwise_xor.reduce(folds.copy_to_host()) == np.bitwise_xor.reduce(words)
    roofline = hbm_rate.roofline()
    assert roofline.source == "measured" and roofline.device != "simulator"
    assert 1.5e12 < roofline.measured.read_bytes_per_s < 8e12 and 1e12 < roofline.measured.copy_bytes_per_s < 8e12
