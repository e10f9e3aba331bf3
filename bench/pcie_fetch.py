"""Host->device expert copies: the fetch kernel reading mapped host memory against the copy engine, one run.

The device-side expert cache copies its misses with kernels/expert_fetch.py, a kernel that reads the experts
straight from the page-locked, mapped mmap of the experts file (no host decision, graph-capturable). This
measures what that costs against cuMemcpyHtoDAsync (the copy engine) from the same registered memory, for the
reference shapes' expert blocks (mixtral-shape: 3 x 14336 x 4096 bf16 = 336 MiB; qwen3moe-shape: 3 x 768 x 2048
bf16 = 9 MiB) and a few copies per launch, and with both running at once on two streams (they share the link).

    python bench/pcie_fetch.py --out out/pcie_fetch.json [--repeats 5] [--grids 33,66,132,264,528]

Prints GB/s per case and the ratio kernel / copy engine (target: >= 0.9; the probe in the design notes reached
51.3 against 55.5 GB/s with 16-byte loads from >= 33 CTAs on the H200's host). The ratio is the host's: on one
H100 host the kernel stayed at 31-34 GB/s on every grid --grids tried while the copy engine reached 55.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCKS = {"qwen3moe-shape": 3 * 768 * 2048 * 2, "mixtral-shape": 3 * 14336 * 4096 * 2}
COPIES = (1, 4, 8)


def _host_source(nbytes: int):
    """An mmap registered read-only and mapped, as the worker holds the experts (falls back to mapped pinned)."""
    from numba import cuda

    from expert_service.cuda.driver import mapped_address, pin_readonly

    host = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    host[:] = np.random.default_rng(0).integers(1, 255, nbytes, dtype=np.uint8)
    if pin_readonly(host, mapped=True):
        desc = {"shape": (nbytes // 4,), "typestr": "<u4", "data": (mapped_address(host), True), "version": 3}
        return host, cuda.from_cuda_array_interface(desc, owner=host, sync=False), "registered mmap"
    staged = cuda.mapped_array(nbytes // 4, np.uint32)  # numba's mapped arrays cannot change dtype
    np.asarray(staged).view(np.uint8)[:] = host
    return np.asarray(staged).view(np.uint8), staged, "mapped pinned"


def _timed(stream, issue, repeats: int) -> float:
    """Best seconds of issue() between two events on `stream`."""
    from numba import cuda

    best = float("inf")
    for _ in range(repeats + 1):  # the first run loads the kernel
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        issue()
        end.record(stream)
        end.synchronize()
        best = min(best, cuda.event_elapsed_time(start, end) / 1e3)
    return best


def fetch_kernel_bytes_per_s(block: int, copies: int = 8, repeats: int = 3) -> tuple[float, float]:
    """(fetch kernel, copy engine) bytes/s for `copies` blocks of `block` bytes from a registered mapped mmap,
    best of `repeats`: the rate a cached step's device-driven misses reach on this host, beside the copy engine's.
    The ratio is the host's (its root complex serves the SMs' small reads): 0.92x on the H200 host of
    docs/expert-cache.md, 0.60x on an H100 host whatever the grid (33-528 CTAs) or the page size."""
    from numba import cuda

    cuda.current_context()  # registering the host memory needs one
    host, src, kind = _host_source(copies * block)
    try:
        dst = cuda.device_array(copies * block // 4, np.uint32)
        t_kernel, t_engine = _kernel_and_engine_times(host, src, dst, copies, block, cuda.stream(), repeats)
    finally:
        _release(host, kind)
    return copies * block / t_kernel, copies * block / t_engine


def _kernel_and_engine_times(host, src, dst, copies: int, block: int, stream, repeats: int) -> tuple[float, float]:
    """Best seconds of the fetch kernel copying the first `copies` blocks of `src` into `dst`, then of the copy
    engine copying the same blocks from `host` (the same memory), each on `stream`."""
    from cuda.bindings import driver as drv
    from numba import cuda

    from expert_service.cuda.driver import check, device_address, stream_handle
    from expert_service.kernels.expert_fetch import launch_expert_fetch

    ids = cuda.to_device(np.arange(copies, dtype=np.int32))
    count = cuda.to_device(np.array([copies], np.int32))
    handle = stream_handle(stream)

    def kernel():
        launch_expert_fetch(src, dst, ids, ids, count, block, stream=stream)

    def engine():
        for j in range(copies):
            check(drv.cuMemcpyHtoDAsync(device_address(dst) + j * block, host.ctypes.data + j * block, block, handle))

    return _timed(stream, kernel, repeats), _timed(stream, engine, repeats)


def _release(host, kind: str) -> None:
    """Unregisters a registered mmap before it goes: its range, unmapped while registered, would make the
    driver's later allocations or registrations of that address range fail (CUDA_ERROR_ALREADY_MAPPED)."""
    from numba import cuda

    from expert_service.cuda.driver import unpin

    if kind == "registered mmap":
        cuda.synchronize()
        unpin(host)


