"""expert_slot_ids vs numpy, on wave maps the slot-map reference plans for random routing that fits one wave (as
the cached GEMV step uses it): every output written (outputs start as garbage), each slot holds its id's expert,
repeats and ids outside [0, E) or outside wave 0 handled, grids of several blocks."""

import numpy as np
import pytest
from numba import cuda

from expert_service.experts.slot_map_reference import SlotMapState, plan_demand
from expert_service.kernels.expert_slot_ids import launch_expert_slot_ids

GARBAGE = -7


def reference(ids: np.ndarray, wave_map: np.ndarray) -> np.ndarray:
    valid = (ids >= 0) & (ids < wave_map.shape[0])
    return np.where(valid, wave_map[np.clip(ids, 0, wave_map.shape[0] - 1)], -1).astype(np.int32)


def run(ids: np.ndarray, wave_map: np.ndarray) -> np.ndarray:
    out = cuda.to_device(np.full(ids.shape[0], GARBAGE, np.int32))
    launch_expert_slot_ids(cuda.to_device(ids), cuda.to_device(wave_map), out)
    return out.copy_to_host()


@pytest.mark.parametrize("E,S,K,steps", [(8, 2, 2, 6), (16, 8, 8, 5), (128, 40, 40, 3)])
def test_slots_of_planned_steps_hold_their_experts(E, S, K, steps):
    """Steps of K distinct ids into S >= K slots with LRU churn: each slot id names the slot holding the expert."""
    rng = np.random.default_rng(E * 100 + K)
    state = SlotMapState.empty(E, S)
    for tick in range(1, steps + 1):
        ids = rng.choice(E, size=K, replace=False).astype(np.int32)
        wave_map, _ = plan_demand(state, ids, tick, 1)
        got = run(ids, wave_map[0])
        np.testing.assert_array_equal(got, reference(ids, wave_map[0]))
        assert (got >= 0).all() and (state.expert_in[got] == ids).all()
        assert len(set(got.tolist())) == K  # distinct experts sit in distinct slots


def test_repeats_and_ids_outside_the_wave_or_range():
    rng = np.random.default_rng(3)
    E = 10
    wave_map = np.full(E, -1, np.int32)
    wave_map[[1, 4, 7]] = rng.permutation(3).astype(np.int32) + 5
    ids = np.array([4, 4, 1, 7, 0, -1, E, 2**30, 7], np.int32)
    got = run(ids, wave_map)
    np.testing.assert_array_equal(got, reference(ids, wave_map))
    assert got.tolist()[4:8] == [-1, -1, -1, -1]


def test_several_blocks_and_empty():
    rng = np.random.default_rng(5)
    E = 300
    wave_map = rng.integers(0, 1000, size=E).astype(np.int32)
    ids = rng.integers(0, E, size=133).astype(np.int32)  # > THREADS under the simulator and on the device
    np.testing.assert_array_equal(run(ids, wave_map), wave_map[ids])
    run(np.zeros(0, np.int32), wave_map)


@pytest.mark.parametrize(
    "ids,wave_map,out,match",
    [
        (np.zeros(2, np.int64), np.zeros(4, np.int32), np.zeros(2, np.int32), "ids"),
        (np.zeros(2, np.int32), np.zeros((1, 4), np.int32), np.zeros(2, np.int32), "wave_map"),
        (np.zeros(2, np.int32), np.zeros(4, np.int32), np.zeros(3, np.int32), "slot_ids"),
    ],
)
def test_bad_arguments_are_refused(ids, wave_map, out, match):
    with pytest.raises(ValueError, match=match):
        launch_expert_slot_ids(cuda.to_device(ids), cuda.to_device(wave_map), cuda.to_device(out))
