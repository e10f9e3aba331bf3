"""apply_penalties vs the numpy reference (expert_service.engine.penalties.apply_penalties), in the simulator and on a
GPU: every element written, rows without a slot copied, NaN / inf passed through, overflow clamped."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.engine.penalties import FLOAT32_MAX, apply_penalties
from expert_service.kernels.apply_penalties import launch_apply_penalties
from tests.helpers import nan_device


def _check(rng, rows: int, vocab: int, slots: int):
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    words = rng.integers(0, 1 << 16, (slots, vocab)).astype(np.uint16)
    words[rng.random((slots, vocab)) < 0.5] = 0  # most tokens never seen
    words[rng.random((slots, vocab)) < 0.1] = 1  # prompt only
    row_slots = rng.permutation(slots)[:rows].astype(np.int32)
    row_slots[rows // 2] = -1  # an unpenalised row in the batch
    repetition = rng.uniform(0.5, 2.0, rows).astype(np.float32)
    presence = rng.uniform(-2, 2, rows).astype(np.float32)
    frequency = rng.uniform(-2, 2, rows).astype(np.float32)
    logits[0, :3] = [np.nan, np.inf, -np.inf]  # pass through, still flagged later
    repetition[0] = np.float32(1e-38)  # finite logits overflow: clamped
    words[row_slots[0], 3:] |= 1

    out = nan_device((rows, vocab))
    launch_apply_penalties(
        cuda.to_device(logits),
        cuda.to_device(row_slots),
        cuda.to_device(repetition),
        cuda.to_device(presence),
        cuda.to_device(frequency),
        cuda.to_device(words),
        out,
    )
    got = out.copy_to_host()
    want = logits.copy()
    mine = row_slots >= 0
    want[mine] = apply_penalties(
        logits[mine], words[row_slots[mine]], repetition[mine], presence[mine], frequency[mine]
    )
    np.testing.assert_array_equal(got[rows // 2], logits[rows // 2])
    np.testing.assert_array_equal(got[0, :3], logits[0, :3])
    finite = np.isfinite(logits)
    assert np.isfinite(got[finite]).all()
    assert np.abs(got[0, 3:]).max() == FLOAT32_MAX
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)
    assert not np.array_equal(got[1:][mine[1:]], logits[1:][mine[1:]])


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the clamped row, in the simulator
@pytest.mark.parametrize("rows,vocab,slots", [(3, 45, 4), (4, 300, 6)])
def test_apply_penalties_matches_numpy(rows, vocab, slots):
    _check(np.random.default_rng(rows * 1000 + vocab), rows, vocab, slots)


@pytest.mark.gpu
def test_apply_penalties_gpu_large():
    _check(np.random.default_rng(3), 64, 151936, 64)
