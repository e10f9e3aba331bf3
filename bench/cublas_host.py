"""Host microseconds a GEMM call costs through the engine's cuBLAS binding (expert_service/cuda/cublas.py), at the
shapes the per-expert GEMMs of a mixtral-shape prefill take, beside a bare Numba kernel launch: whether the host
break that issues a layer's expert GEMMs can keep the device busy (the device runs each in tens of microseconds).

Per case: the host time a call takes inside a loop of --calls calls (nothing waits on the device in the loop),
and the time a call takes with the device's work included (the loop, then a synchronisation). One GPU.

    python bench/cublas_host.py --out out/cublas_host.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (rows m, outputs n, inputs k, output dtype): a tiny GEMM (host-bound), then mixtral-shape expert gate|up
# (bf16 out) and down (f32 out) GEMMs at the row counts of 512- and 2,048-token prefills
CASES = [(16, 256, 256, "f32"), (128, 28672, 4096, "bf16"), (192, 28672, 4096, "bf16"), (128, 4096, 14336, "f32"),
         (256, 4096, 14336, "f32")]  # fmt: skip


@cuda.jit
def _touch(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = 0


def device_name() -> str:
    """The current device's name (str in numba-cuda 0.30, bytes in older releases)."""
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def timed(fn, calls: int, sync) -> dict:
    """Host us a call within `calls` back-to-back calls, and us a call once the device has run them all."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    sync()
    done = time.perf_counter()
    return {"host_us": (issued - start) / calls * 1e6, "with_device_us": (done - start) / calls * 1e6}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/cublas_host.json")
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args(argv)

    from expert_service.cuda.cublas import CUDA_R_16BF, CUDA_R_32F, WORKSPACE_BYTES, Cublas
    from expert_service.cuda.driver import device_address

    stream = cuda.stream()
    workspace = cuda.device_array(WORKSPACE_BYTES, np.uint8)  # Cublas keeps its address only: held here
    blas = Cublas(stream, workspace)
    most = max(max(n * k, m * k, m * n) for m, n, k, _ in CASES)
    buffers = [cuda.device_array(most, np.float32) for _ in range(3)]  # room for any case, held as workspace is
    w, x, y = (device_address(b) for b in buffers)
    out_types = {"f32": CUDA_R_32F, "bf16": CUDA_R_16BF}
    rows = []
    for m, n, k, out in CASES:
        row = timed(lambda: blas._gemm(w, x, y, m, n, k, CUDA_R_16BF, blas._zero, out_types[out]), args.calls,
                    stream.synchronize)  # fmt: skip
        rows.append({"m": m, "n": n, "k": k, "out": out, **row})
        print(f"  cublasGemmEx m={m:4d} n={n:6d} k={k:6d} {out:4s}  host {row['host_us']:6.1f} us a call, "
              f"with the device {row['with_device_us']:7.1f}")  # fmt: skip

    small = cuda.device_array(1024, np.float32)
    launch = timed(lambda: _touch[4, 256, stream](small), args.calls, stream.synchronize)
    print(f"  Numba launch (one array)                 host {launch['host_us']:6.1f} us a call")
    blas.close()
    result = {"device": device_name(), "gemm": rows, "numba_launch": launch}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
