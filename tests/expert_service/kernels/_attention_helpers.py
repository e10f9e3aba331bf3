"""Shared by the attention/kv_write kernel tests: KV dtypes, a random paged cache, device checks."""
from __future__ import annotations

import numpy as np

# Pools store values exactly like weights do (bfloat16 as uint16 bits, round to nearest even).
from tests.expert_service.kernels._dense_helpers import from_weight as from_pool  # noqa: F401
from tests.expert_service.kernels._dense_helpers import gpu, needs_gpu  # noqa: F401
from tests.expert_service.kernels._dense_helpers import to_weight as to_pool

KV_DTYPES = [np.float32, np.float16, np.uint16]        # uint16 = bfloat16 bits
TOL = {np.float32: 1e-5, np.float16: 2e-3, np.uint16: 1e-2}


def random_cache(rng, context_lens, num_blocks_total, block_size, num_kv_heads, head_dim, dtype):
    """Pools full of random values and per-sequence block tables with shuffled, non-contiguous block ids.
    Returns (k_pool, v_pool, tables [S, max_blocks] int32, per-sequence int64 tables for the reference). Unused
    table entries hold a real block id, so a kernel that reads past a sequence's blocks gets wrong values."""
    k_pool = to_pool(rng.standard_normal((num_blocks_total, block_size, num_kv_heads, head_dim), dtype=np.float32), dtype)
    v_pool = to_pool(rng.standard_normal((num_blocks_total, block_size, num_kv_heads, head_dim), dtype=np.float32), dtype)
    need = [-(-int(c) // block_size) for c in context_lens]
    max_blocks = max(max(need), 1) + 1                   # one spare column: padding must be ignored
    ids = rng.permutation(num_blocks_total)
    assert sum(need) <= num_blocks_total
    tables = np.full((len(context_lens), max_blocks), num_blocks_total - 1, dtype=np.int32)
    lists, at = [], 0
    for s, n in enumerate(need):
        tables[s, :n] = ids[at:at + n]
        lists.append(tables[s, :n].astype(np.int64))
        at += n
    return k_pool, v_pool, tables, lists


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    assert not np.isnan(got).any(), "some outputs were never written"
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max()) / scale
    assert err <= rtol, f"max error {err:.3g} (relative to max |ref| {scale:.3g}) > {rtol}"
