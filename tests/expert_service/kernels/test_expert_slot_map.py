"""expert_slot_map kernels vs expert_service.experts.slot_map_reference, every array after every call, over many
steps of random routing and predictions; plus the invariants checked directly on the copies they issue: each
needed expert is computed in exactly one wave from a slot that holds it at that time (no copy of the running
wave, or a later one, ever overwrites it), a wave's slots are distinct, and no more waves than the union needs."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from expert_service.experts.slot_map_reference import (
    LFU_HALF_LIFE,
    LFU_UNIT,
    POLICY_LFU,
    POLICY_LRU,
    SlotMapState,
    plan_demand,
    plan_prefetch,
    waves_needed,
)
from expert_service.kernels.expert_slot_map import (
    MAX_EXPERTS,
    MAX_SLOTS,
    launch_advance_tick,
    launch_plan_demand,
    launch_plan_prefetch,
)

GARBAGE = -7  # scratch and outputs start as garbage: the kernels must write what they report


class DeviceLayer:
    def __init__(self, E: int, S: int, W: int, policy: int = POLICY_LRU):
        self.E, self.S, self.W, self.policy = E, S, W, policy
        ref = SlotMapState.empty(E, S)
        names = ("slot_of", "expert_in", "stamp", "prefetched", "freq")
        self.state = {n: cuda.to_device(getattr(ref, n)) for n in names}
        self.stats = cuda.to_device(np.zeros(4, np.int64))
        self.tick = cuda.to_device(np.zeros(1, np.int32))
        self.busy = cuda.to_device(np.full(S, GARBAGE, np.int32))
        self.mark = cuda.to_device(np.full(E, GARBAGE, np.int32))
        self.wave_map = cuda.to_device(np.full((W, E), GARBAGE, np.int32))
        self.fetch_expert, self.fetch_slot = (cuda.to_device(np.full((W, S), GARBAGE, np.int32)) for _ in "ab")
        self.fetch_count = cuda.to_device(np.full(W, GARBAGE, np.int32))
        self.pf_expert, self.pf_slot = (cuda.to_device(np.full(S, GARBAGE, np.int32)) for _ in "ab")
        self.pf_count = cuda.to_device(np.full(1, GARBAGE, np.int32))

    def assert_scratch_untouched(self):
        """busy and mark stay in the launchers' interface but the kernels keep their scratch in shared memory."""
        assert (self.busy.copy_to_host() == GARBAGE).all() and (self.mark.copy_to_host() == GARBAGE).all()

    def host_state(self) -> SlotMapState:
        s = {n: a.copy_to_host() for n, a in self.state.items()}
        stats = self.stats.copy_to_host()
        return SlotMapState(s["slot_of"], s["expert_in"], s["stamp"], s["prefetched"], stats, s["freq"])

    def demand(self, ids, pipelined: bool = False):
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
            st["freq"],
            policy=self.policy,
            pipelined=pipelined,
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
            st["freq"],
            policy=self.policy,
        )
        c = int(self.pf_count.copy_to_host()[0])
        return list(zip(self.pf_expert.copy_to_host()[:c], self.pf_slot.copy_to_host()[:c]))


def assert_same(dev: SlotMapState, ref: SlotMapState):
    for name in ("slot_of", "expert_in", "stamp", "prefetched", "stats", "freq"):
        np.testing.assert_array_equal(getattr(dev, name), getattr(ref, name), err_msg=name)
    held = dev.expert_in[dev.expert_in >= 0]
    assert len(set(held.tolist())) == len(held)  # an expert sits in one slot at most
    for s, e in enumerate(dev.expert_in):
        if e >= 0:
            assert dev.slot_of[e] == s
    assert (dev.slot_of >= 0).sum() == len(held)


