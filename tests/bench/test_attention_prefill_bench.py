"""bench/attention_prefill.py's host-side parts (the bench itself needs a GPU): case selection, the step it builds
(positions, contexts, block tables of a chunk after a cached prefix) and its SDPA reference, checked on the CPU
against numpy attention over the same paged cache."""

import argparse

import numpy as np
import pytest

from bench.attention_prefill import (
    CASES,
    SHAPES,
    _case,
    build_case,
    causal_flops,
    chunk_mask,
    contiguous_kv,
    sdpa_inputs,
    sdpa_output,
)
from common.dtypes import bf16_to_float32


def test_every_case_can_be_named():
    for shape in SHAPES:
        for b, new, prefix in CASES:
            assert _case(f"{shape}:{b}:{new}:{prefix}") == (shape, b, new, prefix)


@pytest.mark.parametrize("text", ["mixtral-shape:16:64", "llama:1:512:0", "mixtral-shape:16:64:1024"])
def test_unknown_cases_are_refused_with_the_known_ones(text):
    with pytest.raises(argparse.ArgumentTypeError, match="one of mixtral-shape:1:512:0"):
        _case(text)


def test_chunk_mask_sees_the_prefix_and_the_chunk_up_to_each_query():
    mask = chunk_mask(3, 4)
    assert mask.shape == (3, 7)
    assert mask.sum(axis=1).tolist() == [5, 6, 7]
    assert mask[0, :5].all() and not mask[0, 5:].any()


def test_flops_count_the_keys_each_query_sees():
    assert causal_flops(2, 3, 4, H=1, head_dim=1) == 4.0 * 2 * (5 + 6 + 7)


def test_the_sdpa_reference_is_attention_over_the_paged_cache():
    """The step's arrays and the gathered SDPA inputs describe the same attention: numpy over the pool through the
    block tables (float64, the prefix and the chunk causally) equals SDPA on the CPU within bf16 rounding of q."""
    rng = np.random.default_rng(3)
    b, new, prefix, H, Hkv, Hd, block = 2, 5, 7, 4, 2, 16, 4
    host = build_case(rng, b, new, prefix, H, Hkv, head_dim=Hd, block=block)
    q, k_pool, v_pool, starts, positions, tables, lens = host
    ctx = prefix + new
    assert starts.tolist() == [0, new, 2 * new] and lens.tolist() == [ctx, ctx]
    assert positions.tolist() == list(range(prefix, ctx)) * b
    k, v = (bf16_to_float32(contiguous_kv(p, tables, b, ctx)).astype(np.float64) for p in (k_pool, v_pool))
    want = np.empty((b * new, H, Hd))
    for s in range(b):
        for t in range(new):
            row = s * new + t
            for h in range(H):
                kh = h // (H // Hkv)
                scores = k[s, kh, : positions[row] + 1] @ q[row, h] / np.sqrt(Hd)
                p = np.exp(scores - scores.max())
                want[row, h] = p @ v[s, kh, : positions[row] + 1] / p.sum()
    qt, kt, vt, mask = sdpa_inputs(host, b, new, prefix, "cpu")
    got = sdpa_output(qt.float(), kt.float(), vt.float(), mask)
    np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max())
