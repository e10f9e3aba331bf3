"""expert_slot_map kernels vs expert_service.experts.slot_map_reference, every array after every call, over many
steps of random routing and predictions; plus the invariants checked directly on the copies they issue: each
needed expert is computed in exactly one wave from a slot that holds it at that time (no copy of the running
wave, or a later one, ever overwrites it), a wave's slots are distinct, and no more waves than the union needs."""

import numpy as np
import pytest
from numba import cuda

from expert_service.experts.slot_map_reference import SlotMapState, plan_demand, plan_prefetch, waves_needed
from expert_service.kernels.expert_slot_map import launch_advance_tick, launch_plan_demand, launch_plan_prefetch

GARBAGE = -7  # scratch and outputs start as garbage: the kernels must write what they report


class DeviceLayer:
    def __init__(self, E: int, S: int, W: int):
        self.E, self.S, self.W = E, S, W
        ref = SlotMapState.empty(E, S)
        self.state = {n: cuda.to_device(getattr(ref, n)) for n in ("slot_of", "expert_in", "stamp", "prefetched")}
        self.stats = cuda.to_device(np.zeros(4, np.int64))
        self.tick = cuda.to_device(np.zeros(1, np.int32))
        self.busy = cuda.to_device(np.full(S, GARBAGE, np.int32))
        self.mark = cuda.to_device(np.full(E, GARBAGE, np.int32))
        self.wave_map = cuda.to_device(np.full((W, E), GARBAGE, np.int32))
        self.fetch_expert, self.fetch_slot = (cuda.to_device(np.full((W, S), GARBAGE, np.int32)) for _ in "ab")
        self.fetch_count = cuda.to_device(np.full(W, GARBAGE, np.int32))
        self.pf_expert, self.pf_slot = (cuda.to_device(np.full(S, GARBAGE, np.int32)) for _ in "ab")
        self.pf_count = cuda.to_device(np.full(1, GARBAGE, np.int32))

    def host_state(self) -> SlotMapState:
        s = {n: a.copy_to_host() for n, a in self.state.items()}
        return SlotMapState(s["slot_of"], s["expert_in"], s["stamp"], s["prefetched"], self.stats.copy_to_host())

    def demand(self, ids):
        st = self.state
        launch_plan_demand(
            cuda.to_device(np.asarray(ids, np.int32).reshape(-1)),
            self.tick,
            st["slot_of"],
            st["expert_in"],
            st["stamp"],
            st["prefetched"],
            self.busy,
            self.mark,
            self.wave_map,
            self.fetch_expert,
            self.fetch_slot,
            self.fetch_count,
            self.stats,
        )
        counts = self.fetch_count.copy_to_host()
        fe, fs = self.fetch_expert.copy_to_host(), self.fetch_slot.copy_to_host()
        return self.wave_map.copy_to_host(), [list(zip(fe[w, :c], fs[w, :c])) for w, c in enumerate(counts)]

    def prefetch(self, a, b):
        st = self.state
        launch_plan_prefetch(
            cuda.to_device(np.asarray(a, np.int32)),
            cuda.to_device(np.asarray(b, np.int32)),
            self.tick,
            st["slot_of"],
            st["expert_in"],
            st["stamp"],
            st["prefetched"],
            self.mark,
            self.pf_expert,
            self.pf_slot,
            self.pf_count,
            self.stats,
        )
        c = int(self.pf_count.copy_to_host()[0])
        return list(zip(self.pf_expert.copy_to_host()[:c], self.pf_slot.copy_to_host()[:c]))


def assert_same(dev: SlotMapState, ref: SlotMapState):
    for name in ("slot_of", "expert_in", "stamp", "prefetched", "stats"):
        np.testing.assert_array_equal(getattr(dev, name), getattr(ref, name), err_msg=name)
    held = dev.expert_in[dev.expert_in >= 0]
    assert len(set(held.tolist())) == len(held)  # an expert sits in one slot at most
    for s, e in enumerate(dev.expert_in):
        if e >= 0:
            assert dev.slot_of[e] == s
    assert (dev.slot_of >= 0).sum() == len(held)


