"""The expert cache's slot map on the device: which expert of a MoE layer sits in which slot, updated by a kernel
from the step's own routing, so a cached step needs no readback, no host decision and no synchronisation (and
replays as a CUDA graph). Reference: ``expert_service.experts.slot_map_reference`` (same decisions, in numpy).

Per layer, all int32 unless said:
  slot_of [E]       slot holding expert e, -1: not resident
  expert_in [S]     expert held by slot s, -1: empty
  stamp [S]         the step (tick) that last used or predicted the slot: the LRU order, and `stamp == tick` marks
                    the slots a prediction of this step protects
  prefetched [S]    1: filled by a prefetch not yet hit
  busy [S], mark [E] scratch of the launchers' interface, no longer read or written (the kernels keep theirs in
                    shared memory)
  stats [4] int64   running counts: hits, misses, prefetches issued, prefetches used
  freq [E + 1]      the policy's use counts (LFU: each expert's aged count, then the layer's uses mod the half
                    life; the rule is slot_map_reference's; LRU leaves it untouched)
  tick [1]          the step counter (launch_advance_tick bumps it once per step, before any plan)

launch_plan_demand: the union of the step's routed ids [n] is split into waves of at most C experts (C = S, or
S // 2 with `pipelined`): the needed resident experts first (hit k, in expert order, in wave k // C; they sit in
distinct slots), then the misses in expert order, filling the hits' last wave and then whole waves. A miss of
wave w takes an empty slot, else the least recently used slot not used by wave w (pipelined: nor by wave w - 1):
an expert the running step still reads is never evicted. Without pipelining, earlier waves are done by the time
wave w's copies run on the same stream; pipelined, wave w's copies may run while wave w - 1 computes (another
stream), so they leave its slots alone. With `policy` LFU the step's distinct experts are counted first, and the
victim is the usable slot whose expert counts least (then the LRU order). Output per wave w: wave_map[w, e] = the slot expert e reads in wave w
(-1: not in the wave; the grouped kernels skip it), and the copies the wave needs first: fetch_expert[w, :c],
fetch_slot[w, :c], c = fetch_count[w] (expert_fetch.py runs them).

launch_plan_prefetch: predicted ids (two lists, -1 ignored; e.g. the routing plan and the one-layer lookahead)
voted per expert, most votes first (ties: lower id). A resident prediction is protected (stamp = tick); a missing
one takes an empty slot, else the least recently used (LFU: least counted) slot not protected this step, until
none is left. Output:
the copies, pf_expert[:c], pf_slot[:c], c = pf_count[0].

Cost: each plan is one block of THREADS threads, run once per MoE layer per step, so its latency is on the step's
critical path. A single thread doing this on global memory waited out a dependent global load (hundreds of
cycles) per expert and per slot visited, hundreds to thousands a layer. Here the block loads the layer's state
into shared memory in parallel, clears the outputs with coalesced stores, marks the ids and takes the hits in
parallel (distinct residents sit in distinct slots: no conflicts; counts by shared atomics), and writes the state
back in parallel. Only the order-dependent part is sequential, run by warp 0 on shared memory: the misses in
expert order (a ballot per 32 experts visits only the missing ones) and the predictions in rank order (each
voted expert's rank, votes desc then id asc, computed in parallel over the voted ones). Lane l owns slots
s = l mod 32: a victim search is one pass of each lane over its slots and a shuffle argmin over the key
(empty first, oldest stamp, lower slot), and the owner lane applies the fill, so only slot_of crosses lanes
(a warp barrier per prediction). Shared arrays have compile-time sizes: layers over MAX_EXPERTS experts or
MAX_SLOTS slots are refused by the launchers and DeviceSlots; a model over them never gets here: the cuda
routing kernels hold fewer experts a layer, and the worker refuses a model beyond those at start-up
(backends.make_decoder) in one line.
Under the simulator the block is one warp and the warp primitives are shared-memory twins.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.experts.slot_map_reference import (
    LFU_HALF_LIFE,
    LFU_MAX,
    LFU_UNIT,
    MAX_EXPERTS,
    MAX_SLOTS,
    POLICY_LFU,
    POLICY_LRU,
)
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import FULL_MASK, SIMULATOR, WARP

HITS, MISSES, PREFETCHES_ISSUED, PREFETCHES_USED = range(4)
POLICIES = (POLICY_LRU, POLICY_LFU)
# MAX_EXPERTS, MAX_SLOTS (per layer: the shared-memory arrays' sizes; a slot fits the victim key's low _SLOT_BITS
# bits) live in slot_map_reference, beside the numpy reference that shares them
# The simulator runs a Python thread per CUDA thread, and its warp twins below need the block to be one warp.
THREADS = WARP if SIMULATOR else 256
_SLOT_BITS = 10
_COUNT_SHIFT = 42  # the victim key: [not empty][LFU count, 19 bits][stamp + 2**31, 32 bits][slot, 10 bits]
_NOT_EMPTY = np.int64(1) << 61  # above every count << _COUNT_SHIFT | (stamp + 2**31) << _SLOT_BITS | slot
_UNUSABLE = np.int64(1) << 62
_STAMP_BIAS = np.int64(1) << 31  # int32 stamps as non-negative keys, order kept

if SIMULATOR:
    # The block is one warp (THREADS == WARP): a block barrier is a warp barrier, and lanes exchange through
    # shared scratch.
    @cuda.jit(device=True)
    def _warp_sync():
        cuda.syncthreads()

    @cuda.jit(device=True)
    def _ballot(flag):
        scratch = cuda.shared.array(WARP, np.int32)
        scratch[cuda.threadIdx.x] = 1 if flag else 0
        cuda.syncthreads()
        mask = 0
        for j in range(WARP):
            if scratch[j] != 0:
                mask |= 1 << j
        cuda.syncthreads()
        return mask

    @cuda.jit(device=True)
    def _warp_min(key):
        scratch = cuda.shared.array(WARP, np.int64)
        scratch[cuda.threadIdx.x] = key
        cuda.syncthreads()
        best = scratch[0]
        for j in range(1, WARP):
            best = min(best, scratch[j])
        cuda.syncthreads()
        return best
else:
    @cuda.jit(device=True, inline=True)
    def _warp_sync():
        cuda.syncwarp(FULL_MASK)

    @cuda.jit(device=True, inline=True)
    def _ballot(flag):
        return np.int64(cuda.ballot_sync(FULL_MASK, flag)) & 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def _warp_min(key):
        """Minimum over the 32 lanes of the calling warp; every lane gets it (all lanes must call)."""
        offset = 16
        while offset > 0:
            key = min(key, cuda.shfl_xor_sync(FULL_MASK, key, offset))
            offset //= 2
        return key


@cuda.jit(device=True, inline=True)
def _victim(lane, n_slots, expert_in, stamp, busy, wave, guard, now, protect, count):
    """Warp-collective: an empty usable slot (lowest first), else the usable slot whose expert has the lowest count
    (all zero under LRU), then the oldest stamp (ties: lower slot); -1 if none. Usable: not busy in waves
    wave - guard .. wave (wave >= 0, demand) and stamp != now (protect, prefetch). Each lane reads only the slots
    it owns (s = lane mod 32)."""
    best = _UNUSABLE
    for s in range(lane, n_slots, WARP):
        if wave >= 0 and busy[s] >= 0 and busy[s] >= wave - guard:
            continue
        if protect and stamp[s] == now:
            continue
        key = np.int64(s)
        e = expert_in[s]
        if e >= 0:
            key = (_NOT_EMPTY | (np.int64(count[e]) << _COUNT_SHIFT)
                   | ((np.int64(stamp[s]) + _STAMP_BIAS) << _SLOT_BITS) | s)
        best = min(best, key)
    best = _warp_min(best)
    if best == _UNUSABLE:
        return -1
    return np.int32(best & ((1 << _SLOT_BITS) - 1))


@cuda.jit(device=True, inline=True)
def _fill(slot_of, expert_in, stamp, prefetched, s, e, tick):
    old = expert_in[s]
    if old >= 0:
        slot_of[old] = -1
    expert_in[s] = e
    slot_of[e] = s
    stamp[s] = tick
    prefetched[s] = 0


@cuda.jit(device=True, inline=True)
def _load(tid, nthreads, slot_of, expert_in, stamp, prefetched, sh_slot, sh_mark, sh_expert, sh_stamp, sh_pref):
    for e in range(tid, slot_of.shape[0], nthreads):
        sh_slot[e] = slot_of[e]
        sh_mark[e] = 0
    for s in range(tid, expert_in.shape[0], nthreads):
        sh_expert[s] = expert_in[s]
        sh_stamp[s] = stamp[s]
        sh_pref[s] = prefetched[s]


@cuda.jit(device=True, inline=True)
def _store(tid, nthreads, slot_of, expert_in, stamp, prefetched, sh_slot, sh_expert, sh_stamp, sh_pref):
    for e in range(tid, slot_of.shape[0], nthreads):
        slot_of[e] = sh_slot[e]
    for s in range(tid, expert_in.shape[0], nthreads):
        expert_in[s] = sh_expert[s]
        stamp[s] = sh_stamp[s]
        prefetched[s] = sh_pref[s]


@cuda.jit(device=True, inline=True)
def _load_counts(tid, nthreads, freq, sh_count, n_exp, lfu):
    for e in range(tid, n_exp, nthreads):
        sh_count[e] = freq[e] if lfu else 0


@cached_jit
def _advance_tick_kernel(tick):
    if cuda.grid(1) == 0:
        tick[0] += 1


@cached_jit
def _plan_demand_kernel(ids, tick, slot_of, expert_in, stamp, prefetched, wave_map, fetch_expert, fetch_slot,
                        fetch_count, stats, freq, policy, capacity, guard):
    """Module docstring: ids [n] int32; wave_map [W, E]; fetch_expert / fetch_slot [W, S]; fetch_count [W];
    freq [E + 1]; capacity: experts a wave holds; guard: earlier waves whose slots a wave's copies leave alone (0
    or 1)."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    lane = tid % WARP
    n_exp = slot_of.shape[0]
    n_slots = expert_in.shape[0]
    n_waves = wave_map.shape[0]
    sh_slot = cuda.shared.array(MAX_EXPERTS, np.int32)
    sh_mark = cuda.shared.array(MAX_EXPERTS, np.int32)  # 1: needed, 2: a hit (a later wave may evict it)
    sh_expert = cuda.shared.array(MAX_SLOTS, np.int32)
    sh_stamp = cuda.shared.array(MAX_SLOTS, np.int32)
    sh_pref = cuda.shared.array(MAX_SLOTS, np.int32)
    sh_busy = cuda.shared.array(MAX_SLOTS, np.int32)  # the wave using the slot, -1: none
    sh_count = cuda.shared.array(MAX_EXPERTS, np.int32)  # LFU's counts (zero under LRU: the LRU order alone)
    counts = cuda.shared.array(3, np.int32)  # hits, prefetches used, misses
    now = tick[0]
    lfu = policy == POLICY_LFU
    first = ids[tid] if tid < ids.shape[0] else -1  # loaded with the state: a dependent global round trip fewer
    totals = stats[tid] if tid < 4 else 0  # likewise the running counts (thread i adds to stats[i] at the end)
    uses = freq[n_exp] if lfu else 0
    _load(tid, nthreads, slot_of, expert_in, stamp, prefetched, sh_slot, sh_mark, sh_expert, sh_stamp, sh_pref)
    _load_counts(tid, nthreads, freq, sh_count, n_exp, lfu)
    for s in range(tid, n_slots, nthreads):
        sh_busy[s] = -1
    for w in range(n_waves):
        for e in range(tid, n_exp, nthreads):
            wave_map[w, e] = -1
    for w in range(tid, n_waves, nthreads):
        fetch_count[w] = 0
    if tid < 3:
        counts[tid] = 0
    cuda.syncthreads()
    if first >= 0 and first < n_exp:
        sh_mark[first] = 1  # duplicates store the same value
    for i in range(tid + nthreads, ids.shape[0], nthreads):
        e = ids[i]
        if e >= 0 and e < n_exp:
            sh_mark[e] = 1
    cuda.syncthreads()
    for e in range(tid, n_exp, nthreads):  # hits (their waves below, in expert order)
        if sh_mark[e] == 0:
            continue
        s = sh_slot[e]
        if s < 0:
            cuda.atomic.add(counts, 2, 1)
            continue
        sh_mark[e] = 2
        sh_stamp[s] = now
        cuda.atomic.add(counts, 0, 1)
        if sh_pref[s] != 0:
            sh_pref[s] = 0
            cuda.atomic.add(counts, 1, 1)
    cuda.syncthreads()
    if lfu:  # the step's distinct experts (hits + misses) counted, after the halvings their uses bring
        halvings = min((uses + counts[0] + counts[2]) // LFU_HALF_LIFE, 31)
        for e in range(tid, n_exp, nthreads):
            c = sh_count[e] >> halvings
            if sh_mark[e] != 0:
                c = min(c + LFU_UNIT, LFU_MAX)
            sh_count[e] = c
        cuda.syncthreads()
    missed = 0  # warp 0's lanes all count (thread MISSES reports it)
    if tid < WARP:  # warp 0: hit k of the step (in expert order) computes in wave k // capacity
        rank = 0
        for base in range(0, n_exp, WARP):
            e = base + lane
            hit = e < n_exp and sh_mark[e] == 2
            mask = _ballot(hit)
            if hit:
                w = (rank + cuda.popc(mask & ((np.int64(1) << lane) - 1))) // capacity
                wave_map[w, e] = sh_slot[e]
                sh_busy[sh_slot[e]] = w
            rank += cuda.popc(mask)
        _warp_sync()  # sh_busy written by the hit's lane, read below by the slot's owner
    if tid < WARP and counts[2] > 0:  # warp 0: the misses in expert order
        in_wave = counts[0] % capacity
        w = counts[0] // capacity
        c = 0
        for base in range(0, n_exp, WARP):
            e = base + lane
            mask = _ballot(e < n_exp and sh_mark[e] == 1)
            while mask != 0 and w < n_waves:
                low = mask & -mask
                mask ^= low
                e = base + cuda.popc(low - 1)
                if in_wave == capacity:
                    w += 1
                    in_wave = 0
                    c = 0
                    if w == n_waves:
                        break  # the launcher sizes W so the union always fits
                s = _victim(lane, n_slots, sh_expert, sh_stamp, sh_busy, w, guard, now, False, sh_count)
                if s % WARP == lane:  # the slot's owner applies the fill: slot state never crosses lanes
                    _fill(sh_slot, sh_expert, sh_stamp, sh_pref, s, e, now)
                    sh_busy[s] = w
                if lane == 0:
                    wave_map[w, e] = s
                    fetch_expert[w, c] = e
                    fetch_slot[w, c] = s
                    fetch_count[w] = c + 1
                c += 1
                missed += 1
                in_wave += 1
    cuda.syncthreads()
    _store(tid, nthreads, slot_of, expert_in, stamp, prefetched, sh_slot, sh_expert, sh_stamp, sh_pref)
    if lfu:
        for e in range(tid, n_exp, nthreads):
            freq[e] = sh_count[e]
        if tid == 0:
            freq[n_exp] = (uses + counts[0] + counts[2]) % LFU_HALF_LIFE
    if tid == HITS:
        stats[HITS] = totals + counts[0]
    elif tid == MISSES:
        stats[MISSES] = totals + missed
    elif tid == PREFETCHES_USED:
        stats[PREFETCHES_USED] = totals + counts[1]


@cached_jit
def _plan_prefetch_kernel(pred_a, pred_b, tick, slot_of, expert_in, stamp, prefetched, pf_expert, pf_slot, pf_count,
                          stats, freq, policy):
    """Module docstring: pred_a [na], pred_b [nb] int32 predicted ids (-1: none); pf_expert / pf_slot [S]; pf_count
    [1]; freq [E + 1] (read only: predictions count no use)."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    lane = tid % WARP
    n_exp = slot_of.shape[0]
    n_slots = expert_in.shape[0]
    sh_slot = cuda.shared.array(MAX_EXPERTS, np.int32)
    votes = cuda.shared.array(MAX_EXPERTS, np.int32)
    voted = cuda.shared.array(MAX_EXPERTS, np.int32)  # the voted experts, in arrival order
    ranked = cuda.shared.array(MAX_EXPERTS, np.int32)  # the voted experts, most votes first (ties: lower id)
    sh_expert = cuda.shared.array(MAX_SLOTS, np.int32)
    sh_stamp = cuda.shared.array(MAX_SLOTS, np.int32)
    sh_pref = cuda.shared.array(MAX_SLOTS, np.int32)
    sh_count = cuda.shared.array(MAX_EXPERTS, np.int32)
    n_voted = cuda.shared.array(1, np.int32)
    now = tick[0]
    issued = stats[PREFETCHES_ISSUED] if tid == 0 else 0  # loaded with the state, added to at the end
    _load(tid, nthreads, slot_of, expert_in, stamp, prefetched, sh_slot, votes, sh_expert, sh_stamp, sh_pref)
    _load_counts(tid, nthreads, freq, sh_count, n_exp, policy == POLICY_LFU)
    if tid == 0:
        n_voted[0] = 0
    cuda.syncthreads()
    for i in range(tid, pred_a.shape[0] + pred_b.shape[0], nthreads):
        e = pred_a[i] if i < pred_a.shape[0] else pred_b[i - pred_a.shape[0]]
        if e >= 0 and e < n_exp and cuda.atomic.add(votes, e, 1) == 0:
            voted[cuda.atomic.add(n_voted, 0, 1)] = e
    cuda.syncthreads()
    n = n_voted[0]
    for k in range(tid, n, nthreads):  # rank: the voted experts ahead of e (keys distinct: ranks are a permutation)
        e = voted[k]
        v = votes[e]
        rank = 0
        for j in range(n):
            f = voted[j]
            u = votes[f]
            if u > v or (u == v and f < e):
                rank += 1
        ranked[rank] = e
    cuda.syncthreads()
    count = 0
    if tid < WARP:  # warp 0: the predictions in rank order
        for r in range(n):
            _warp_sync()  # the previous fill's slot_of writes, by its slot's owner, before any lane reads slot_of
            e = ranked[r]
            s = sh_slot[e]
            if s >= 0:
                if s % WARP == lane:
                    sh_stamp[s] = now  # resident: protected for this step
                continue
            s = _victim(lane, n_slots, sh_expert, sh_stamp, sh_stamp, -1, 0, now, True, sh_count)
            if s < 0:
                break
            if s % WARP == lane:
                _fill(sh_slot, sh_expert, sh_stamp, sh_pref, s, e, now)
                sh_pref[s] = 1
            if lane == 0:
                pf_expert[count] = e
                pf_slot[count] = s
            count += 1
    cuda.syncthreads()
    _store(tid, nthreads, slot_of, expert_in, stamp, prefetched, sh_slot, sh_expert, sh_stamp, sh_pref)
    if tid == 0:
        pf_count[0] = count
        stats[PREFETCHES_ISSUED] = issued + count


def _check(name, a, dtype, ndim):
    if a.dtype != dtype or a.ndim != ndim or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name} must be C-contiguous {np.dtype(dtype).name} with {ndim} dims, got {a.dtype} "
                         f"{list(a.shape)}")


def check_layer_size(num_experts: int, num_slots: int) -> None:
    """Refuses a layer the kernels' shared-memory arrays cannot hold (one line naming the limits)."""
    if not 1 <= num_experts <= MAX_EXPERTS or not 1 <= num_slots <= MAX_SLOTS:
        raise ValueError(f"the device slot map holds 1..{MAX_EXPERTS} experts and 1..{MAX_SLOTS} slots per layer, "
                         f"got {num_experts} experts and {num_slots} slots")


def _check_state(E, S, **arrays):
    sizes = {"slot_of": E, "mark": E, "expert_in": S, "stamp": S, "prefetched": S, "busy": S, "tick": 1,
             "stats": 4, "pf_count": 1, "pf_expert": S, "pf_slot": S, "freq": E + 1}
    for name, a in arrays.items():
        _check(name, a, np.int64 if name == "stats" else np.int32, 1)
        if a.shape[0] != sizes[name]:
            raise ValueError(f"{name} must have {sizes[name]} entries, got {a.shape[0]}")


def launch_advance_tick(tick, stream=0) -> None:
    """tick [1] int32 += 1: a new step (launched once per step, before the first plan)."""
    _check_state(1, 1, tick=tick)
    _advance_tick_kernel[1, 1, stream](tick)


def _check_policy(policy: int) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES} (POLICY_LRU, POLICY_LFU), got {policy}")


