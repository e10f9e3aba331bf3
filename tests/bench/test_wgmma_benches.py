"""The warpgroup-MMA benches without a GPU: bench/wgmma_tma.py --sass compiles each variant for sm_90a and its SASS
has the instructions the design rests on (4 unserialised HGMMA a step, the two bulk tensor copies, mbarrier
operations, no subroutine call, no spills), so a GPU run times the kernel the docstring describes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three sm_90a compiles and links
def test_tma_variants_compile_to_tma_fed_unserialised_wgmma():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run(
        [sys.executable, "bench/wgmma_tma.py", "--sass"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    variants = json.loads(done.stdout)
    assert set(variants) == {"tma_n256_s4", "tma_n128_s5", "tma_n256_s3"}
    for name, v in variants.items():
        assert v["HGMMA"] == 4 and v["UTMALDG"] == 2 and v["SYNCS"] >= 8 and v["CALL"] == 0, (name, v)
        assert v["wgmma_serialized"] == 0 and v["spill_store_bytes"] == 0 and v["registers"] <= 168, (name, v)
