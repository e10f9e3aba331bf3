"""A demand copy beside a prefetch copy, with and without the prefetch yielding (kernels/expert_fetch.py).

Both copies are the expert-fetch kernel reading mapped host memory over PCIe, on two streams: a demand copy of
DEMAND_BLOCKS blocks starts shortly after a speculative copy of PREFETCH_BLOCKS blocks. Three runs, each repeated
and summarised by its median: the demand copy alone, both PLAIN (they share the link), and both with the demand
count (the prefetch waits while the demand copy runs). Prints each time and the ratios against the demand copy
alone; writes them as JSON.

    python bench/fetch_yield.py --out bench/results/gpu-fetch-yield.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK_BYTES = 8 << 20  # about a qwen3moe-shape expert
DEMAND_BLOCKS, PREFETCH_BLOCKS = 2, 8
REPEATS = 7
HEAD_START_S = 0.0003  # the prefetch is under way when the demand copy starts, as when a layer misses mid-prefetch


def _run(mode: str, host, demand_dst, prefetch_dst, lists, active) -> tuple[float, float]:
    """(demand ms, prefetch ms) of one run: mode "alone", "shared" (PLAIN) or "yield"."""
    from numba import cuda

    from expert_service.kernels.expert_fetch import launch_expert_fetch

    demand_stream, prefetch_stream = lists["streams"]
    marks = [cuda.event() for _ in range(4)]
    counter = active if mode == "yield" else None
    if mode != "alone":
        marks[2].record(prefetch_stream)
        launch_expert_fetch(host, prefetch_dst, *lists["prefetch"], BLOCK_BYTES, prefetch_stream, counter, True)
        marks[3].record(prefetch_stream)
    time.sleep(HEAD_START_S)
    marks[0].record(demand_stream)
    launch_expert_fetch(host, demand_dst, *lists["demand"], BLOCK_BYTES, demand_stream, counter)
    marks[1].record(demand_stream)
    cuda.synchronize()
    prefetch = marks[2].elapsed_time(marks[3]) if mode != "alone" else 0.0
    return marks[0].elapsed_time(marks[1]), prefetch


def measure() -> dict:
    from numba import cuda

    words = BLOCK_BYTES // 4
    blocks = DEMAND_BLOCKS + PREFETCH_BLOCKS
    host = cuda.mapped_array(blocks * words, dtype=np.uint32)
    np.asarray(host)[:] = np.random.default_rng(0).integers(1, 2**32, blocks * words, dtype=np.uint32)
    demand_dst = cuda.device_array(DEMAND_BLOCKS * words, np.uint32)
    prefetch_dst = cuda.device_array(PREFETCH_BLOCKS * words, np.uint32)

    def ids(values):
        return cuda.to_device(np.asarray(values, np.int32))

    lists = {
        "streams": (cuda.stream(), cuda.stream()),
        "demand": (ids(range(DEMAND_BLOCKS)), ids(range(DEMAND_BLOCKS)), ids([DEMAND_BLOCKS])),
        "prefetch": (ids(range(DEMAND_BLOCKS, blocks)), ids(range(PREFETCH_BLOCKS)), ids([PREFETCH_BLOCKS])),
    }
    active = cuda.to_device(np.zeros(1, np.int32))
    modes = ("alone", "shared", "yield")
    for mode in modes:  # compiles and warms each role
        _run(mode, host, demand_dst, prefetch_dst, lists, active)
    times: dict[str, list] = {mode: [] for mode in modes}
    for _ in range(REPEATS):  # interleaved, so a drift in the link's rate touches every mode alike
        for mode in modes:
            times[mode].append(_run(mode, host, demand_dst, prefetch_dst, lists, active))
    if active.copy_to_host()[0] != 0:
        raise RuntimeError(f"the demand count ended at {active.copy_to_host()[0]}, not 0")
    want = np.asarray(host).reshape(blocks, words)
    np.testing.assert_array_equal(demand_dst.copy_to_host().reshape(DEMAND_BLOCKS, words), want[:DEMAND_BLOCKS])
    np.testing.assert_array_equal(prefetch_dst.copy_to_host().reshape(PREFETCH_BLOCKS, words), want[DEMAND_BLOCKS:])
    name = getattr(cuda.get_current_device(), "name", "simulator")
    out = {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "block_bytes": BLOCK_BYTES,
        "demand_blocks": DEMAND_BLOCKS,
        "prefetch_blocks": PREFETCH_BLOCKS,
        "repeats": REPEATS,
    }
    for mode in modes:
        out[f"{mode}_demand_ms"] = statistics.median(t[0] for t in times[mode])
        if mode != "alone":
            out[f"{mode}_prefetch_ms"] = statistics.median(t[1] for t in times[mode])
    out["demand_shared_x_alone"] = out["shared_demand_ms"] / out["alone_demand_ms"]
    out["demand_yield_x_alone"] = out["yield_demand_ms"] / out["alone_demand_ms"]
    out["prefetch_yield_x_shared"] = out["yield_prefetch_ms"] / out["shared_prefetch_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    result = measure()
    Path(args.out).write_text(json.dumps(result, indent=1))
    mib = BLOCK_BYTES >> 20
    print(
        f"{result['device']}: demand copy of {DEMAND_BLOCKS} x {mib} MiB alone {result['alone_demand_ms']:.3f} ms; "
        f"beside a {PREFETCH_BLOCKS} x {mib} MiB prefetch, sharing {result['shared_demand_ms']:.3f} ms "
        f"({result['demand_shared_x_alone']:.2f}x), prefetch yielding {result['yield_demand_ms']:.3f} ms "
        f"({result['demand_yield_x_alone']:.2f}x); the prefetch {result['shared_prefetch_ms']:.3f} / "
        f"{result['yield_prefetch_ms']:.3f} ms ({result['prefetch_yield_x_shared']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
