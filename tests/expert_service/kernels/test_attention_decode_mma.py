"""attention_decode_mma (tensor cores, bf16 pools) vs expert_service.cpu.layers.attention.paged_attention, one query
per sequence. Runs under the CUDA simulator too (block_mma emulates the mma exactly), so CI checks the fragment
and swizzle indexing on small shapes; the GPU tests take the real shapes.

Tolerance: RTOL = 1e-2 of max |reference|, as attention_prefill_mma: q * scale and the softmax weights are rounded
to bf16 before the tensor-core products (relative step 2**-8)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.attention_decode_mma import (
    KT,
    STAGES,
    launch_attention_decode_mma,
    part_bounds,
    supports,
)
from tests.helpers import check_decode_attention

RTOL = 1e-2


def _check(
    rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, splits, min_keys=KT, stages=STAGES
):
    def launch(*args):
        launch_attention_decode_mma(*args, min_keys=min_keys, stages=stages)

    check_decode_attention(
        launch, rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, np.uint16, splits, RTOL
    )


def test_group_of_8_over_several_tiles_one_part():
    # 8 heads on one kv head (the rows of the mma), 3 tiles with a partial last one, and a one-key context
    _check(np.random.default_rng(1), [77, 1], 8, 1, 32, 16, 0, 1)


def test_three_stages_as_two():
    # the pipeline depth changes which stage a tile lands in, not the result
    _check(np.random.default_rng(1), [77, 1], 8, 1, 32, 16, 0, 1, stages=3)


def test_parts_merged_by_the_reduce_and_an_idle_slot():
    # 2 kv heads of 3 query heads (padded rows), 2 parts of one tile each, an idle slot (context 0: zeros)
    _check(np.random.default_rng(2), [45, 0], 6, 2, 16, 4, 0, 4)


def test_short_context_in_a_split_workspace_writes_out_directly():
    # a 20-key context makes one part although the workspace holds 4: split 0 writes out, the reduce returns
    _check(np.random.default_rng(3), [20, 70], 4, 1, 16, 8, 0, 4)


def test_sliding_window_mha_and_head_dim_64():
    # MHA (one head per kv head), window 40 inside a 100-key context
    _check(np.random.default_rng(4), [100], 2, 2, 64, 16, 40, 3)


def test_group_of_16_fills_every_row():
    _check(np.random.default_rng(5), [40], 16, 1, 16, 16, 0, 2)


def _bounds(context_len, q_pos, window, num_splits, min_keys, start=0):
    @cuda.jit
    def kernel(out):
        lo, hi, part, parts = part_bounds(context_len, q_pos, window, start, num_splits, min_keys)
        out[0], out[1], out[2], out[3] = lo, hi, part, parts

    out = cuda.to_device(np.full(4, -1, np.int64))
    kernel[1, 1](out)
    return tuple(int(v) for v in out.copy_to_host())


def test_part_bounds_cover_the_keys_in_whole_tiles():
    assert _bounds(128, 127, 0, 16, 64) == (0, 128, 64, 2)  # short: parts of min_keys, not 16 parts of 8
    assert _bounds(4096, 4095, 0, 16, 64) == (0, 4096, 256, 16)  # long: every split
    assert _bounds(100, 99, 40, 3, 1) == (60, 100, KT, 2)  # window: 40 keys, tile-sized parts
    assert _bounds(0, -1, 0, 4, 64)[3] == 0  # idle slot: no part
    assert _bounds(10, 9, 0, 4, 0)[2:] == (KT, 1)  # min_keys 0 still gives whole tiles
    assert _bounds(200, 199, 0, 4, 32, start=128) == (128, 200, KT, 3)  # after a shared prefix: its keys only
    assert _bounds(100, 99, 40, 3, 1, start=80) == (60, 100, KT, 2)  # a window ignores the shared prefix


def test_supports():
    assert supports(np.uint16, 128, 16, 8) and supports(np.uint16, 16, 1, 16)
    assert not supports(np.float32, 128, 16, 8) and not supports(np.uint16, 136, 16, 8)
    assert not supports(np.uint16, 120, 16, 8) and not supports(np.uint16, 128, 12, 8)
    # multiples of 16 whose rows are not a power of two of 16-byte chunks (the staging and swizzles need one)
    assert not any(supports(np.uint16, hd, 16, 8) for hd in (48, 80, 96, 112))
    assert not supports(np.uint16, 128, 16, 32)


def test_refuses_what_it_does_not_support():
    rng = np.random.default_rng(6)
    with pytest.raises(ValueError, match="attention_decode_mma: no kernel for float32 pools"):
        check_decode_attention(launch_attention_decode_mma, rng, [8], 4, 1, 16, 16, 0, np.float32, 1, RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_seqs,num_heads,num_kv_heads,max_ctx,window,splits,min_keys",
    [
        (1, 32, 4, 4096, 0, 16, 64),  # qwen3moe: group 8, every split
        (1, 32, 8, 128, 0, 16, 64),  # mixtral at a short context: 2 parts of 16 splits
        (16, 32, 4, 2048, 0, 5, 64),
        (64, 32, 8, 1024, 0, 2, 256),
        (8, 32, 8, 3000, 1024, 1, 64),  # sliding window, one part
        (4, 16, 16, 700, 0, 4, 32),  # MHA (OLMoE-like)
    ],
)
def test_decode_mma_gpu(num_seqs, num_heads, num_kv_heads, max_ctx, window, splits, min_keys):
    rng = np.random.default_rng(num_seqs + max_ctx)
    lens = [int(x) for x in rng.integers(1, max_ctx + 1, num_seqs)]
    lens[0] = max_ctx
    _check(rng, lens, num_heads, num_kv_heads, 128, 16, window, splits, min_keys)
