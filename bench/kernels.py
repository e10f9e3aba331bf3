"""Per-kernel timings at the decode shapes of mixtral-shape (GPU): where a decode step's time goes.

Each kernel is launched `--repeats` times between two CUDA events on one stream; the time per launch
includes Numba's dispatcher cost (tens of µs), so small kernels read high -- graphs remove that cost in
the decoder. Bytes are the weight/KV bytes the kernel must read; GB/s = bytes / time. Writes JSON.

    python bench/kernels.py --out out/kernels.json

`--gemv` instead compares the one-token kernels (kernels.gemv) with the old ones (launch_linear /
launch_swiglu, moe_gate_up / moe_down) at mixtral and qwen3 decode shapes (T = 1, bf16 weights): GPU time
only (launches captured in a CUDA graph), weights rotated over copies / expert sets larger than L2, so
every byte comes from HBM. Prints TB/s old vs new; `--sweep` adds launch-shape variants of the new kernels.

    python bench/kernels.py --gemv --sweep --out out/gemv.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

D, F, E, K, H, HKV, HD, V = 4096, 14336, 8, 2, 32, 8, 128, 32000


def timed(fn, stream, repeats: int) -> float:
    from numba import cuda
    fn()
    stream.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(repeats):
        fn()
    end.record(stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / repeats * 1e-3


# ---- one-token gemv vs the old decode kernels ----
L2_FLUSH = 192 << 20        # weight bytes cycled through per measurement (H200 L2: 50 MB)
SHAPES = {                  # decode shapes: hidden D, expert F, experts E, top-k K, vocab V, q / kv widths
    "mixtral": dict(D=4096, F=14336, E=8, K=2, V=32000, Q=4096, KV=1024),
    "qwen3": dict(D=2048, F=768, E=128, K=8, V=151936, Q=4096, KV=512),
}


def graph_timed(launch, stream, repeats: int) -> float:
    """Seconds per launch of launch(i, stream), GPU time only: `repeats` launches (i = 0..repeats-1) captured
    in one CUDA graph and replayed between two events, so Numba's dispatcher cost is not counted."""
    from numba import cuda

    from expert_service.cuda.driver import Graph
    launch(0, stream)                   # compiles outside the capture
    stream.synchronize()
    with Graph(stream) as graph:
        for i in range(repeats):
            launch(i, stream)
    graph.replay()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    graph.replay()
    end.record(stream)
    end.synchronize()
    graph.close()
    return cuda.event_elapsed_time(start, end) / repeats * 1e-3


@cuda.jit
def fill_bf16(w, seed):
    """w flat uint16: hashed bf16 bits, |v| in [2^-7, 2): finite, and no host RNG for GBs of weights."""
    i = cuda.grid(1)
    if i < w.size:
        h = (i * 2654435761 + seed) % 4294967296
        w[i] = np.uint16(0x3C00 | ((h >> 7) & 0x3FF) | (((h >> 20) & 1) << 15))


