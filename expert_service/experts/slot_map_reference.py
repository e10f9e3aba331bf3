"""The device slot map's decisions in numpy: the reference of expert_service/kernels/expert_slot_map.py (its
docstring describes the state and the rules). Pure and slow; the kernel tests compare every array after every
call, and the invariants (no slot used twice in a wave, every needed expert in exactly one wave, never an
expert the running wave reads evicted) are checked against it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Replacement policies (the kernels' `policy` argument). LRU: the victim is the least recently used slot. LFU
# (least frequently used, with aging): each expert of the layer counts the steps that used it, in LFU_UNIT parts;
# every count halves each time the layer's uses (distinct experts a step, summed) pass a multiple of
# LFU_HALF_LIFE, this step's halvings before its own uses count, and a count stops at LFU_MAX; the victim is
# the slot whose expert counts least, the least recently used among equals. The units keep four bits under a
# halving; LFU_MAX keeps the count within the victim key's 19 bits.
POLICY_LRU, POLICY_LFU = 0, 1
LFU_UNIT = 16
LFU_HALF_LIFE = 64
LFU_MAX = (1 << 19) - 1
# The device slot map's limits per MoE layer: its shared-memory arrays have these compile-time sizes (28-32 KiB
# a block), and a slot fits the victim key's low bits. Here, beside the reference, with no numba import; the
# cuda routing kernels route fewer experts a layer than these (expert_service/backends.py refuses a model beyond
# them at start-up, and a test holds these limits above them).
MAX_EXPERTS = 1024
MAX_SLOTS = 1024


@dataclass
class SlotMapState:
    """One MoE layer's slot map (the kernel's arrays, same names)."""

    slot_of: np.ndarray  # [E] int32
    expert_in: np.ndarray  # [S] int32
    stamp: np.ndarray  # [S] int32
    prefetched: np.ndarray  # [S] int32
    stats: np.ndarray  # [4] int64: hits, misses, prefetches issued, prefetches used
    freq: np.ndarray  # [E + 1] int32: LFU's aged use count of each expert, then the layer's uses mod LFU_HALF_LIFE

    @classmethod
    def empty(cls, num_experts: int, num_slots: int) -> SlotMapState:
        return cls(
            np.full(num_experts, -1, np.int32),
            np.full(num_slots, -1, np.int32),
            np.zeros(num_slots, np.int32),
            np.zeros(num_slots, np.int32),
            np.zeros(4, np.int64),
            np.zeros(num_experts + 1, np.int32),
        )

    def copy(self) -> SlotMapState:
        return SlotMapState(
            *(a.copy() for a in (self.slot_of, self.expert_in, self.stamp, self.prefetched, self.stats, self.freq))
        )


def _victim(state: SlotMapState, usable: np.ndarray, policy: int) -> int:
    """An empty usable slot (lowest first), else by the policy: the oldest stamp (LRU) or the least counted expert,
    then the oldest stamp (LFU); ties: the lower slot. -1: none usable."""
    slots = np.flatnonzero(usable)
    if not len(slots):
        return -1
    empty = slots[state.expert_in[slots] < 0]
    if len(empty):
        return int(empty[0])
    count = state.freq[state.expert_in[slots]] if policy == POLICY_LFU else np.zeros(len(slots), np.int32)
    return int(slots[np.lexsort((slots, state.stamp[slots], count))[0]])


def _count_uses(state: SlotMapState, needed: list[int]) -> None:
    """LFU: the step's distinct experts counted, after the halvings their uses bring (module constants)."""
    E = len(state.slot_of)
    halvings = (int(state.freq[E]) + len(needed)) // LFU_HALF_LIFE
    state.freq[E] = (int(state.freq[E]) + len(needed)) % LFU_HALF_LIFE
    state.freq[:E] >>= min(halvings, 31)
    state.freq[needed] = np.minimum(state.freq[needed] + LFU_UNIT, LFU_MAX)


