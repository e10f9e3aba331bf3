"""The slot-map plan kernels (expert_service.kernels.expert_slot_map) against the previous one-thread kernels, in
one run (GPU): per MoE layer and step, what a cached step pays for its bookkeeping before any copy.

Each case replays a sequence of steps on one layer's state: the tick, then the demand plan of that step's routed
ids (or the prefetch plan of its predictions). Both implementations replay the same sequence from the same empty
state, and their final states are compared (`same_state`: they must make the same decisions). Cases:
- decode_hits: qwen3moe-shape layer (E 128, 32 slots), b=1, the same 8 experts every step (all hits, as at a
  0.99 hit rate);
- decode_misses: the same layer, 8 random experts a step (most miss);
- batch16: 16 tokens x 8 random experts a step over 32 slots (4 waves);
- prefetch: 8 + 8 predicted ids a step (a skewed plan and a uniform lookahead), E 128, 32 slots (no demand);
- e256_decode: E 256, 64 slots, 8 random experts a step; mixtral_decode: E 8, 2 slots, 2 random experts.
GPU time per step: `--repeats` steps captured in one CUDA graph and replayed between two events (bench/kernels.py
`graph_timed`), tick included (`tick_us`: the tick alone). One line per case with both times and the ratio
previous / current (> 1: current faster); JSON to --out.

    python bench/slot_map.py --out out/slot_map.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels import graph_timed  # noqa: E402
from expert_service.experts.slot_map_reference import waves_needed  # noqa: E402
from expert_service.kernels import expert_slot_map as current  # noqa: E402

CASES = {  # name -> (E, S, tokens T, top-k K, kind): T * K ids a step (prefetch: T * K planned + T * K ahead)
    "decode_hits": (128, 32, 1, 8, "hits"),
    "decode_misses": (128, 32, 1, 8, "demand"),
    "batch16": (128, 32, 16, 8, "demand"),
    "prefetch": (128, 32, 1, 8, "prefetch"),
    "e256_decode": (256, 64, 1, 8, "demand"),
    "mixtral_decode": (8, 2, 1, 2, "demand"),
}
SEQUENCE = 64  # distinct steps of ids, cycled
DEMAND_ARGS = "tick slot_of expert_in stamp prefetched busy mark wave_map fetch_expert fetch_slot fetch_count stats"
PREFETCH_ARGS = "tick slot_of expert_in stamp prefetched mark pf_expert pf_slot pf_count stats"
STATE = ("slot_of", "expert_in", "stamp", "prefetched", "stats")


@cuda.jit(device=True, inline=True)
def _prev_victim(expert_in, stamp, busy, wave, protect_tick):
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
def _prev_fill(slot_of, expert_in, stamp, prefetched, s, e, tick):
    old = expert_in[s]
    if old >= 0:
        slot_of[old] = -1
    expert_in[s] = e
    slot_of[e] = s
    stamp[s] = tick
    prefetched[s] = 0


@cuda.jit
def _prev_demand(
    ids, tick, slot_of, expert_in, stamp, prefetched, busy, mark, wave_map, fetch_expert, fetch_slot, fetch_count, stats
):
    """The previous plan_demand: one thread on global memory (grid = block = 1)."""
    n_exp, n_slots, n_waves, now = slot_of.shape[0], expert_in.shape[0], wave_map.shape[0], tick[0]
    for e in range(n_exp):
        mark[e] = 0
    for i in range(ids.shape[0]):
        if ids[i] >= 0 and ids[i] < n_exp:
            mark[ids[i]] = 1
    for s in range(n_slots):
        busy[s] = -1
    for w in range(n_waves):
        fetch_count[w] = 0
        for e in range(n_exp):
            wave_map[w, e] = -1
    in_wave = 0
    for e in range(n_exp):
        s = slot_of[e]
        if mark[e] != 0 and s >= 0:
            mark[e] = 2
            wave_map[0, e] = s
            busy[s] = 0
            stamp[s] = now
            stats[0] += 1
            if prefetched[s] != 0:
                prefetched[s] = 0
                stats[3] += 1
            in_wave += 1
    w = 0
    for e in range(n_exp):
        if mark[e] != 1:
            continue
        if in_wave == n_slots:
            w += 1
            in_wave = 0
        if w >= n_waves:
            break
        s = _prev_victim(expert_in, stamp, busy, w, -1)
        _prev_fill(slot_of, expert_in, stamp, prefetched, s, e, now)
        busy[s] = w
        wave_map[w, e] = s
        c = fetch_count[w]
        fetch_expert[w, c] = e
        fetch_slot[w, c] = s
        fetch_count[w] = c + 1
        stats[1] += 1
        in_wave += 1


@cuda.jit
def _prev_prefetch(
    pred_a, pred_b, tick, slot_of, expert_in, stamp, prefetched, mark, pf_expert, pf_slot, pf_count, stats
):
    """The previous plan_prefetch: one thread, a rescan of all E votes per pick."""
    n_exp, now = slot_of.shape[0], tick[0]
    for e in range(n_exp):
        mark[e] = 0
    for i in range(pred_a.shape[0]):
        if pred_a[i] >= 0 and pred_a[i] < n_exp:
            mark[pred_a[i]] += 1
    for i in range(pred_b.shape[0]):
        if pred_b[i] >= 0 and pred_b[i] < n_exp:
            mark[pred_b[i]] += 1
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
            stamp[s] = now
            continue
        s = _prev_victim(expert_in, stamp, expert_in, -1, now)
        if s < 0:
            break
        _prev_fill(slot_of, expert_in, stamp, prefetched, s, best, now)
        prefetched[s] = 1
        pf_expert[count] = best
        pf_slot[count] = s
        count += 1
        stats[2] += 1
    pf_count[0] = count


def layer(E: int, S: int, W: int) -> dict:
    """One layer's state and outputs, as DeviceSlots holds them (empty cache)."""
    shapes = {"tick": (1, 0), "slot_of": (E, -1), "expert_in": (S, -1), "stamp": (S, 0), "prefetched": (S, 0)}
    shapes |= {"busy": (S, -1), "mark": (E, 0), "wave_map": ((W, E), -1), "fetch_expert": ((W, S), 0)}
    shapes |= {"fetch_slot": ((W, S), 0), "fetch_count": (W, 0), "pf_expert": (S, 0), "pf_slot": (S, 0)}
    shapes |= {"freq": (E + 1, 0)}  # the current kernels' policy counts (lru: untouched)
    state = {
        k: cuda.to_device(np.full(shape, v, np.int32)) for k, (shape, v) in (shapes | {"pf_count": (1, 0)}).items()
    }
    return state | {"stats": cuda.to_device(np.zeros(4, np.int64))}