def launch_plan_demand(ids, tick, slot_of, expert_in, stamp, prefetched, busy, mark, wave_map, fetch_expert,
                       fetch_slot, fetch_count, stats, freq, stream=0, policy: int = POLICY_LRU,
                       pipelined: bool = False) -> None:
    """ids [n] int32 the step's routed experts of one layer; the layer's state (freq [E + 1]); wave_map [W, E],
    fetch_expert / fetch_slot [W, S], fetch_count [W] int32 (W >= ceil(min(n, E) / C): every wave the union can
    need, C the wave capacity: S, or S // 2 pipelined)."""
    E, S = slot_of.shape[0], expert_in.shape[0]
    check_layer_size(E, S)
    _check_policy(policy)
    if pipelined and S < 2:
        raise ValueError(f"pipelined waves need 2 slots per layer at least, got {S}")
    C = S // 2 if pipelined else S
    _check_state(E, S, tick=tick, slot_of=slot_of, expert_in=expert_in, stamp=stamp, prefetched=prefetched,
                 busy=busy, mark=mark, stats=stats, freq=freq)
    _check("ids", ids, np.int32, 1)
    W = wave_map.shape[0]
    for name, a, shape in (("wave_map", wave_map, (W, E)), ("fetch_expert", fetch_expert, (W, S)),
                           ("fetch_slot", fetch_slot, (W, S)), ("fetch_count", fetch_count, (W,))):
        _check(name, a, np.int32, len(shape))
        if a.shape != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(a.shape)}")
    if W * C < min(ids.shape[0], E):
        raise ValueError(f"{W} waves of {C} experts cannot hold the union of {ids.shape[0]} routed ids")
    _plan_demand_kernel[1, THREADS, stream](ids, tick, slot_of, expert_in, stamp, prefetched, wave_map, fetch_expert,
                                            fetch_slot, fetch_count, stats, freq, np.int64(policy), np.int64(C),
                                            np.int64(1 if pipelined else 0))


