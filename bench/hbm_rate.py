"""The HBM roofline of the GPU a bench runs on: its streaming read rate, measured in the same process.

A bench's "fraction of the HBM roofline" is bytes / rate / time. The rate was once a constant, 4.3 TB/s, what a
Numba streaming read reaches on an H200; but the roofline is what *this* GPU can stream, and the GPU lent for a
run changes between runs: an H100 80GB HBM3 (3.35 TB/s on its datasheet) put a bf16 decode that ran near its own
ceiling at 0.59 of the H200 figure. So each bench measures the rate once per process (`roofline()`, cached) and
divides by that, recording beside it the device, a device-to-device copy rate and the H200 reference figure.

How: `stream_read_kernel` reads a 2 GiB buffer (far past the 50-60 MB L2) with 16-byte `ld.global.nc` loads
(expert_service.kernels.ptx.ld_stream_v4, as the weight-streaming kernels load), a grid-stride loop over every SM
at the kernel's full occupancy, four loads in flight a thread, each thread XOR-folding its words into one output
word so the loads cannot be dropped; the rate is the best of REPEATS launches timed with CUDA events. The copy rate
(a 1 GiB cuMemcpyDtoD, bytes read + written) is recorded only, never the denominator.

`--hbm-bytes-per-s X` (every bench that reports a roofline) divides by X instead, e.g. 4.3e12 to compare with
JSONs written before the rate was measured; the measured rate is still recorded. Under the CUDA simulator nothing
is measured and the H200 reference stands in (a smoke run's fractions mean nothing). Figures from an H100 and an
H200 are not comparable, whichever denominator either used.

    python bench/hbm_rate.py     # prints the measured rates as JSON
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from expert_service.cuda.device_memory import free_pending_deallocations  # noqa: E402
from expert_service.kernels.ptx import ld_stream_v4  # noqa: E402

HBM_H200_REFERENCE = 4.3e12  # the streaming read on an H200 (4.2-4.4 TB/s): earlier JSONs' denominator
READ_BYTES = 2 << 30  # far past any L2, so every byte comes from HBM
COPY_BYTES = 1 << 30
THREADS = 256  # a block
REPEATS = 10


@cuda.jit
def stream_read_kernel(words, folds):
    """folds[t] = XOR of every word thread t read: words (1-d uint32, a multiple of 4 long) in 16-byte chunks,
    chunk c read by thread c % threads (grid-stride, so a warp's loads are 512 contiguous bytes)."""
    t = cuda.grid(1)
    threads = cuda.gridsize(1)
    chunks = words.size // 4
    acc = np.uint32(0)
    c = t
    # four loads issued before any is used: one at a time would leave HBM idle a latency between them
    while c + 3 * threads < chunks:
        a = ld_stream_v4(words, 4 * c)
        b = ld_stream_v4(words, 4 * (c + threads))
        d = ld_stream_v4(words, 4 * (c + 2 * threads))
        e = ld_stream_v4(words, 4 * (c + 3 * threads))
        acc ^= a[0] ^ a[1] ^ a[2] ^ a[3] ^ b[0] ^ b[1] ^ b[2] ^ b[3]
        acc ^= d[0] ^ d[1] ^ d[2] ^ d[3] ^ e[0] ^ e[1] ^ e[2] ^ e[3]
        c += 4 * threads
    while c < chunks:
        a = ld_stream_v4(words, 4 * c)
        acc ^= a[0] ^ a[1] ^ a[2] ^ a[3]
        c += threads
    folds[t] = acc


def launch_stream_read(words, folds, block: int = THREADS, stream=0) -> None:
    """stream_read_kernel over folds.size // block blocks (folds: one uint32 a thread)."""
    if words.size % 4 or folds.size % block:
        raise ValueError(f"stream read: {words.size} words is not a multiple of 4 or {folds.size} folds of {block}")
    stream_read_kernel[folds.size // block, block, stream](words, folds)


def sm90_signatures():
    """(python function, numba signature) of the kernel, for the sm_90 compile check."""
    from numba import types

    return [(stream_read_kernel.py_func, (types.uint32[::1], types.uint32[::1]))]


@dataclass(frozen=True)
class Measured:
    device: str
    read_bytes_per_s: float
    copy_bytes_per_s: float  # bytes read + bytes written a second


@dataclass(frozen=True)
class Roofline:
    """A run's roofline denominator and where it came from."""

    bytes_per_s: float
    source: str  # "measured", "--hbm-bytes-per-s" or "h200 reference (simulator)"
    measured: Measured | None

    @property
    def device(self) -> str:
        return self.measured.device if self.measured else "simulator"

    def record(self) -> dict:
        """The JSON fields every bench writes."""
        m = self.measured
        return {
            "device": self.device,
            "hbm_bytes_per_s": self.bytes_per_s,
            "hbm_bytes_per_s_source": self.source,
            "hbm_read_bytes_per_s_measured": m.read_bytes_per_s if m else None,
            "hbm_copy_bytes_per_s_measured": m.copy_bytes_per_s if m else None,
            "hbm_bytes_per_s_h200_reference": HBM_H200_REFERENCE,
        }

    def summary(self) -> str:
        m = self.measured
        found = f"read {m.read_bytes_per_s / 1e12:.2f}, copy {m.copy_bytes_per_s / 1e12:.2f} TB/s" if m else "nothing"
        return (
            f"HBM roofline {self.bytes_per_s / 1e12:.2f} TB/s ({self.source}) on {self.device}: measured {found}; "
            f"H200 reference {HBM_H200_REFERENCE / 1e12:.2f} TB/s"
        )


def _best_seconds(launch, stream, repeats: int) -> float:
    """The shortest of `repeats` launches, each between two CUDA events, after one untimed (it compiles)."""
    launch()
    best = math.inf
    for _ in range(repeats):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        best = min(best, cuda.event_elapsed_time(start, end) * 1e-3)
    return best


def _measure(read_bytes: int, copy_bytes: int, repeats: int) -> Measured:
    from numba import types
    from numba.cuda.cudadrv.driver import device_memset

    stream = cuda.stream()
    words = cuda.device_array(read_bytes // 4, np.uint32, stream=stream)
    device_memset(words, 0x5A, read_bytes, stream=stream)  # written once, so no page is read untouched
    kernel = stream_read_kernel.compile((types.uint32[::1], types.uint32[::1]))
    folds = cuda.device_array(kernel.max_cooperative_grid_blocks(THREADS) * THREADS, np.uint32, stream=stream)
    read = _best_seconds(lambda: launch_stream_read(words, folds, stream=stream), stream, repeats)
    src, dst = words[: copy_bytes // 4], cuda.device_array(copy_bytes // 4, np.uint32, stream=stream)
    copy = _best_seconds(lambda: dst.copy_to_device(src, stream=stream), stream, repeats)
    name = cuda.get_current_device().name
    device = name.decode() if isinstance(name, bytes) else str(name)
    return Measured(device, read_bytes / read, 2 * copy_bytes / copy)


@functools.cache
def measure(read_bytes: int = READ_BYTES, copy_bytes: int = COPY_BYTES, repeats: int = REPEATS) -> Measured:
    """This GPU's streaming read and copy rates (bytes a second), once per process; the 3 GiB it takes are freed
    before it returns, so the bench's own memory figures do not see them."""
    measured = _measure(read_bytes, copy_bytes, repeats)
    free_pending_deallocations()  # Numba batches frees: release the buffers now, before the bench measures memory
    return measured


def roofline(override: float | None = None) -> Roofline:
    """The denominator of this run's roofline fractions: `override` (--hbm-bytes-per-s) if given, else the
    measured streaming read rate (under the simulator: the H200 reference, nothing measured)."""
    from numba import config

    measured = None if config.ENABLE_CUDASIM else measure()
    if override is not None:
        return Roofline(override, "--hbm-bytes-per-s", measured)
    if measured is None:
        return Roofline(HBM_H200_REFERENCE, "h200 reference (simulator)", None)
    return Roofline(measured.read_bytes_per_s, "measured", measured)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of bytes a second (e.g. 4.3e12)")
    return value


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hbm-bytes-per-s",
        type=_rate,
        metavar="X",
        help="roofline denominator instead of the measured read rate (4.3e12: runs before it was measured)",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    print(json.dumps(roofline().record(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
