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


def test_gemv_through_planned_slots_equals_gemv_on_resident_experts():
    """The cached one-token step's chain (plan, wave-0 copies, slot ids, the GEMV expert kernels on the slot
    buffer) against the GEMV expert kernels on all E experts: bitwise, step after step with LRU churn (K == S)."""
    from expert_service.kernels.expert_fetch import launch_expert_fetch
    from expert_service.kernels.expert_slot_map import launch_advance_tick, launch_plan_demand
    from expert_service.kernels.gemv import launch_expert_down, launch_expert_gate_up

    rng = np.random.default_rng(11)
    E, K, F, D = 6, 2, 8, 16
    S, stride = K, 3 * F * D
    experts = rng.standard_normal((E, stride)).astype(np.float32)
    d_experts = cuda.to_device(experts)
    slots = cuda.to_device(rng.standard_normal((S, stride)).astype(np.float32))  # garbage until fetched
    i32 = np.int32
    state = [cuda.to_device(np.full(E, -1, i32)), cuda.to_device(np.full(S, -1, i32))]  # slot_of, expert_in
    stamp, prefetched = cuda.to_device(np.zeros(S, i32)), cuda.to_device(np.zeros(S, i32))
    busy, mark = cuda.to_device(np.zeros(S, i32)), cuda.to_device(np.zeros(E, i32))
    wave_map = cuda.to_device(np.full((1, E), GARBAGE, i32))
    fetch_expert, fetch_slot = cuda.to_device(np.zeros((1, S), i32)), cuda.to_device(np.zeros((1, S), i32))
    fetch_count, stats = cuda.to_device(np.zeros(1, i32)), cuda.to_device(np.zeros(4, np.int64))
    tick = cuda.to_device(np.zeros(1, i32))
    freq = cuda.to_device(np.zeros(E + 1, i32))  # the policy's counts (lru: untouched)
    slot_ids = cuda.to_device(np.full((1, K), GARBAGE, i32))
    misses = 0
    for _ in range(3):
        ids = cuda.to_device(rng.choice(E, size=(1, K), replace=False).astype(i32))
        x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
        launch_advance_tick(tick)
        launch_plan_demand(
            ids.reshape(K),
            tick,
            *state,
            stamp,
            prefetched,
            busy,
            mark,
            wave_map,
            fetch_expert,
            fetch_slot,
            fetch_count,
            stats,
            freq,
        )
        misses += int(fetch_count.copy_to_host()[0])
        launch_expert_fetch(
            d_experts.reshape(E * stride).view(np.uint32),
            slots.reshape(S * stride).view(np.uint32),
            fetch_expert[0],
            fetch_slot[0],
            fetch_count,
            stride * 4,
        )
        launch_expert_slot_ids(ids.reshape(K), wave_map[0], slot_ids.reshape(K))
        outs = []
        for table, weights in ((slot_ids, slots), (ids, d_experts)):
            h = cuda.to_device(np.full((K, F), np.nan, np.float32))
            y = cuda.to_device(np.full((K, D), np.nan, np.float32))
            launch_expert_gate_up(x, table, weights, F, D, h)
            launch_expert_down(h, table, weights, F, D, y)
            outs.append((h.copy_to_host(), y.copy_to_host()))
        (h_c, y_c), (h_r, y_r) = outs
        assert np.isfinite(y_r).all() and np.array_equal(h_c, h_r) and np.array_equal(y_c, y_r)
    assert misses > K  # the slots turned over after the cold start