def check_waves(contents, ids, wave_map, fetches, S):
    """Replays the copies wave by wave on `contents` (slot -> expert): every needed expert computed exactly once,
    from a slot holding it when its wave runs; waves' slots distinct; as few waves as the union allows."""
    needed = set(np.asarray(ids).reshape(-1).tolist())
    computed = []
    for w, copies in enumerate(fetches):
        for e, s in copies:
            contents[s] = e
        slots = wave_map[w][wave_map[w] >= 0]
        assert len(set(slots.tolist())) == len(slots) <= S
        for e in np.flatnonzero(wave_map[w] >= 0):
            assert contents[wave_map[w, e]] == e, (
                f"wave {w}: expert {e} reads a slot holding {contents[wave_map[w, e]]}"
            )
            computed.append(int(e))
    assert sorted(computed) == sorted(needed)
    used_waves = sum(bool((wave_map[w] >= 0).any()) for w in range(len(fetches)))
    assert used_waves == max(1, -(-len(needed) // S)) or not needed


@pytest.mark.parametrize(
    "E,S,T,K", [(4, 1, 1, 2), (8, 2, 4, 2), (8, 3, 16, 2), (16, 4, 3, 4), (16, 16, 2, 4), (12, 5, 5, 3)]
)
def test_demand_and_prefetch_match_reference_over_steps(E, S, T, K):
    rng = np.random.default_rng(E * 1000 + S * 10 + T)
    W = waves_needed(T * K, E, S)
    dev, ref = DeviceLayer(E, S, W), SlotMapState.empty(E, S)
    contents = np.full(S, -1)  # what the slots hold, from the copies issued
    tick = 0
    for step in range(24):
        launch_advance_tick(dev.tick)
        tick += 1
        assert int(dev.tick.copy_to_host()[0]) == tick
        if step % 3:  # predictions: from a skewed distribution, some -1 entries
            a = rng.choice(E, size=T * K, p=np.arange(1, E + 1) / (E * (E + 1) / 2)).astype(np.int32)
            a[rng.random(a.size) < 0.2] = -1
            b = rng.integers(-1, E, size=max(1, T * K // 2)).astype(np.int32)
            copies = dev.prefetch(a, b)
            assert copies == plan_prefetch(ref, a, b, tick)
            for e, s in copies:
                contents[s] = e
            assert_same(dev.host_state(), ref)
        ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int32)
        wave_map, fetches = dev.demand(ids)
        ref_map, ref_fetches = plan_demand(ref, ids, tick, W)
        np.testing.assert_array_equal(wave_map, ref_map)
        assert [[(int(e), int(s)) for e, s in f] for f in fetches] == ref_fetches
        assert_same(dev.host_state(), ref)
        check_waves(contents, ids, wave_map, fetches, S)
        np.testing.assert_array_equal(contents, dev.host_state().expert_in)


def test_prefetch_never_evicts_a_protected_or_just_hit_slot():
    """Two predictions of one step cannot evict each other; with every slot protected nothing is issued."""
    E, S = 8, 2
    dev, ref = DeviceLayer(E, S, waves_needed(8, E, S)), SlotMapState.empty(E, S)
    launch_advance_tick(dev.tick)
    assert dev.prefetch([5, 5, 6], [7]) == plan_prefetch(ref, [5, 5, 6], [7], 1) == [(5, 0), (6, 1)]
    assert dev.prefetch([7, 1], [-1]) == []  # both slots protected this step
    launch_advance_tick(dev.tick)
    wave_map, fetches = dev.demand([5, 1])
    assert wave_map[0, 5] == 0 and fetches[0] == [(1, 1)]  # the hit on 5 stays, 1 evicts the unused 6
    assert dev.host_state().stats.tolist() == [1, 1, 2, 1]  # hits, misses, prefetches issued, used


def test_union_over_the_slots_runs_in_waves_hits_first():
    """A batch needing every expert with a quarter of the slots: residents in wave 0 with the first misses, then
    whole waves of misses, and the LRU choice takes wave 0's slots for wave 1 (they are done)."""
    E, S = 8, 2
    dev = DeviceLayer(E, S, waves_needed(16, E, S))
    launch_advance_tick(dev.tick)
    dev.demand([3])
    launch_advance_tick(dev.tick)
    wave_map, fetches = dev.demand(np.arange(16) % E)
    assert wave_map[0, 3] == 0 and fetches[0] == [(0, 1)]
    assert [len(f) for f in fetches] == [1, 2, 2, 2]
    assert all((wave_map[w] >= 0).sum() == 2 for w in range(4))


def test_out_of_range_ids_are_ignored_and_launcher_refuses_too_few_waves():
    dev = DeviceLayer(4, 1, 3)
    launch_advance_tick(dev.tick)
    wave_map, fetches = dev.demand([-1, 9, 2])
    assert fetches == [[(2, 0)], [], []] and (wave_map[1:] < 0).all()
    with pytest.raises(ValueError, match="waves"):
        dev.demand([0, 1, 2, 3])
