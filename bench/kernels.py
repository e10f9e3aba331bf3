"""Per-kernel timings at the decode shapes of mixtral-shape (GPU): where a decode step's time goes.

Each kernel is launched `--repeats` times between two CUDA events on one stream; the time per launch
includes Numba's dispatcher cost (tens of µs), so small kernels read high -- graphs remove that cost in
the decoder. Bytes are the weight/KV bytes the kernel must read; GB/s = bytes / time. Writes JSON.

    python bench/kernels.py --out out/kernels.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

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
    args = parser.parse_args()
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
