"""moe_align (tokens sorted by expert, padded to the GEMM's M tile) and moe_gather_bf16 vs numpy
(expert_service.kernels.moe_align.moe_align_reference). The order inside an expert comes from atomics, so
each expert's rows are compared as sets; position must be the exact inverse of sorted_ids."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles, moe_align_reference
from tests.helpers import awkward_floats, bf16_bits, from_storage, random_ids, to_storage


def run_align(ids, n_exp, block_m):
    n = ids.size
    tiles = max_tiles(n, n_exp, block_m)
    bufs = [cuda.to_device(np.full(size, -7, np.int32)) for size in (tiles * block_m, tiles, 1, n)]
    launch_moe_align(cuda.to_device(ids), n_exp, block_m, *bufs)
    return [b.copy_to_host() for b in bufs]


def check_align(ids, n_exp, block_m):
    sorted_ids, tile_expert, num_tiles, position = run_align(ids, n_exp, block_m)
    ref_sorted, ref_tiles, ref_num, ref_pos = moe_align_reference(ids, n_exp, block_m)
    used = int(ref_num[0]) * block_m
    assert num_tiles.tolist() == ref_num.tolist()
    np.testing.assert_array_equal(tile_expert, ref_tiles)  # -1 past the used tiles too
    np.testing.assert_array_equal(sorted_ids[:used] < 0, ref_sorted[:used] < 0)  # padding rows in place
    for e in range(n_exp):  # each expert's rows, as a set
        mine = sorted_ids[:used][np.repeat(tile_expert[: int(ref_num[0])], block_m) == e]
        assert sorted(mine[mine >= 0].tolist()) == np.flatnonzero(ids.reshape(-1) == e).tolist()
    valid = (ids.reshape(-1) >= 0) & (ids.reshape(-1) < n_exp)
    np.testing.assert_array_equal(sorted_ids[position[valid]], np.flatnonzero(valid))  # inverse permutation
    assert (position[~valid] == -1).all()
    return sorted_ids, num_tiles


@pytest.mark.parametrize(
    "n_tok,top_k,n_exp,block_m",
    [(1, 1, 1, 16), (33, 2, 8, 16), (17, 3, 60, 4), (5, 4, 7, 32), (20, 4, 256, 16), (40, 2, 3, 1)],
)
def test_matches_reference(n_tok, top_k, n_exp, block_m):
    rng = np.random.default_rng(n_tok * 100 + n_exp)
    check_align(random_ids(rng, n_tok, top_k, n_exp), n_exp, block_m)


def test_all_tokens_on_one_expert_and_empty_experts():
    check_align(np.full((40, 1), 3, np.int32), 7, 16)


def test_out_of_range_ids_are_dropped():
    ids = np.array([[0, 9], [2, -1], [2, 0]], np.int32)
    check_align(ids, 3, 4)


def test_rerun_on_the_same_buffers_counts_from_zero():
    ids = cuda.to_device(np.array([[0, 1], [1, 2]], np.int32))
    bufs = [cuda.to_device(np.full(s, -7, np.int32)) for s in (max_tiles(4, 3, 2) * 2, max_tiles(4, 3, 2), 1, 4)]
    launch_moe_align(ids, 3, 2, *bufs)
    launch_moe_align(ids, 3, 2, *bufs)
    assert bufs[2].copy_to_host().tolist() == [3]  # experts 0, 1, 2: 1, 2, 1 tokens -> 1 + 1 + 1 tiles
    assert bufs[1].copy_to_host().tolist()[:3] == [0, 1, 2]


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        run_align(np.zeros((2, 2), np.int32), 300, 16)
    with pytest.raises(ValueError):
        launch_moe_align(
            cuda.to_device(np.zeros((2, 2), np.int32)),
            4,
            16,
            *[cuda.to_device(np.zeros(s, np.int32)) for s in (10, 5, 1, 4)],
        )


# D % 4 == 0 takes the word kernel (12: fewer words than threads; 280: two words a thread, then a partial
# step), other D the scalar one; offset 1 starts x one float past an 8-byte boundary (scalar kernel too)
@pytest.mark.parametrize(
    "block_m,D,offset", [(4, 13, 0), (16, 13, 0), (4, 12, 0), (16, 280, 0), (4, 282, 0), (4, 280, 1)]
)
def test_gather_bf16(block_m, D, offset, monkeypatch):
    import expert_service.kernels.moe_align as moe_align

    rng = np.random.default_rng(block_m * 1000 + D)
    n_tok, top_k, n_exp = 9, 2, 5
    ids = random_ids(rng, n_tok, top_k, n_exp)
    x = awkward_floats(rng, (n_tok, D))
    tiles = max_tiles(ids.size, n_exp, block_m)
    bufs = [cuda.to_device(np.full(size, -7, np.int32)) for size in (tiles * block_m, tiles, 1, ids.size)]
    launch_moe_align(cuda.to_device(ids), n_exp, block_m, *bufs)
    xs = cuda.to_device(np.full((tiles * block_m, D), 0x7FC1, np.uint16))
    d_x = cuda.to_device(np.r_[np.full(offset, 1.5, np.float32), x.reshape(-1)])[offset:].reshape(n_tok, D)
    if D % 4 == 0 and not offset:  # the word kernel must take these (the scalar one gives the same bits)
        monkeypatch.setattr(moe_align, "_gather_bf16_kernel", None)
    launch_moe_gather_bf16(d_x, bufs[0], bufs[2], top_k, block_m, xs)
    sorted_ids, num = bufs[0].copy_to_host(), int(bufs[2].copy_to_host()[0])
    got, want = xs.copy_to_host(), bf16_bits(x)
    for r in range(num * block_m):
        a = sorted_ids[r]
        np.testing.assert_array_equal(got[r], want[a // top_k] if a >= 0 else np.zeros(D, np.uint16))
    assert (got[num * block_m :] == 0x7FC1).all()  # rows past the used ones untouched
    finite = np.isfinite(x)  # and the values are numpy's bfloat16 (ml_dtypes)
    np.testing.assert_array_equal(from_storage(want)[finite], from_storage(to_storage(x, np.uint16))[finite])


@pytest.mark.gpu
@pytest.mark.parametrize("n_exp,top_k", [(8, 2), (128, 8)])
@pytest.mark.parametrize("n_tok", [1, 16, 512, 2048, 8192])
@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_gpu_realistic(n_tok, top_k, n_exp, block_m):
    rng = np.random.default_rng(n_tok)
    check_align(random_ids(rng, n_tok, top_k, n_exp), n_exp, block_m)
    check_align(np.full((n_tok, 1), n_exp - 1, np.int32), n_exp, block_m)
