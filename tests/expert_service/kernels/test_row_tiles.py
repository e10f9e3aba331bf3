"""row_tiles (the identity row table of a one-matrix grouped GEMM) vs its reference: every entry written, padding
rows -1, the tile count; refusals of a table that is not whole tiles (simulator)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.row_tiles import launch_row_tiles, row_tiles_reference


@pytest.mark.parametrize("rows, block_m", [(1, 16), (5, 16), (16, 16), (17, 16), (200, 64), (300, 128)])
def test_matches_reference(rows, block_m):
    want_ids, want_tiles = row_tiles_reference(rows, block_m)
    rng = np.random.default_rng(rows)
    ids = cuda.to_device(rng.integers(-5, 1000, want_ids.size).astype(np.int32))  # stale entries to overwrite
    tiles = cuda.to_device(np.array([12345], np.int32))
    launch_row_tiles(rows, block_m, ids, tiles)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_array_equal(tiles.copy_to_host(), want_tiles)
    assert want_tiles[0] * block_m == want_ids.size and (want_ids[rows:] == -1).all()


def test_refusals():
    tiles = cuda.to_device(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="5 rows in tiles of 16: sorted_ids must hold whole tiles, got 32"):
        launch_row_tiles(5, 16, cuda.to_device(np.zeros(32, np.int32)), tiles)
    with pytest.raises(ValueError, match="sorted_ids must be C-contiguous int32"):
        launch_row_tiles(5, 16, cuda.to_device(np.zeros(16, np.int64)), tiles)
    with pytest.raises(ValueError, match="0 rows"):
        launch_row_tiles(0, 16, cuda.to_device(np.zeros(16, np.int32)), tiles)