def bench(repeats: int) -> dict:
    from cuda.bindings import driver as drv
    from numba import cuda

    from expert_service.cuda.driver import check, device_address, stream_handle
    from expert_service.kernels.expert_fetch import launch_expert_fetch

    out: dict = {}
    for shape, block in BLOCKS.items():
        n = max(COPIES)
        host, src, kind = _host_source(n * block)
        dst = cuda.device_array(n * block // 4, np.uint32)
        stream, other = cuda.stream(), cuda.stream()
        rows = {}
        for count in COPIES:
            t_kernel, t_engine = _kernel_and_engine_times(host, src, dst, count, block, stream, repeats)
            words = count * block // 4
            np.testing.assert_array_equal(dst[:words].copy_to_host(), np.asarray(host).view(np.uint32)[:words])
            rows[str(count)] = {
                "bytes": count * block,
                "kernel_gb_s": count * block / t_kernel / 1e9,
                "copy_engine_gb_s": count * block / t_engine / 1e9,
                "kernel_over_copy_engine": t_engine / t_kernel,
            }
        # both at once: the kernel on one stream, the copy engine on another, 4 blocks each (halves of dst)
        half = n // 2
        both_ids = cuda.to_device(np.arange(half, dtype=np.int32))
        both_count = cuda.to_device(np.array([half], np.int32))
        other_handle = stream_handle(other)

        def both():
            launch_expert_fetch(src, dst, both_ids, both_ids, both_count, block, stream=stream)
            for j in range(half, n):
                check(
                    drv.cuMemcpyHtoDAsync(
                        device_address(dst) + j * block, host.ctypes.data + j * block, block, other_handle
                    )
                )
            other.synchronize()

        t_both = _timed(stream, both, repeats)
        rows["concurrent"] = {"bytes": n * block, "total_gb_s": n * block / t_both / 1e9}
        _release(host, kind)
        out[shape] = {"block_bytes": block, "source": kind, "runs": rows}
        print(f"{shape}: block {block / 2**20:.1f} MiB from {kind}")
        for key, r in rows.items():
            if key == "concurrent":
                print(f"  kernel + copy engine together: {r['total_gb_s']:.1f} GB/s")
            else:
                print(
                    f"  {key} block(s): kernel {r['kernel_gb_s']:.1f} GB/s, copy engine {r['copy_engine_gb_s']:.1f}"
                    f" GB/s, kernel / copy engine {r['kernel_over_copy_engine']:.2f}x"
                )
    return out


def _grid_list(text: str) -> tuple[int, ...]:
    try:
        grids = tuple(int(part) for part in text.split(","))
    except ValueError:
        grids = ()
    if not grids or min(grids) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of positive CTA counts")
    return grids


def grid_sweep(grids: tuple[int, ...], repeats: int) -> dict:
    """{shape: {CTAs: fetch kernel GB/s}} for 8 blocks of each shape, the grid set per launch."""
    from expert_service.kernels import expert_fetch

    shipped = expert_fetch.CTAS
    out: dict = {}
    try:
        for shape, block in BLOCKS.items():
            rates = out[shape] = {}
            for ctas in grids:
                expert_fetch.CTAS = ctas  # read at each launch; the kernel strides by its grid
                rates[str(ctas)] = fetch_kernel_bytes_per_s(block, max(COPIES), repeats)[0] / 1e9
            print(f"{shape}: fetch kernel " + ", ".join(f"{c} CTAs {r:.1f} GB/s" for c, r in rates.items()))
    finally:
        expert_fetch.CTAS = shipped
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--grids",
        type=_grid_list,
        default=(),
        help="comma list of CTA counts: also time the fetch kernel on each grid (8 blocks of each shape), to tell "
        "a host that serves the SMs' reads slowly from a grid too small to fill the link",
    )
    args = parser.parse_args(argv)
    from expert_service.backends import cuda_available

    if not cuda_available():
        print("pcie_fetch: no GPU visible", file=sys.stderr)
        return 2
    result = bench(args.repeats)
    if args.grids:
        result["grids"] = grid_sweep(args.grids, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
