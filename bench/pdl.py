"""Programmatic dependent launch (Hopper) on a chain of one-token GEMVs, in one run (GPU): what a decode step's
kernel boundaries cost, and how much of it programmatic graph edges give back.

A b = 1 decode step is ~70 small kernels in a row; each boundary costs the next kernel's launch, its ramp-up (the
first bytes arrive a memory latency after its first block starts) and the previous kernel's tail (SMs idle while
its last blocks finish). With a programmatic edge (CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC from the kernel port
PROGRAMMATIC) the dependent's blocks may start once every block of its predecessor has executed
`griddepcontrol.launch_dependents`; they stream the weights they need into registers and execute
`griddepcontrol.wait` only before reading the activation the predecessor writes.

The chain: LAUNCHES GEMVs y = W x, W [N, K = 2048] bf16 (N = 2048: 8 MB, a qwen3moe-shape projection; N = 8192:
32 MB), each reading the first K values of the previous one's y as its x; the weights rotate over enough copies
that every byte comes from HBM. Variants, each captured as one graph and replayed between events:
- plain:       a kernel without griddepcontrol, stream-ordered edges (what the decoder runs today);
- pdl_off:     the PDL kernel (launch_dependents first, weights loaded, wait, then x), stream-ordered edges: the
               instructions' own cost (both return at once without a programmatic edge);
- pdl:         the PDL kernel, every kernel -> kernel edge made programmatic.
Every variant's final y, read back after one replay of its own graph from the same x, must equal plain's bit for
bit (the same arithmetic in the same order), and plain's must match numpy. Printed per N: us a GEMV per variant, TB/s, and pdl's speed-up over plain.

    python bench/pdl.py --out out/pdl.json
    python bench/pdl.py --load-order     # no GPU: where ptxas put the loads around griddepcontrol.wait
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda, types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from expert_service.kernels.numeric import WARP, u32_as_f32, warp_sum  # noqa: E402
from expert_service.kernels.programmatic import dispatcher_handles  # noqa: E402
from expert_service.kernels.ptx import (  # noqa: E402
    griddep_launch_dependents,
    griddep_wait,
    ld_stream_v4_coherent,
    ld_v4_coherent,
)

K = 2048  # input width: 256 chunks of 8 bf16
WARPS = 8  # warps a block, one output row each
LAUNCHES = 64  # GEMVs in the chain (a replay)
COPIES_BYTES = 256 << 20  # weight bytes the chain rotates over (H200 L2: 50 MB)
ROWS = (2048, 8192)


@functools.cache
def chain_kernel(pdl: bool, k: int = K):
    """y[r] = sum_i W[r, i] x[i] for row r = block * WARPS + warp: W [N * k / 2] uint32 (bf16 pairs), x [>= k]
    float32, y [N] float32 (k a multiple of 8 * 32). With pdl, the weights are loaded before griddepcontrol.wait
    and x after it. Every variant loads without `.nc` (ptx.ld_*_coherent): ptxas hoists the wait above `.nc`
    loads, and the memory model does not cover them for data a predecessor writes."""
    per_lane = k // 8 // WARP

    @cuda.jit
    def kernel(w, x, y, n_rows):
        if pdl:
            griddep_launch_dependents()
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        row = cuda.blockIdx.x * WARPS + warp
        raw = cuda.local.array((per_lane, 4), types.uint32)
        if row < n_rows:
            for i in range(per_lane):
                raw[i, 0], raw[i, 1], raw[i, 2], raw[i, 3] = ld_stream_v4_coherent(
                    w, row * (k // 2) + 4 * (lane + WARP * i)
                )
        if pdl:
            griddep_wait()
        acc = np.float32(0.0)
        if row < n_rows:
            for i in range(per_lane):
                c = lane + WARP * i
                for q in range(2):
                    x0, x1, x2, x3 = ld_v4_coherent(x, 8 * c + 4 * q)
                    a, b = raw[i, 2 * q], raw[i, 2 * q + 1]
                    acc += (
                        u32_as_f32(a << np.uint32(16)) * x0
                        + u32_as_f32(a & np.uint32(0xFFFF0000)) * x1
                        + u32_as_f32(b << np.uint32(16)) * x2
                        + u32_as_f32(b & np.uint32(0xFFFF0000)) * x3
                    )
        acc = warp_sum(acc)
        if row < n_rows and lane == 0:
            y[row] = acc

    return kernel


def reference(weights: list[np.ndarray], x: np.ndarray, order: list[int]) -> np.ndarray:
    """The chain in float64 numpy: weights[i] [N, k] float32 (the bf16 values, N >= k), order[j] the copy launch j
    reads; each launch's x is the first k values of the previous y."""
    v = x.astype(np.float64)
    for j in order:
        v = weights[j].astype(np.float64) @ v[: weights[j].shape[1]]
    return v


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even bf16 bit patterns (uint16) of float32 values."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def load_order() -> dict:
    """Where ptxas put the PDL kernel's loads around griddepcontrol.wait (ACQBULK) in its sm_90 SASS (nvJitLink +
    nvdisasm, no GPU; outside the CUDA simulator): the indices of the weight loads (L1::no_allocate, `.NA.`), of
    the wait and of the loads of x among the kernel's global loads. The bench is only meaningful if every weight
    load comes before the wait and every load of x after it."""
    import subprocess
    import tempfile

    from bench.kernel_resources import link_report, nvdisasm_path

    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        raise RuntimeError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    signature = (types.uint32[::1], types.float32[::1], types.float32[::1], types.int32)
    ptx, _ = cuda.compile_ptx(chain_kernel(True).py_func, signature, cc=(9, 0))
    _, cubin = link_report(ptx)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pdl.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    ops = [line.split("*/")[1].strip() for line in sass.splitlines() if "LDG" in line or "ACQBULK" in line]
    return {
        "weights": [i for i, op in enumerate(ops) if "LDG" in op and ".NA." in op],
        "wait": [i for i, op in enumerate(ops) if op.startswith("ACQBULK")],
        "x": [i for i, op in enumerate(ops) if "LDG" in op and ".NA." not in op],
    }


