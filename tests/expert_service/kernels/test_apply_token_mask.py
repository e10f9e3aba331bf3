"""apply_token_mask vs the numpy reference (expert_service.engine.token_masks.apply_masks_reference), in the
simulator and on a GPU: every element written, penalised rows read from their own buffer, a vocabulary that is
not a multiple of 32."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.engine.token_masks import apply_masks_reference, mask_words
from expert_service.kernels.apply_token_mask import launch_apply_token_mask
from tests.helpers import nan_device


@pytest.mark.parametrize("rows, vocab, num_penalized", [(1, 33, 0), (3, 70, 2), (4, 259, 4)])
def test_apply_token_mask_equals_the_reference(rows, vocab, num_penalized):
    rng = np.random.default_rng(rows * 1000 + vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    penalized = rng.standard_normal((max(num_penalized, 1), vocab)).astype(np.float32)
    masks = rng.integers(0, 1 << 32, (rows, mask_words(vocab)), dtype=np.uint64).astype(np.uint32)
    masks[0, :] = 0
    masks[0, 0] = 1 << 5  # one allowed token
    out = nan_device((rows, vocab))
    launch_apply_token_mask(
        cuda.to_device(logits), cuda.to_device(penalized), num_penalized, cuda.to_device(masks), out
    )
    got = out.copy_to_host()
    src = logits.copy()
    src[:num_penalized] = penalized[:num_penalized]
    want = apply_masks_reference(src, masks)
    assert not np.isnan(got).any()  # every element written
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got[0]).sum() == 1 and np.isfinite(got[0, 5])
