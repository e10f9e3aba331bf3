"""The expert cache's slot map on the device: which expert of a MoE layer sits in which slot, updated by a kernel
from the step's own routing, so a cached step needs no readback, no host decision and no synchronisation (and
replays as a CUDA graph). Reference: ``expert_service.experts.slot_map_reference`` (same decisions, in numpy).

One thread does the integer logic (a few hundred to a few thousand steps: microseconds, against the
milliseconds of the copies it decides); grid = block = 1. Per layer, all int32 unless said:
  slot_of [E]       slot holding expert e, -1: not resident
  expert_in [S]     expert held by slot s, -1: empty
  stamp [S]         the step (tick) that last used or predicted the slot: the LRU order, and `stamp == tick` marks
                    the slots a prediction of this step protects
  prefetched [S]    1: filled by a prefetch not yet hit
  busy [S]          scratch: the wave that uses the slot this step (-1: none)
  mark [E]          scratch: needed experts (demand) / votes (prefetch)
  stats [4] int64   running counts: hits, misses, prefetches issued, prefetches used
  tick [1]          the step counter (launch_advance_tick bumps it once per step, before any plan)

launch_plan_demand: the union of the step's routed ids [n] is split into waves of at most S experts: every
needed resident expert in wave 0 (they sit in distinct slots), then the misses in expert order, filling wave 0's
remaining slots and then whole waves. A miss of wave w takes an empty slot, else the least recently used slot
not used by wave w: an expert the running step still reads is never evicted (earlier waves are done by the time
wave w's copies run, on the same stream). Output per wave w: wave_map[w, e] = the slot expert e reads in wave w
(-1: not in the wave; the grouped kernels skip it), and the copies the wave needs first: fetch_expert[w, :c],
fetch_slot[w, :c], c = fetch_count[w] (expert_fetch.py runs them).

launch_plan_prefetch: predicted ids (two lists, -1 ignored; e.g. the routing plan and the one-layer lookahead)
voted per expert, most votes first (ties: lower id). A resident prediction is protected (stamp = tick); a missing
one takes an empty slot, else the least recently used slot not protected this step, until none is left. Output:
the copies, pf_expert[:c], pf_slot[:c], c = pf_count[0].
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit

HITS, MISSES, PREFETCHES_ISSUED, PREFETCHES_USED = range(4)
POLICY_LRU = 0  # the only device policy so far; the argument keeps the hook for frequency-aware ones


@cuda.jit(device=True, inline=True)
def _victim(expert_in, stamp, busy, wave, tick, protect_tick):
    """An empty usable slot, else the usable slot with the oldest stamp (ties: lower slot); -1 if none.
    Usable: busy != wave (demand; wave < 0: ignored) and stamp != protect_tick (prefetch; < 0: ignored)."""
    best = -1
    best_stamp = 0
    for s in range(expert_in.shape[0]):
        if wave >= 0 and busy[s] == wave:
            continue
        if protect_tick >= 0 and stamp[s] == protect_tick:
            continue
        if expert_in[s] < 0:
            return s
        if best < 0 or stamp[s] < best_stamp:
            best = s
            best_stamp = stamp[s]
    return best


@cuda.jit(device=True, inline=True)
def _fill(slot_of, expert_in, stamp, prefetched, s, e, tick):
    old = expert_in[s]
    if old >= 0:
        slot_of[old] = -1
    expert_in[s] = e
    slot_of[e] = s
    stamp[s] = tick
    prefetched[s] = 0


@cached_jit
def _advance_tick_kernel(tick):
    if cuda.grid(1) == 0:
        tick[0] += 1


@cached_jit
def _plan_demand_kernel(ids, tick, slot_of, expert_in, stamp, prefetched, busy, mark, wave_map, fetch_expert,
                        fetch_slot, fetch_count, stats, policy):
    """Module docstring: ids [n] int32; wave_map [W, E]; fetch_expert / fetch_slot [W, S]; fetch_count [W]."""
    if cuda.grid(1) != 0:
        return
    n_exp = slot_of.shape[0]
    n_slots = expert_in.shape[0]
    n_waves = wave_map.shape[0]
    now = tick[0]
    for e in range(n_exp):
        mark[e] = 0
    for i in range(ids.shape[0]):
        e = ids[i]
        if e >= 0 and e < n_exp:
            mark[e] = 1
    for s in range(n_slots):
        busy[s] = -1
    for w in range(n_waves):
        fetch_count[w] = 0
        for e in range(n_exp):
            wave_map[w, e] = -1
    in_wave = 0
    for e in range(n_exp):  # hits: all in wave 0
        s = slot_of[e]
        if mark[e] != 0 and s >= 0:
            mark[e] = 2  # a hit: a later wave may evict it, it must not come back as a miss
            wave_map[0, e] = s
            busy[s] = 0
            stamp[s] = now
            stats[0] += 1
            if prefetched[s] != 0:
                prefetched[s] = 0
                stats[3] += 1
            in_wave += 1
    w = 0
    for e in range(n_exp):  # misses, in expert order
        if mark[e] != 1:
            continue
        if in_wave == n_slots:
            w += 1
            in_wave = 0
        if w >= n_waves:
            break  # the launcher sizes W so the union always fits
        s = _victim(expert_in, stamp, busy, w, now, -1)
        _fill(slot_of, expert_in, stamp, prefetched, s, e, now)
        busy[s] = w
        wave_map[w, e] = s
        c = fetch_count[w]
        fetch_expert[w, c] = e
        fetch_slot[w, c] = s
        fetch_count[w] = c + 1
        stats[1] += 1
        in_wave += 1


@cached_jit
def _plan_prefetch_kernel(pred_a, pred_b, tick, slot_of, expert_in, stamp, prefetched, mark, pf_expert, pf_slot,
                          pf_count, stats, policy):
    """Module docstring: pred_a [na], pred_b [nb] int32 predicted ids (-1: none); pf_expert / pf_slot [S]; pf_count [1]."""
    if cuda.grid(1) != 0:
        return
    n_exp = slot_of.shape[0]
    now = tick[0]
    for e in range(n_exp):
        mark[e] = 0
    for i in range(pred_a.shape[0]):
        e = pred_a[i]
        if e >= 0 and e < n_exp:
            mark[e] += 1
    for i in range(pred_b.shape[0]):
        e = pred_b[i]
        if e >= 0 and e < n_exp:
            mark[e] += 1
    count = 0
    while True:
        best = -1
        votes = 0
        for e in range(n_exp):
            if mark[e] > votes:
                best = e
                votes = mark[e]
        if best < 0:
            break
        mark[best] = 0
        s = slot_of[best]
        if s >= 0:
            stamp[s] = now  # resident: protected for this step
            continue
        s = _victim(expert_in, stamp, expert_in, -1, now, now)  # busy unused (wave -1)
        if s < 0:
            break
        _fill(slot_of, expert_in, stamp, prefetched, s, best, now)
        prefetched[s] = 1
        pf_expert[count] = best
        pf_slot[count] = s
        count += 1
        stats[2] += 1
    pf_count[0] = count


def _check(name, a, dtype, ndim):
    if a.dtype != dtype or a.ndim != ndim or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name} must be C-contiguous {np.dtype(dtype).name} with {ndim} dims, got {a.dtype} "
                         f"{list(a.shape)}")


def _check_state(E, S, **arrays):
    sizes = {"slot_of": E, "mark": E, "expert_in": S, "stamp": S, "prefetched": S, "busy": S, "tick": 1,
             "stats": 4, "pf_count": 1, "pf_expert": S, "pf_slot": S}
    for name, a in arrays.items():
        _check(name, a, np.int64 if name == "stats" else np.int32, 1)
        if a.shape[0] != sizes[name]:
            raise ValueError(f"{name} must have {sizes[name]} entries, got {a.shape[0]}")


def launch_advance_tick(tick, stream=0) -> None:
    """tick [1] int32 += 1: a new step (launched once per step, before the first plan)."""
    _check_state(1, 1, tick=tick)
    _advance_tick_kernel[1, 1, stream](tick)


def launch_plan_demand(ids, tick, slot_of, expert_in, stamp, prefetched, busy, mark, wave_map, fetch_expert,
                       fetch_slot, fetch_count, stats, stream=0, policy: int = POLICY_LRU) -> None:
    """ids [n] int32 the step's routed experts of one layer; the layer's state; wave_map [W, E], fetch_expert /
    fetch_slot [W, S], fetch_count [W] int32 (W >= ceil(min(n, E) / S): every wave the union can need)."""
    E, S = slot_of.shape[0], expert_in.shape[0]
    _check_state(E, S, tick=tick, slot_of=slot_of, expert_in=expert_in, stamp=stamp, prefetched=prefetched,
                 busy=busy, mark=mark, stats=stats)
    _check("ids", ids, np.int32, 1)
    W = wave_map.shape[0]
    for name, a, shape in (("wave_map", wave_map, (W, E)), ("fetch_expert", fetch_expert, (W, S)),
                           ("fetch_slot", fetch_slot, (W, S)), ("fetch_count", fetch_count, (W,))):
        _check(name, a, np.int32, len(shape))
        if a.shape != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(a.shape)}")
    if W * S < min(ids.shape[0], E):
        raise ValueError(f"{W} waves of {S} slots cannot hold the union of {ids.shape[0]} routed ids")
    _plan_demand_kernel[1, 1, stream](ids, tick, slot_of, expert_in, stamp, prefetched, busy, mark, wave_map,
                                      fetch_expert, fetch_slot, fetch_count, stats, policy)


def launch_plan_prefetch(pred_a, pred_b, tick, slot_of, expert_in, stamp, prefetched, mark, pf_expert, pf_slot,
                         pf_count, stats, stream=0, policy: int = POLICY_LRU) -> None:
    """pred_a [na], pred_b [nb] int32 predicted expert ids of one layer (-1: none); its state; the copies out."""
    E, S = slot_of.shape[0], expert_in.shape[0]
    _check_state(E, S, tick=tick, slot_of=slot_of, expert_in=expert_in, stamp=stamp, prefetched=prefetched,
                 mark=mark, stats=stats, pf_expert=pf_expert, pf_slot=pf_slot, pf_count=pf_count)
    _check("pred_a", pred_a, np.int32, 1)
    _check("pred_b", pred_b, np.int32, 1)
    _plan_prefetch_kernel[1, 1, stream](pred_a, pred_b, tick, slot_of, expert_in, stamp, prefetched, mark, pf_expert,
                                        pf_slot, pf_count, stats, policy)


def sm90_signatures():
    """(python function, numba signature) of every kernel, for the sm_90 compile check."""
    i1, i2, l1, i64 = types.int32[::1], types.int32[:, ::1], types.int64[::1], types.int64
    return [
        (_advance_tick_kernel.py_func, (i1,)),
        (_plan_demand_kernel.py_func, (i1, i1, i1, i1, i1, i1, i1, i1, i2, i2, i2, i1, l1, i64)),
        (_plan_prefetch_kernel.py_func, (i1, i1, i1, i1, i1, i1, i1, i1, i1, i1, i1, l1, i64)),
    ]