def prefetches_before_the_wait(order: dict) -> bool:
    return len(order["wait"]) == 1 and max(order["weights"]) < order["wait"][0] < min(order["x"])


def run_chain(kernel, weights, buffers, n_rows: int, stream, launches: int = LAUNCHES) -> None:
    """launches GEMVs, launch j on weight copy j % copies, reading buffers[j % 2] and writing the other."""
    for j in range(launches):
        kernel[-(-n_rows // WARPS), WARPS * WARP, stream](
            weights[j % len(weights)], buffers[j % 2], buffers[1 - j % 2], np.int32(n_rows)
        )


def timed_chain(kernel, weights, x0, n_rows: int, stream, programmatic: bool) -> tuple[float, np.ndarray, int]:
    """(seconds a GEMV, the graph's own final y from x0, edges made programmatic) of LAUNCHES chained launches
    captured in one graph."""
    from cuda.bindings import driver as drv

    from expert_service.cuda import driver
    from expert_service.cuda.driver import check, stream_handle

    buffers = [cuda.to_device(x0, stream=stream), cuda.device_array(n_rows, np.float32, stream=stream)]

    def launch_all():
        run_chain(kernel, weights, buffers, n_rows, stream)

    launch_all()  # compiles outside the capture
    stream.synchronize()
    handle = stream_handle(stream)
    check(drv.cuStreamBeginCapture(handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    launch_all()
    graph = check(drv.cuStreamEndCapture(handle))
    changed = driver.programmatic_edges(graph, dispatcher_handles(kernel)) if programmatic else 0
    exec_ = check(drv.cuGraphInstantiate(graph, 0))
    check(drv.cuGraphDestroy(graph))
    buffers[0].copy_to_device(x0, stream=stream)  # one replay from x0: what the timed graph computes
    check(drv.cuGraphLaunch(exec_, handle))
    final = buffers[LAUNCHES % 2].copy_to_host(stream=stream)
    stream.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(5):
        check(drv.cuGraphLaunch(exec_, handle))
    end.record(stream)
    end.synchronize()
    check(drv.cuGraphExecDestroy(exec_))
    seconds = cuda.event_elapsed_time(start, end) * 1e-3 / (5 * LAUNCHES)
    return seconds, final, changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="pdl.json")
    parser.add_argument("--load-order", action="store_true", help="print the PDL kernel's SASS load order and exit")
    args = parser.parse_args(argv)
    order = load_order()
    if args.load_order:
        print(json.dumps(order))
        return 0 if prefetches_before_the_wait(order) else 1
    if not prefetches_before_the_wait(order):
        print(f"the PDL kernel does not load its weights before griddepcontrol.wait: {order}", file=sys.stderr)
        return 1
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results = []
    for n_rows in ROWS:
        copies = max(2, COPIES_BYTES // (n_rows * K * 2))
        host = [rng.standard_normal((n_rows, K), dtype=np.float32) / np.float32(np.sqrt(K)) for _ in range(copies)]
        bits = [bf16_bits(w) for w in host]
        values = [(b.astype(np.uint32) << np.uint32(16)).view(np.float32) for b in bits]
        weights = [cuda.to_device(b.reshape(-1).view(np.uint32), stream=stream) for b in bits]
        x0 = rng.standard_normal(n_rows, dtype=np.float32)
        row = {"rows": n_rows, "k": K, "launches": LAUNCHES, "weight_bytes": n_rows * K * 2}
        finals = {}
        for name, pdl, programmatic in (("plain", False, False), ("pdl_off", True, False), ("pdl", True, True)):
            seconds, finals[name], changed = timed_chain(chain_kernel(pdl), weights, x0, n_rows, stream, programmatic)
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_tb_s"] = n_rows * K * 2 / seconds / 1e12
            row[f"{name}_edges_programmatic"] = changed
        want = reference(values, x0, [j % len(values) for j in range(LAUNCHES)])
        row["plain_vs_numpy_max_rel"] = float(np.abs(finals["plain"] - want).max() / np.abs(want).max())
        row["pdl_equals_plain"] = bool(np.array_equal(finals["pdl"], finals["plain"]))  # the graphs' own outputs
        row["pdl_off_equals_plain"] = bool(np.array_equal(finals["pdl_off"], finals["plain"]))
        row["pdl_speedup"] = row["plain_us"] / row["pdl_us"]
        results.append(row)
        print(
            f"N={n_rows:5d} ({row['weight_bytes'] >> 20} MB): plain {row['plain_us']:6.2f} us "
            f"({row['plain_tb_s']:.2f} TB/s)  pdl_off {row['pdl_off_us']:6.2f}  pdl {row['pdl_us']:6.2f} us "
            f"({row['pdl_tb_s']:.2f} TB/s, {row['pdl_speedup']:.2f}x, {row['pdl_edges_programmatic']} edges)  "
            f"bitwise {row['pdl_equals_plain']}  vs numpy {row['plain_vs_numpy_max_rel']:.1e}",
            flush=True,
        )
        Path(args.out).write_text(json.dumps({"cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