def _fill(state: SlotMapState, slot: int, expert: int, tick: int) -> None:
    old = state.expert_in[slot]
    if old >= 0:
        state.slot_of[old] = -1
    state.expert_in[slot], state.slot_of[expert] = expert, slot
    state.stamp[slot], state.prefetched[slot] = tick, 0


def wave_capacity(num_slots: int, pipelined: bool) -> int:
    """Experts a wave holds: every slot, or half of them when waves are pipelined (wave w+1's copies run while
    wave w computes, so they may not overwrite the slots of wave w either; needs two slots at least)."""
    if not pipelined:
        return num_slots
    if num_slots < 2:
        raise ValueError(f"pipelined waves need 2 slots per layer at least, got {num_slots}")
    return num_slots // 2


def plan_demand(
    state: SlotMapState,
    ids: np.ndarray,
    tick: int,
    num_waves: int,
    pipelined: bool = False,
    policy: int = POLICY_LRU,
) -> tuple[np.ndarray, list]:
    """Updates `state` for a step routed to `ids`; (wave_map [W, E], per wave the list of (expert, slot) copies).
    Waves of wave_capacity experts: the hits first (in expert order), then the misses; a miss of wave w never
    evicts a slot of wave w (nor, pipelined, of wave w - 1). LFU counts the step's uses before any victim."""
    E, S = len(state.slot_of), len(state.expert_in)
    C = wave_capacity(S, pipelined)
    guard = 1 if pipelined else 0
    needed = sorted({int(e) for e in np.asarray(ids).reshape(-1) if 0 <= e < E})
    if policy == POLICY_LFU:
        _count_uses(state, needed)
    wave_map = np.full((num_waves, E), -1, np.int32)
    fetches: list[list[tuple[int, int]]] = [[] for _ in range(num_waves)]
    busy = np.full(S, -1, np.int32)
    hits = [e for e in needed if state.slot_of[e] >= 0]
    for rank, e in enumerate(hits):
        s, w = state.slot_of[e], rank // C
        wave_map[w, e], busy[s], state.stamp[s] = s, w, tick
        state.stats[0] += 1
        if state.prefetched[s]:
            state.prefetched[s] = 0
            state.stats[3] += 1
    wave, in_wave = divmod(len(hits), C)
    for e in (e for e in needed if e not in hits):
        if in_wave == C:
            wave, in_wave = wave + 1, 0
        if wave >= num_waves:
            break
        s = _victim(state, (busy < 0) | (busy < wave - guard), policy)  # free, or used by a wave done with it
        _fill(state, s, e, tick)
        busy[s], wave_map[wave, e] = wave, s
        fetches[wave].append((e, s))
        state.stats[1] += 1
        in_wave += 1
    return wave_map, fetches


def plan_prefetch(
    state: SlotMapState, predicted_a: np.ndarray, predicted_b: np.ndarray, tick: int, policy: int = POLICY_LRU
) -> list:
    """Updates `state` for predicted ids (-1 ignored); the list of (expert, slot) copies it issues (predictions
    count no use)."""
    E = len(state.slot_of)
    votes = np.zeros(E, np.int64)
    for ids in (predicted_a, predicted_b):
        ids = np.asarray(ids).reshape(-1)
        np.add.at(votes, ids[(ids >= 0) & (ids < E)], 1)
    copies = []
    for e in np.argsort(-votes, kind="stable"):
        if votes[e] == 0:
            break
        s = state.slot_of[e]
        if s >= 0:
            state.stamp[s] = tick
            continue
        s = _victim(state, state.stamp != tick, policy)
        if s < 0:
            break
        _fill(state, s, int(e), tick)
        state.prefetched[s] = 1
        copies.append((int(e), s))
        state.stats[2] += 1
    return copies


def waves_needed(num_ids: int, num_experts: int, num_slots: int, pipelined: bool = False) -> int:
    """Waves a layer of `num_ids` routed ids can need: the union is at most min(num_ids, E) experts."""
    return max(1, -(-min(num_ids, num_experts) // wave_capacity(num_slots, pipelined)))