def steps(rng, E: int, T: int, K: int, kind: str) -> list:
    """SEQUENCE steps of device ids [T * K] (prefetch: a skewed plan and a uniform lookahead, [T * K] each)."""
    n = T * K
    if kind == "hits":
        return [(cuda.to_device(np.arange(n, dtype=np.int32)),)] * SEQUENCE
    if kind == "prefetch":
        p = np.arange(E, 0, -1) / (E * (E + 1) / 2)
        plan = [rng.choice(E, n, p=p).astype(np.int32) for _ in range(SEQUENCE)]
        ahead = [rng.integers(0, E, n).astype(np.int32) for _ in range(SEQUENCE)]
        return [(cuda.to_device(a), cuda.to_device(b)) for a, b in zip(plan, ahead)]
    routed = [np.concatenate([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(SEQUENCE)]
    return [(cuda.to_device(ids.astype(np.int32)),) for ids in routed]


def launcher(state: dict, seq: list, kind: str, previous: bool):
    demand = [state[k] for k in DEMAND_ARGS.split()]
    prefetch = [state[k] for k in PREFETCH_ARGS.split()]

    def launch(i, stream):
        current.launch_advance_tick(state["tick"], stream=stream)
        ids = seq[i % len(seq)]
        if kind == "prefetch":
            if previous:
                _prev_prefetch[1, 1, stream](*ids, *prefetch)
            else:
                current.launch_plan_prefetch(*ids, *prefetch, state["freq"], stream=stream)
        elif previous:
            _prev_demand[1, 1, stream](*ids, *demand)
        else:
            current.launch_plan_demand(*ids, *demand, state["freq"], stream=stream)

    return launch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/slot_map.json")
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    stream = cuda.stream()
    tick = cuda.to_device(np.zeros(1, np.int32))
    tick_us = graph_timed(lambda i, s: current.launch_advance_tick(tick, stream=s), stream, args.repeats) * 1e6
    print(f"tick alone: {tick_us:.2f} us")
    results = {"repeats": args.repeats, "tick_us": tick_us, "cases": {}}
    for name in args.cases.split(","):
        E, S, T, K, kind = CASES[name]
        n = T * K
        seq = steps(np.random.default_rng(0), E, T, K, kind)
        W = waves_needed(n, E, S)
        row, finals = {"E": E, "S": S, "ids": n, "waves": W}, {}
        for label, previous in (("previous", True), ("current", False)):
            state = layer(E, S, W)
            row[f"{label}_us"] = graph_timed(launcher(state, seq, kind, previous), stream, args.repeats) * 1e6
            stream.synchronize()
            finals[label] = {k: state[k].copy_to_host() for k in STATE}
        row["ratio"] = row["previous_us"] / row["current_us"]
        row["same_state"] = all(np.array_equal(finals["previous"][k], finals["current"][k]) for k in finals["current"])
        row["stats"] = finals["current"]["stats"].tolist()
        results["cases"][name] = row
        print(
            f"{name:15s} E {E:4d} S {S:3d} ids {n:4d} waves {W}: previous {row['previous_us']:8.2f} us  current "
            f"{row['current_us']:7.2f} us  x{row['ratio']:6.1f}  same state {row['same_state']}  "
            f"hits/misses/pf/used {row['stats']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r["same_state"] for r in results["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