def check_waves(contents, ids, wave_map, fetches, S, pipelined: bool = False):
    """Replays the copies wave by wave on `contents` (slot -> expert): every needed expert computed exactly once,
    from a slot holding it when its wave runs; waves' slots distinct; as few waves as the union allows; pipelined:
    waves of S // 2 at most, and no copy of wave w lands in a slot wave w - 1 reads (they may run together)."""
    needed = set(np.asarray(ids).reshape(-1).tolist())
    computed = []
    C = S // 2 if pipelined else S
    for w, copies in enumerate(fetches):
        if pipelined and w:
            assert not {s for _, s in copies} & set(wave_map[w - 1][wave_map[w - 1] >= 0].tolist())
        for e, s in copies:
            contents[s] = e
        slots = wave_map[w][wave_map[w] >= 0]
        assert len(set(slots.tolist())) == len(slots) <= C
        for e in np.flatnonzero(wave_map[w] >= 0):
            assert contents[wave_map[w, e]] == e, (
                f"wave {w}: expert {e} reads a slot holding {contents[wave_map[w, e]]}"
            )
            computed.append(int(e))
    assert sorted(computed) == sorted(needed)
    used_waves = sum(bool((wave_map[w] >= 0).any()) for w in range(len(fetches)))
    assert used_waves == max(1, -(-len(needed) // C)) or not needed


def run_steps(
    E: int,
    S: int,
    T: int,
    K: int,
    steps: int = 24,
    seed: int | None = None,
    pipelined: bool = False,
    policy: int = POLICY_LRU,
) -> None:
    """`steps` steps of random routing of T tokens x K (and predictions on two steps in three) on device and
    reference: every array equal after every call, and the copies replayed against the waves. Under LFU the
    routing is skewed (some experts far more used, as learned routing is), so the counts decide victims."""
    rng = np.random.default_rng(E * 1000 + S * 10 + T if seed is None else seed)
    W = waves_needed(T * K, E, S, pipelined)
    dev, ref = DeviceLayer(E, S, W, policy), SlotMapState.empty(E, S)
    weights = np.arange(E, 0, -1.0) ** 2 if policy == POLICY_LFU else np.ones(E)
    weights = rng.permutation(weights / weights.sum())
    contents = np.full(S, -1)  # what the slots hold, from the copies issued
    tick = 0
    for step in range(steps):
        launch_advance_tick(dev.tick)
        tick += 1
        assert int(dev.tick.copy_to_host()[0]) == tick
        if step % 3:  # predictions: from a skewed distribution (ties in votes), some -1 entries
            a = rng.choice(E, size=T * K, p=np.arange(1, E + 1) / (E * (E + 1) / 2)).astype(np.int32)
            a[rng.random(a.size) < 0.2] = -1
            b = rng.integers(-1, E, size=max(1, T * K // 2)).astype(np.int32)
            copies = dev.prefetch(a, b)
            assert copies == plan_prefetch(ref, a, b, tick, policy)
            for e, s in copies:
                contents[s] = e
            assert_same(dev.host_state(), ref)
        ids = np.stack([rng.choice(E, size=K, replace=False, p=weights) for _ in range(T)]).astype(np.int32)
        wave_map, fetches = dev.demand(ids, pipelined)
        ref_map, ref_fetches = plan_demand(ref, ids, tick, W, pipelined, policy)
        np.testing.assert_array_equal(wave_map, ref_map)  # every row, the unused waves' too
        assert [[(int(e), int(s)) for e, s in f] for f in fetches] == ref_fetches
        assert_same(dev.host_state(), ref)
        check_waves(contents, ids, wave_map, fetches, S, pipelined)
        np.testing.assert_array_equal(contents, dev.host_state().expert_in)
    dev.assert_scratch_untouched()


@pytest.mark.parametrize(
    "E,S,T,K", [(4, 1, 1, 2), (8, 2, 4, 2), (8, 3, 16, 2), (16, 4, 3, 4), (16, 16, 2, 4), (12, 5, 5, 3)]
)
def test_demand_and_prefetch_match_reference_over_steps(E, S, T, K):
    run_steps(E, S, T, K)


@pytest.mark.parametrize(
    "E,S,T,K,steps",
    [
        (45, 40, 6, 8, 12),  # E not a multiple of the block, S over a warp: lanes own two slots, two waves
        (70, 33, 12, 4, 10),  # 48 ids over 33 slots: misses spill into wave 1 with a ballot per 32 experts
        (100, 7, 4, 8, 8),  # five waves of 7 slots: each wave evicts the slots of the waves before it
    ],
)
def test_more_slots_than_a_warp_and_many_waves_match_reference(E, S, T, K, steps):
    run_steps(E, S, T, K, steps)


@pytest.mark.parametrize(
    "E,S,T,K,steps",
    [
        (8, 2, 16, 2, 24),  # mixtral at 25 %: waves of one expert, hits spread over the first waves
        (8, 3, 4, 2, 24),  # an odd slot count: waves of one, one slot spare
        (16, 4, 3, 4, 24),
        (70, 40, 12, 4, 10),  # 20 a wave, over a warp of slots: lanes own two
        (128, 32, 16, 8, 12),  # qwen3 at 25 %, b=16: hits over several waves, then misses
    ],
)
def test_pipelined_waves_match_reference(E, S, T, K, steps):
    run_steps(E, S, T, K, steps, pipelined=True)


def test_pipelined_waves_leave_the_previous_wave_alone():
    """Mixtral at 25 %, every expert needed: waves of one; two hits take waves 0 and 1 and no copy; wave 2's copy
    takes wave 0's slot (its compute is done by then), never wave 1's, which may still be computing."""
    E, S = 8, 2
    dev, ref = DeviceLayer(E, S, waves_needed(16, E, S, True)), SlotMapState.empty(E, S)
    for tick, ids in enumerate(([6, 2], np.arange(16) % E), start=1):
        launch_advance_tick(dev.tick)
        wave_map, fetches = dev.demand(ids, pipelined=True)
        ref_map, ref_fetches = plan_demand(ref, ids, tick, dev.W, pipelined=True)
        np.testing.assert_array_equal(wave_map, ref_map)
        assert [[(int(e), int(s)) for e, s in f] for f in fetches] == ref_fetches
    assert dev.W == 8
    assert wave_map[0, 2] == 0 and wave_map[1, 6] == 1  # step 1: 2 in slot 0 (wave 0), 6 in slot 1 (wave 1)
    assert fetches[:2] == [[], []] and [len(f) for f in fetches] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert [f[0][1] for f in fetches[2:]] == [0, 1, 0, 1, 0, 1]  # alternating: never the slot of the wave before
    with pytest.raises(ValueError, match="2 slots"):
        DeviceLayer(4, 1, 4).demand([0], pipelined=True)


@pytest.mark.parametrize(
    "E,S,T,K,steps,pipelined",
    [
        (8, 2, 1, 2, 80, False),  # mixtral at 25 %, b=1: uses pass the half life (64) a few times
        (32, 8, 1, 2, 90, True),  # the trained 32-expert model at 25 %
        (45, 40, 6, 8, 12, False),  # over a warp of slots: lanes own two, two waves
        (128, 32, 16, 8, 8, True),  # qwen3 at 25 %, b=16: 128 uses a step, two halvings a step
    ],
)
def test_lfu_matches_reference(E, S, T, K, steps, pipelined):
    run_steps(E, S, T, K, steps, pipelined=pipelined, policy=POLICY_LFU)


def test_lfu_keeps_the_expert_used_most_where_lru_evicts_it():
    """Two slots; expert 0 used on five steps, then 1, 2, 3 once each: lru evicts 0 at the miss of 2 (the least
    recently used), lfu evicts 1 there and 2 at the miss of 3 (used once each) and keeps 0; a prediction of 4
    then evicts by the same rule; the counts are the reference's."""
    E, S = 6, 2
    outcome = {}
    for policy in (POLICY_LRU, POLICY_LFU):
        dev, ref = DeviceLayer(E, S, 1, policy), SlotMapState.empty(E, S)
        steps = [[0]] * 5 + [[1], [2], [3]]
        for tick, ids in enumerate(steps, start=1):
            launch_advance_tick(dev.tick)
            wave_map, fetches = dev.demand(ids)
            ref_map, ref_fetches = plan_demand(ref, ids, tick, 1, policy=policy)
            np.testing.assert_array_equal(wave_map, ref_map)
            assert [[(int(e), int(s)) for e, s in f] for f in fetches] == ref_fetches
            assert_same(dev.host_state(), ref)
        launch_advance_tick(dev.tick)
        copies = dev.prefetch([4], np.zeros(0, np.int32))
        assert copies == plan_prefetch(ref, [4], np.zeros(0, np.int32), len(steps) + 1, policy)
        assert_same(dev.host_state(), ref)
        outcome[policy] = sorted(dev.host_state().expert_in.tolist())
        if policy == POLICY_LFU:
            freq = dev.host_state().freq
            assert freq[0] == 5 * LFU_UNIT and freq[1] == freq[2] == freq[3] == LFU_UNIT and freq[E] == len(steps)
    assert outcome[POLICY_LRU] == [3, 4]  # 0 went at the miss of 2
    assert outcome[POLICY_LFU] == [0, 4]  # 0 stayed: 3 made way for the prediction


def test_lfu_counts_halve_each_half_life_of_uses():
    """A step's distinct experts are its uses; passing a multiple of LFU_HALF_LIFE halves every count first."""
    E, S = 4, 4
    dev, ref = DeviceLayer(E, S, 1, POLICY_LFU), SlotMapState.empty(E, S)
    for tick in range(1, LFU_HALF_LIFE + 2):  # two experts a step: the 32nd step reaches 64 uses
        launch_advance_tick(dev.tick)
        ids = [0, 1] if tick <= LFU_HALF_LIFE // 2 else [2, 3]
        dev.demand(ids)
        plan_demand(ref, ids, tick, 1, policy=POLICY_LFU)
        assert_same(dev.host_state(), ref)
    freq = dev.host_state().freq
    # 32 steps of 0, 1 (the 32nd halves first: 31 units halved, plus one), then 2, 3 from step 33 on, with a second
    # halving at step 64
    assert freq[E] == (2 * (LFU_HALF_LIFE + 1)) % LFU_HALF_LIFE
    assert freq[0] == freq[1] and freq[2] == freq[3] and freq[2] > freq[0] > 0


def test_largest_layer_matches_reference():
    """The shared arrays' limit: 1024 experts (32 ballots of 32) with predictions and misses."""
    run_steps(MAX_EXPERTS, 40, 8, 8, steps=4, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "E,S,T,K",
    [(128, 32, 1, 8), (128, 32, 16, 8), (128, 96, 64, 8), (256, 64, 4, 8), (60, 45, 8, 6), (1024, 300, 64, 8)],
)
def test_block_of_many_warps_matches_reference_on_gpu(E, S, T, K):
    """The GPU's block is 256 threads (8 warps; the simulator's is one): same decisions over many steps."""
    run_steps(E, S, T, K, steps=60)


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


def test_stamp_ties_take_the_lower_slot_and_never_the_running_wave():
    """Slots filled or hit in one step share a stamp: the LRU choice among them is the lowest slot not used by the
    miss's own wave; wave 1 evicts wave 0's experts (wave 0 is done), wave 0 never evicts its own hit."""
    E, S = 16, 3
    dev, ref = DeviceLayer(E, S, waves_needed(8, E, S)), SlotMapState.empty(E, S)
    for tick, ids in enumerate(([4, 9, 2], [9, 5, 11, 12, 13]), start=1):
        launch_advance_tick(dev.tick)
        wave_map, fetches = dev.demand(ids)
        ref_map, ref_fetches = plan_demand(ref, ids, tick, dev.W)
        np.testing.assert_array_equal(wave_map, ref_map)
        assert [[(int(e), int(s)) for e, s in f] for f in fetches] == ref_fetches
        assert_same(dev.host_state(), ref)
    # step 1: 2, 4, 9 into slots 0, 1, 2 (stamp 1). Step 2: 9 hits (slot 2, wave 0, stamp 2); 5 and 11 take slots 0
    # and 1 (stamp 1, lower first, never 9's); wave 1: every stamp is 2, so 12 and 13 take the lowest slots 0, 1
    assert fetches == [[(5, 0), (11, 1)], [(12, 0), (13, 1)], []]
    assert wave_map[0, 9] == 2 and wave_map[1, 12] == 0 and (wave_map[2] == -1).all()
    assert dev.host_state().stats.tolist() == [1, 7, 0, 0]


def test_prefetch_ranks_votes_then_ids_and_refetches_what_it_evicted():
    """Votes desc, ties by the lower id; a resident prediction is protected; a resident of lower rank evicted by a
    missing one of higher rank comes back as a miss into another slot (slot_of crosses lanes)."""
    E, S = 40, 34
    dev, ref = DeviceLayer(E, S, 1), SlotMapState.empty(E, S)
    launch_advance_tick(dev.tick)
    ids = np.arange(S, dtype=np.int32)  # experts 0..33 in slots 0..33, stamp 1
    dev.demand(ids)
    plan_demand(ref, ids, 1, 1)
    launch_advance_tick(dev.tick)
    a = np.array([39, 39, 36, 1, 35, -1, 37], np.int32)  # 39: 2 votes; 1, 35, 36, 37, 38: one each
    b = np.array([38, 33, 36], np.int32)  # 36: 2 votes; 33: one
    copies = dev.prefetch(a, b)
    assert copies == plan_prefetch(ref, a, b, 2)
    # 36 and 39 (2 votes, lower id first) take slots 0 and 1 (evicting 0 and 1); 1 (one vote) is missing now and
    # takes slot 2; 33 resident: protected; then 35, 37, 38 take slots 3, 4, 5
    assert copies == [(36, 0), (39, 1), (1, 2), (35, 3), (37, 4), (38, 5)]
    assert_same(dev.host_state(), ref)
    assert dev.host_state().stamp[33] == 2
    dev.assert_scratch_untouched()


def test_full_pressure_every_slot_every_wave():
    """Every expert needed with 36 slots (over a warp): waves of 36, 36, 28, every slot of a full wave used."""
    E, S = 100, 36
    dev, ref = DeviceLayer(E, S, waves_needed(E, E, S)), SlotMapState.empty(E, S)
    contents = np.full(S, -1)
    rng = np.random.default_rng(7)
    for tick in range(1, 4):
        launch_advance_tick(dev.tick)
        ids = rng.permutation(E).astype(np.int32)
        wave_map, fetches = dev.demand(ids)
        ref_map, ref_fetches = plan_demand(ref, ids, tick, dev.W)
        np.testing.assert_array_equal(wave_map, ref_map)
        assert [[(int(e), int(s)) for e, s in f] for f in fetches] == ref_fetches
        assert [(wave_map[w] >= 0).sum() for w in range(dev.W)] == [36, 36, 28]
        check_waves(contents, ids, wave_map, fetches, S)
        assert_same(dev.host_state(), ref)


@pytest.mark.parametrize("E,S", [(MAX_EXPERTS + 1, 4), (8, MAX_SLOTS + 1)])
def test_launchers_refuse_layers_over_the_shared_arrays(E, S):
    dev = DeviceLayer(E, S, 1)
    with pytest.raises(ValueError, match=f"{MAX_EXPERTS} experts and 1..{MAX_SLOTS} slots per layer, got {E}"):
        dev.demand([0])
    with pytest.raises(ValueError, match="slots per layer"):
        dev.prefetch([0], [1])


PTX_PROBE = """
from numba import cuda
from expert_service.kernels import expert_slot_map as m
for fn, sig in m.sm90_signatures():
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    print(fn.__name__, "local" if ("ld.local" in ptx or "st.local" in ptx) else "no-local")
"""


def test_sm90_plans_use_no_local_memory():
    """The plans' state lives in shared memory and registers: a per-thread array spilled to local memory would
    bring back a global-latency load per access (compiled for sm_90 outside the simulator, no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", PTX_PROBE], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert sorted(done.stdout.split()) == sorted(
        ["_advance_tick_kernel", "no-local", "_plan_demand_kernel", "no-local", "_plan_prefetch_kernel", "no-local"]
    )


def test_empty_and_out_of_range_inputs_write_every_output():
    """No routed id (or only ids outside [0, E)) and no prediction: every wave row cleared, counts zero, state
    unchanged; then a step over the same garbage-initialised outputs plans normally."""
    E, S = 40, 33
    dev, ref = DeviceLayer(E, S, 2), SlotMapState.empty(E, S)
    launch_advance_tick(dev.tick)
    assert dev.prefetch(np.zeros(0, np.int32), [-1, E, 99]) == []
    assert int(dev.pf_count.copy_to_host()[0]) == 0
    wave_map, fetches = dev.demand([-1, E, -5])
    assert (wave_map == -1).all() and fetches == [[], []]
    assert_same(dev.host_state(), ref)
    wave_map, fetches = dev.demand(np.zeros(0, np.int32))
    assert (wave_map == -1).all() and fetches == [[], []]
    launch_advance_tick(dev.tick)
    ids = np.arange(E, dtype=np.int32)[::-1].copy()
    wave_map, fetches = dev.demand(ids)
    ref_map, ref_fetches = plan_demand(ref, ids, 2, 2)
    np.testing.assert_array_equal(wave_map, ref_map)
    assert [len(f) for f in fetches] == [33, 7]
    assert_same(dev.host_state(), ref)
