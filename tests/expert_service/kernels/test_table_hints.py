"""table_hints vs numpy: random tables and steps with fed decodes and padding tokens; every entry of the written
rows checked (the hints start as garbage), the entries past T*W untouched, tables predicting fewer experts a
token than the hints hold, version-3 tables whose NO_EXPERT entries predict nothing, and the launcher's refusals."""

import numpy as np
import pytest
from numba import cuda

from common.routing_table import NO_EXPERT
from expert_service.kernels.table_hints import launch_table_hints

GARBAGE = -7


def reference(ids, feed, fed, slot_mapping, table, K):
    L, V, k = table.shape
    T = ids.shape[0]
    hints = np.full((L, T * K), -1, np.int32)
    for t in range(T):
        token = fed[feed[t]] if feed[t] >= 0 else ids[t]
        if slot_mapping[t] < 0 or not 0 <= token < V:
            continue
        for layer in range(L):
            for j in range(k):
                if table[layer, token, j] != NO_EXPERT:
                    hints[layer, t * K + j] = table[layer, token, j]
    return hints


def step(rng, T, V, fed_rows):
    ids = rng.integers(0, V, T).astype(np.int32)
    feed = np.full(T, -1, np.int32)
    fed = rng.integers(0, V, fed_rows).astype(np.int32)
    chosen = rng.choice(T, size=min(T, fed_rows), replace=False)
    feed[chosen] = rng.integers(0, fed_rows, chosen.size)
    slot_mapping = rng.integers(0, 1000, T).astype(np.int32)
    slot_mapping[rng.random(T) < 0.25] = -1  # padding tokens
    ids[feed >= 0] = 0  # a fed row's staged id is a placeholder
    return ids, feed, fed, slot_mapping


@pytest.mark.parametrize(
    "L,V,E,k,K,T,width", [(3, 50, 8, 2, 2, 5, 12), (2, 300, 128, 8, 8, 33, 33 * 8), (4, 64, 16, 1, 2, 9, 40)]
)
def test_hints_are_the_tables_predictions_of_each_real_token(L, V, E, k, K, T, width):
    rng = np.random.default_rng(L * 1000 + T)
    table = np.stack([[rng.choice(E, size=k, replace=False) for _ in range(V)] for _ in range(L)]).astype(np.uint16)
    ids, feed, fed, slot_mapping = step(rng, T, V, fed_rows=4)
    out = cuda.to_device(np.full((L, width), GARBAGE, np.int32))
    arrays = [cuda.to_device(a) for a in (ids, feed, fed, slot_mapping, table)]
    launch_table_hints(*arrays, out, K)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:, : T * K], reference(ids, feed, fed, slot_mapping, table, K))
    assert (got[:, T * K :] == GARBAGE).all()  # past the step's entries: not written
    assert (got[:, : T * K] >= -1).all() and (got[:, : T * K] < E).all()


@pytest.mark.parametrize("L,V,E,k,K,T,width", [(3, 50, 8, 2, 2, 7, 14), (2, 300, 128, 8, 8, 33, 33 * 8 + 5)])
def test_no_expert_entries_predict_nothing(L, V, E, k, K, T, width):
    """A version-3 table (router-gen --min-share): each token keeps a random number of its k predictions (none
    to all), NO_EXPERT after them; every written entry against the reference, so a NO_EXPERT is -1, never 0xFFFF."""
    rng = np.random.default_rng(7 * T + k)
    table = np.stack([[rng.choice(E, size=k, replace=False) for _ in range(V)] for _ in range(L)]).astype(np.uint16)
    kept = rng.integers(0, k + 1, (L, V))
    table[np.arange(k)[None, None, :] >= kept[:, :, None]] = NO_EXPERT
    ids, feed, fed, slot_mapping = step(rng, T, V, fed_rows=3)
    ids[: T // 2] = rng.choice(np.flatnonzero(kept.min(axis=0) < k), T // 2)  # tokens with gaps at some layer
    out = cuda.to_device(np.full((L, width), GARBAGE, np.int32))
    launch_table_hints(*(cuda.to_device(a) for a in (ids, feed, fed, slot_mapping, table)), out, K)
    got = out.copy_to_host()
    expected = reference(ids, feed, fed, slot_mapping, table, K)
    np.testing.assert_array_equal(got[:, : T * K], expected)
    assert (got[:, T * K :] == GARBAGE).all()
    assert (got[:, : T * K] >= -1).all() and (got[:, : T * K] < E).all()
    assert (expected == -1).sum() > (slot_mapping < 0).sum() * L * K  # the NO_EXPERT entries were exercised


def test_a_token_id_outside_the_table_predicts_nothing():
    table = np.arange(2 * 4 * 2, dtype=np.uint16).reshape(2, 4, 2) % 3
    ids = np.array([1, 9, -3, 3], np.int32)
    feed, fed, slot_mapping = np.full(4, -1, np.int32), np.zeros(1, np.int32), np.zeros(4, np.int32)
    out = cuda.to_device(np.full((2, 8), GARBAGE, np.int32))
    launch_table_hints(*(cuda.to_device(a) for a in (ids, feed, fed, slot_mapping, table)), out, 2)
    np.testing.assert_array_equal(out.copy_to_host(), reference(ids, feed, fed, slot_mapping, table, 2))


def test_the_launcher_refuses_what_the_kernel_cannot_read():
    i = np.zeros(3, np.int32)
    table = np.zeros((2, 5, 2), np.uint16)
    hints = np.zeros((2, 6), np.int32)
    with pytest.raises(ValueError, match="hints must be int32"):
        launch_table_hints(i, i, i, i, table, hints[:, :5], 2)
    with pytest.raises(ValueError, match="predicts 2 experts a token, the hints hold 1"):
        launch_table_hints(i, i, i, i, table, hints, 1)
    with pytest.raises(ValueError, match="table must be"):
        launch_table_hints(i, i, i, i, table.astype(np.int32), hints, 2)
    with pytest.raises(ValueError, match="feed 2"):
        launch_table_hints(i, i[:2], i, i, table, hints, 2)