def launch_plan_prefetch(pred_a, pred_b, tick, slot_of, expert_in, stamp, prefetched, mark, pf_expert, pf_slot,
                         pf_count, stats, freq, stream=0, policy: int = POLICY_LRU) -> None:
    """pred_a [na], pred_b [nb] int32 predicted expert ids of one layer (-1: none); its state (freq [E + 1]); the
    copies out."""
    E, S = slot_of.shape[0], expert_in.shape[0]
    check_layer_size(E, S)
    _check_policy(policy)
    _check_state(E, S, tick=tick, slot_of=slot_of, expert_in=expert_in, stamp=stamp, prefetched=prefetched,
                 mark=mark, stats=stats, pf_expert=pf_expert, pf_slot=pf_slot, pf_count=pf_count, freq=freq)
    _check("pred_a", pred_a, np.int32, 1)
    _check("pred_b", pred_b, np.int32, 1)
    _plan_prefetch_kernel[1, THREADS, stream](pred_a, pred_b, tick, slot_of, expert_in, stamp, prefetched, pf_expert,
                                              pf_slot, pf_count, stats, freq, np.int64(policy))


def sm90_signatures():
    """(python function, numba signature) of every kernel, for the sm_90 compile check."""
    i1, i2, l1, i64 = types.int32[::1], types.int32[:, ::1], types.int64[::1], types.int64
    return [
        (_advance_tick_kernel.py_func, (i1,)),
        (_plan_demand_kernel.py_func, (i1, i1, i1, i1, i1, i1, i2, i2, i2, i1, l1, i1, i64, i64, i64)),
        (_plan_prefetch_kernel.py_func, (i1, i1, i1, i1, i1, i1, i1, i1, i1, i1, l1, i1, i64)),
    ]
