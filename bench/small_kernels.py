"""The small per-token kernels of a decode step under their current launch shape against the previous one, in
one run (GPU; qwen3moe shape: D 2048, H 32, Hkv 4, Hd 128, top-8).

- rmsnorm over per-head rows [T*H, 128] (the q/k norms): `row_threads` (128 threads a row) vs rmsnorm.THREADS;
- rope_kv_write [T tokens] and moe_combine [T tokens x 8 experts x 2048]: rows spread over blocks
  (`numeric.blocks_per_row`) vs one block per token (SPREAD_TARGET_BLOCKS = 1).
Both shapes of each kernel give the same bits (tested in tests/expert_service/kernels); only time differs.
GPU time per launch: `--repeats` launches captured in one CUDA graph and replayed between two events
(bench/kernels.py `graph_timed`). One line per case with both times and the ratio previous / current (> 1:
current faster); JSON to --out.

    python bench/small_kernels.py --out out/small_kernels.json
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

D, H, HKV, HD, K = 2048, 32, 4, 128, 8
TOKENS = (1, 16, 64, 2048)


def cases(T: int, rng) -> dict:
    """name -> (launch(i, stream), set_previous(bool)) for a step of T tokens."""
    import expert_service.kernels.numeric as numeric
    from expert_service.kernels.moe_combine import launch_moe_combine
    from expert_service.kernels.rmsnorm import THREADS, launch_rmsnorm
    from expert_service.kernels.rope_kv_write import launch_rope_kv_write
    dev = lambda a: cuda.to_device(np.ascontiguousarray(a))    # noqa: E731
    heads = dev(rng.standard_normal((T * H, HD), dtype=np.float32))
    norm_w = dev(rng.standard_normal(HD, dtype=np.float32))
    q = dev(rng.standard_normal((T, H, HD), dtype=np.float32))
    k, v = (dev(rng.standard_normal((T, HKV, HD), dtype=np.float32)) for _ in range(2))
    positions = dev(rng.integers(0, 4096, T).astype(np.int32))
    inv_freq = dev((1.0 / 1e6 ** (np.arange(0, HD, 2) / HD)).astype(np.float32))
    slots = dev(rng.permutation(T * 4)[:T].astype(np.int32))
    k_pool, v_pool = (cuda.device_array((T * 4 // 16 + 1, 16, HKV, HD), np.uint16) for _ in range(2))
    y = dev(rng.standard_normal((T * K, D), dtype=np.float32))
    position = dev(rng.permutation(T * K).astype(np.int32))
    weights = dev(rng.random((T, K), dtype=np.float32))
    h = dev(rng.standard_normal((T, D), dtype=np.float32))
    state = {"previous": False}
    spread_default = numeric.SPREAD_TARGET_BLOCKS      # every case ends with set_previous(False): restored

    def spread(previous: bool) -> None:
        numeric.SPREAD_TARGET_BLOCKS = 1 if previous else spread_default
    return {
        "rmsnorm_heads": (lambda i, st: launch_rmsnorm(heads, norm_w, 1e-6, heads, stream=st,
                                                       threads=THREADS if state["previous"] else None),
                          lambda previous: state.update(previous=previous)),
        "rope_kv_write": (lambda i, st: launch_rope_kv_write(q, k, v, positions, inv_freq, 1.0, slots, k_pool, v_pool,
                                                             stream=st), spread),
        "moe_combine": (lambda i, st: launch_moe_combine(y, position, weights, h, stream=st), spread),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/small_kernels.json")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results = {"device": cuda.get_current_device().name, "repeats": args.repeats, "cases": []}
    for T in TOKENS:
        for name, (launch, set_previous) in cases(T, rng).items():
            times = {}
            for label, previous in (("previous", True), ("current", False)):
                set_previous(previous)
                times[label] = graph_timed(launch, stream, args.repeats) * 1e6
            set_previous(False)
            row = {"kernel": name, "tokens": T, "previous_us": times["previous"], "current_us": times["current"],
                   "previous_over_current": times["previous"] / times["current"]}
            results["cases"].append(row)
            print(f"{name:14s} T={T:5d}  previous {times['previous']:8.2f} us  current {times['current']:8.2f} us  "
                  f"x{row['previous_over_current']:.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