def compare_gemv(args) -> int:
    """Old vs new kernels per decode matrix; results[model][name] = {bytes, old/new ms and TB/s, speedup,
    max |new - old| / max |old|}; --sweep adds results[model]["sweep"][name][plan] = TB/s."""
    from numba import cuda

    from expert_service.cuda.driver import non_blocking_stream
    from expert_service.kernels import gemv
    from expert_service.kernels.linear import launch_linear, launch_swiglu
    from expert_service.kernels.moe_ffn import moe_down, moe_gate_up
    from expert_service.moe_grouping import group_by_expert
    _, st = non_blocking_stream()
    seed = iter(range(1, 1 << 30, 7919))

    def weights(shape):
        w = cuda.device_array(shape, np.uint16)
        flat = w.reshape(w.size)
        fill_bf16[-(-w.size // 256), 256, st](flat, next(seed))
        return w

    def dense_set(n, k):
        """Copies of one [n, k] matrix, enough to cycle past L2."""
        return [weights((n, k)) for _ in range(min(16, -(-L2_FLUSH // (n * k * 2))))]

    results = {}
    for model, s in SHAPES.items():
        D, F, E, K = s["D"], s["F"], s["E"], s["K"]
        rng = np.random.default_rng(0)
        x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
        xq = cuda.to_device(rng.standard_normal((1, s["Q"])).astype(np.float32))
        experts = weights((E, 3 * F * D))
        # distinct sorted expert sets (grouped order == slot order), cycled so L2 holds none of them
        sets = [np.sort(rng.choice(E, K, replace=False)).astype(np.int32)[None] for _ in range(min(8, E // K))]
        ids = [cuda.to_device(i) for i in sets]
        groups = [group_by_expert(i, E) for i in sets]
        order = [cuda.to_device(g.order.astype(np.int32)) for g in groups]
        offsets = [cuda.to_device(g.offsets.astype(np.int32)) for g in groups]
        dense = {"q_proj": (dense_set(s["Q"], D), x), "o_proj": (dense_set(D, s["Q"]), xq),
                 "kv_proj": (dense_set(s["KV"], D), x), "router": (dense_set(E, D), x),
                 "lm_head": (dense_set(s["V"], D), x)}
        cases = {}
        for name, (ws, xin) in dense.items():
            n = ws[0].shape[0]
            y_old, y_new = cuda.device_array((1, n), np.float32), cuda.device_array((1, n), np.float32)
            cases[name] = (n * ws[0].shape[1] * 2,
                           lambda i, q, ws=ws, xin=xin, y=y_old: launch_linear(xin, ws[i % len(ws)], y, stream=q),
                           lambda i, q, plan=None, ws=ws, xin=xin, y=y_new: gemv.launch_gemv(
                               xin, ws[i % len(ws)], y, stream=q, plan=plan),
                           y_old, y_new)
        if model == "mixtral":      # dense SwiGLU (a mixtral-sized dense MLP), both kernels' fused-gate form
            gus = dense_set(2 * F, D)
            h_old, h_new = cuda.device_array((1, F), np.float32), cuda.device_array((1, F), np.float32)
            cases["swiglu_dense"] = (2 * F * D * 2,
                                     lambda i, q: launch_swiglu(x, gus[i % len(gus)], None, h_old, stream=q),
                                     lambda i, q, plan=None: gemv.launch_gemv_swiglu(
                                         x, gus[i % len(gus)], None, h_new, stream=q, plan=plan), h_old, h_new)
        hg_old, hg_new = cuda.device_array((K, F), np.float32), cuda.device_array((K, F), np.float32)
        ye_old, ye_new = cuda.device_array((K, D), np.float32), cuda.device_array((K, D), np.float32)
        n_sets = len(sets)
        cases["expert_gate_up"] = (
            K * 2 * F * D * 2,
            lambda i, q: moe_gate_up(x, order[i % n_sets], offsets[i % n_sets], experts, F, D, hg_old, stream=q),
            lambda i, q, plan=None: gemv.launch_expert_gate_up(x, ids[i % n_sets], experts, F, D, hg_new,
                                                               stream=q, plan=plan),
            hg_old, hg_new)
        cases["expert_down"] = (
            K * F * D * 2,
            lambda i, q: moe_down(hg_old, order[i % n_sets], offsets[i % n_sets], experts, F, D, ye_old, stream=q),
            lambda i, q, plan=None: gemv.launch_expert_down(hg_old, ids[i % n_sets], experts, F, D, ye_new,
                                                            stream=q, plan=plan),
            ye_old, ye_new)
        out = {}
        for name, (nbytes, old, new, y_old, y_new) in cases.items():
            t_old, t_new = graph_timed(old, st, args.repeats), graph_timed(new, st, args.repeats)
            old(0, st)
            new(0, st)
            a, b = y_old.copy_to_host(stream=st), y_new.copy_to_host(stream=st)
            st.synchronize()
            out[name] = {"bytes": nbytes, "old_ms": t_old * 1e3, "new_ms": t_new * 1e3,
                         "old_TB_per_s": nbytes / t_old / 1e12, "new_TB_per_s": nbytes / t_new / 1e12,
                         "speedup": t_old / t_new,
                         "max_rel_diff": float(np.abs(b - a).max() / max(np.abs(a).max(), 1e-30))}
            r = out[name]
            print(f"{model:8s} {name:15s} {nbytes / 1e6:9.1f} MB  old {r['old_ms']:8.4f} ms "
                  f"{r['old_TB_per_s']:5.2f} TB/s  new {r['new_ms']:8.4f} ms {r['new_TB_per_s']:5.2f} TB/s  "
                  f"x{r['speedup']:5.2f}  diff {r['max_rel_diff']:.1e}", flush=True)
        if args.sweep:
            out["sweep"] = _sweep(cases, st, args.repeats)
        results[model] = out
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def _sweep(cases, st, repeats):
    """TB/s of the new kernels under other launch shapes (Plan(rows, split, groups)) and LOADS_IN_FLIGHT."""
    from expert_service.kernels import gemv
    from expert_service.kernels.gemv import Plan
    plans = {False: [Plan(4, 1, 4), Plan(4, 1, 2), Plan(4, 2, 2), Plan(2, 1, 4), Plan(2, 2, 2), Plan(1, 1, 4),
                     Plan(1, 4, 1)],
             True: [Plan(2, 1, 4), Plan(2, 1, 2), Plan(2, 2, 2), Plan(1, 1, 4), Plan(1, 2, 2)]}
    names = [n for n in ("q_proj", "kv_proj", "lm_head", "swiglu_dense", "expert_gate_up", "expert_down")
             if n in cases]
    out = {name: {} for name in names}
    for name in names:
        nbytes, new = cases[name][0], cases[name][2]
        for plan in plans[name in ("swiglu_dense", "expert_gate_up")]:
            t = graph_timed(lambda i, q, p=plan: new(i, q, plan=p), st, repeats)
            out[name][str(tuple(plan))] = nbytes / t / 1e12
    default = gemv.LOADS_IN_FLIGHT
    for lif in (4, 16):                 # module constant read when a variant is built: rebuild all
        gemv.LOADS_IN_FLIGHT = lif
        gemv._build.cache_clear()
        for name in ("lm_head", "expert_gate_up", "expert_down"):
            out[name][f"loads_in_flight={lif}"] = cases[name][0] / graph_timed(cases[name][2], st, repeats) / 1e12
    gemv.LOADS_IN_FLIGHT = default
    gemv._build.cache_clear()
    for name in names:
        print("sweep", name, json.dumps({k: round(v, 3) for k, v in out[name].items()}), flush=True)
    return out


def main() -> int:
    from numba import cuda

    from expert_service.kernels.attention_decode import attention_decode, decode_splits
    from expert_service.kernels.expert_grouping import expert_grouping
    from expert_service.kernels.linear import launch_linear, launch_swiglu
    from expert_service.kernels.moe_combine import moe_combine
    from expert_service.kernels.moe_ffn import moe_down, moe_gate_up
    from expert_service.kernels.router_topk import router_topk
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="out/kernels.json")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--gemv", action="store_true", help="old vs one-token gemv kernels only")
    parser.add_argument("--sweep", action="store_true", help="with --gemv: launch-shape variants too")
    args = parser.parse_args()
    if args.gemv:
        return compare_gemv(args)
    rng = np.random.default_rng(0)
    st = cuda.stream()

    def dev(shape, dtype=np.float32, scale=0.02):
        if dtype == np.uint16:
            host = (rng.standard_normal(shape).astype(np.float32) * scale).view(np.uint32) >> 16
            return cuda.to_device(host.astype(np.uint16), stream=st)
        return cuda.to_device((rng.standard_normal(shape) * scale).astype(dtype), stream=st)

    w_q = dev((D, D), np.uint16)
    w_lm = dev((V, D), np.uint16)
    w_gate, w_up = dev((F, D), np.uint16), dev((F, D), np.uint16)
    stride = 3 * F * D
    experts = dev((E, stride), np.uint16)
    context = 128
    results = {}
    for T in (1, 16, 64):
        x = dev((T, D), scale=1.0)
        out = {}
        y = cuda.device_array((T, D), np.float32, stream=st)
        out["linear_q_4096x4096"] = (timed(lambda: launch_linear(x, w_q, y, stream=st), st, args.repeats), D * D * 2)
        ylm = cuda.device_array((T, V), np.float32, stream=st)
        out["linear_lm_head"] = (timed(lambda: launch_linear(x, w_lm, ylm, stream=st), st, args.repeats), V * D * 2)
        h = cuda.device_array((T, F), np.float32, stream=st)
        out["swiglu_dense_14336"] = (timed(lambda: launch_swiglu(x, w_gate, w_up, h, stream=st), st, args.repeats),
                                     2 * F * D * 2)
        logits = dev((T, E), scale=1.0)
        ids = cuda.device_array((T, K), np.int32, stream=st)
        weights = cuda.device_array((T, K), np.float32, stream=st)
        out["router_topk"] = (timed(lambda: router_topk(logits, ids, weights, True, stream=st), st, args.repeats), 0)
        counts, offsets = cuda.device_array(E, np.int32), cuda.device_array(E + 1, np.int32)
        order, position = cuda.device_array(T * K, np.int32), cuda.device_array(T * K, np.int32)
        out["expert_grouping"] = (timed(lambda: expert_grouping(ids, counts, offsets, order, position, stream=st), st,
                                        args.repeats), 0)
        active = len(np.unique(ids.copy_to_host()))
        hg = cuda.device_array((T * K, F), np.float32, stream=st)
        ye = cuda.device_array((T * K, D), np.float32, stream=st)
        out["moe_gate_up"] = (timed(lambda: moe_gate_up(x, order, offsets, experts, F, D, hg, stream=st), st,
                                    args.repeats), active * 2 * F * D * 2)
        out["moe_down"] = (timed(lambda: moe_down(hg, order, offsets, experts, F, D, ye, stream=st), st,
                                 args.repeats), active * F * D * 2)
        hh = dev((T, D), scale=1.0)
        out["moe_combine"] = (timed(lambda: moe_combine(ye, position, weights, hh, stream=st), st, args.repeats), 0)
        blocks = -(-context // 16)
        pool_k, pool_v = dev((T * blocks, 16, HKV, HD), np.uint16), dev((T * blocks, 16, HKV, HD), np.uint16)
        q = dev((T, H, HD), scale=1.0)
        tables = cuda.to_device(np.arange(T * blocks, dtype=np.int32).reshape(T, blocks))
        lens = cuda.to_device(np.full(T, context, np.int32))
        pos = cuda.to_device(np.full(T, context - 1, np.int32))
        P = decode_splits(T, H, HKV, 4096)
        po, pm = cuda.device_array((T, H, P, HD), np.float32), cuda.device_array((T, H, P, 2), np.float32)
        ao = cuda.device_array((T, H, HD), np.float32)
        out["attention_decode_ctx128"] = (timed(lambda: attention_decode(q, pool_k, pool_v, tables, lens, pos, 0,
                                                                         HD ** -0.5, ao, po, pm, stream=st), st,
                                                args.repeats), T * context * 2 * HKV * HD * 2)
        results[str(T)] = {name: {"ms": t * 1e3, "bytes": b, "GB_per_s": (b / t / 1e9) if b else None}
                           for name, (t, b) in out.items()}
        results[str(T)]["active_experts"] = active
        print(T, json.dumps(results[str(T)], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
