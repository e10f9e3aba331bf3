"""RMSNorm, HF numerics (numpy reference: expert_service.cpu.layers.norm.rms_norm):
out = (x / sqrt(mean(x^2) + eps)) * weight, mean of squares accumulated in float32.

rmsnorm:     out[r] = rmsnorm(x[r]) for rows of x [R, N]; per-head q/k norm views [T, H, Hd] as [T*H, Hd].
add_rmsnorm: residual[r] += delta[r]; out[r] = rmsnorm(residual[r]) -- fuses the residual add of the
             decoder layer into the norm's first read (one pass over residual/delta instead of two).

Long rows (hidden-size norms): one block per row, thread j holding elements j, j + threads, ... (coalesced), a
block reduction (warp shuffles + 32-slot shared partials) for the sum of squares. The per-thread count is a
compile-time constant, so a thread loads its whole slice of the row (and of the weight) into registers before
its first add: the strided loop this replaced issued one dependent load round trip per element (a store to
`out` may alias the next load), 16 in a row at N = 4096, ~6.7 us a decode-step norm on the H200. Short rows (N <= WARP_ROW_MAX, the per-head q/k norms): one warp per row, ROWS_PER_BLOCK rows
a block, the row held in registers (ceil(N / 32) elements a lane, loaded before any arithmetic so they are all
in flight at once), shuffles only -- a block and two barriers for 128 elements cost far more than its bytes.
The warp adds its squares in the block kernel's order (lane l's chunk w holds the elements thread 32*w + l of a
THREADS-thread block holds, one butterfly per chunk, chunk totals in warp order), so both kernels give the same
bits and `moe_combine_rmsnorm`, which reduces over that partition, stays bitwise equal to rmsnorm at any N.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import SIMULATOR, WARP, block_sum, warp_sum, widener

THREADS = 256   # block-per-row kernel: 8 warps; N=4096 -> 16 elements per thread
CHUNKS = THREADS // WARP      # the warp kernel's partial sums: one per warp of a THREADS-thread block
WARP_ROW_MAX = 1024           # rows up to this long take a warp each: at most 32 registers of the row per lane
ROWS_PER_BLOCK = 2 if SIMULATOR else 8   # the simulator runs a Python thread per CUDA thread; same code path
# Fewer rows (decode steps: 36-576 head rows) run the block kernel with one thread per element: on the H200 the
# warp kernel took 3.5 / 3.4 µs where it took 2.6 / 3.0 at 1 / 16 tokens, and 3.9 where 7.4 at 64 (2304 rows).
# The block kernel with fewer threads gives the same bits (its missing warps would only add zeros).
WARP_KERNEL_MIN_ROWS = 0 if SIMULATOR else 1024


@functools.cache
def _build(weight_dtype, per_thread: int, mode: int = 0):
    """The block-per-row kernels for rows of at most per_thread * blockDim.x elements (mode: the
    programmatic-launch variant, kernels/programmatic.py)."""
    widen = widener(weight_dtype)
    prologue = programmatic.prologue(mode)

    def rmsnorm_kernel(x, weight, eps, out):
        """x: [R, N] float32. weight: [N] W. eps: float32. out: [R, N] float32 (may alias x).
        Grid (R,), block (threads,) with N <= per_thread * threads."""
        prologue()
        r = cuda.blockIdx.x
        n = x.shape[1]
        v = cuda.local.array(per_thread, np.float32)
        w = cuda.local.array(per_thread, np.float32)
        for j in range(per_thread):   # every load issued before the first use
            i = cuda.threadIdx.x + j * cuda.blockDim.x
            v[j] = x[r, i] if i < n else np.float32(0.0)
            w[j] = widen(weight[i]) if i < n else np.float32(0.0)
        ss = np.float32(0.0)
        for j in range(per_thread):   # in element order: the bits of a strided loop (adding 0 changes none)
            ss += v[j] * v[j]
        denom = math.sqrt(block_sum(ss) / np.float32(n) + eps)
        for j in range(per_thread):
            i = cuda.threadIdx.x + j * cuda.blockDim.x
            if i < n:
                out[r, i] = (v[j] / denom) * w[j]

    def add_rmsnorm_kernel(residual, delta, weight, eps, out):
        """residual: [R, N] float32, updated in place (+= delta). delta: [R, N] float32. weight: [N] W.
        eps: float32. out: [R, N] float32 = rmsnorm(updated residual). Grid (R,), block (threads,) with
        N <= per_thread * threads."""
        prologue()
        r = cuda.blockIdx.x
        n = residual.shape[1]
        v = cuda.local.array(per_thread, np.float32)
        w = cuda.local.array(per_thread, np.float32)
        for j in range(per_thread):
            i = cuda.threadIdx.x + j * cuda.blockDim.x
            v[j] = residual[r, i] + delta[r, i] if i < n else np.float32(0.0)
            w[j] = widen(weight[i]) if i < n else np.float32(0.0)
        ss = np.float32(0.0)
        for j in range(per_thread):
            i = cuda.threadIdx.x + j * cuda.blockDim.x
            if i < n:
                residual[r, i] = v[j]
            ss += v[j] * v[j]
        denom = math.sqrt(block_sum(ss) / np.float32(n) + eps)
        for j in range(per_thread):
            i = cuda.threadIdx.x + j * cuda.blockDim.x
            if i < n:
                out[r, i] = (v[j] / denom) * w[j]

    return (
        (rmsnorm_kernel, programmatic.compiled(rmsnorm_kernel, mode)),
        (add_rmsnorm_kernel, programmatic.compiled(add_rmsnorm_kernel, mode)),
    )


def per_thread(n: int, threads: int) -> int:
    """Elements of an n-long row each of `threads` threads holds (the block kernels' compile-time count)."""
    return -(-n // threads)


@functools.cache
def _build_short(weight_dtype, per_lane: int, mode: int = 0):
    """The warp-per-row kernel for rows of (per_lane - 1) * WARP < N <= per_lane * WARP elements: per_lane is a
    compile-time constant so the row's loops unroll and it stays in registers."""
    widen = widener(weight_dtype)
    chunks = min(per_lane, CHUNKS)
    prologue = programmatic.prologue(mode)

    def rmsnorm_short_kernel(x, weight, eps, out):
        """x: [R, N] float32, N <= per_lane * WARP. weight: [N] W. eps: float32. out: [R, N] float32 (may alias
        x). Grid (ceil(R / ROWS_PER_BLOCK),), block (ROWS_PER_BLOCK * WARP,): warp w of block b takes row
        b * ROWS_PER_BLOCK + w."""
        prologue()
        lane = cuda.threadIdx.x % WARP
        r = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
        n = x.shape[1]
        live = r < x.shape[0]    # a warp past the last row still reduces zeros: the simulator's shuffle is a barrier
        v = cuda.local.array(per_lane, np.float32)
        for m in range(per_lane):
            i = lane + m * WARP
            v[m] = x[r, i] if live and i < n else np.float32(0.0)
        ss = np.float32(0.0)
        for w in range(chunks):
            part = np.float32(0.0)   # thread 32*w + lane of the block kernel: elements i, i + THREADS, ...
            for m in range(w, per_lane, CHUNKS):
                part += v[m] * v[m]
            ss += warp_sum(part)
        denom = math.sqrt(ss / np.float32(n) + eps)
        if live:
            for m in range(per_lane):
                i = lane + m * WARP
                if i < n:
                    out[r, i] = (v[m] / denom) * widen(weight[i])

    return rmsnorm_short_kernel, programmatic.compiled(rmsnorm_short_kernel, mode)


def _check(rows, weight, out, threads):
    assert rows.ndim == 2 and rows.dtype == np.float32 and out.shape == rows.shape, (rows.shape, out.shape)
    assert out.dtype == np.float32 and weight.shape == (rows.shape[1],), (out.dtype, weight.shape)
    assert weight.dtype in (np.float32, np.float16, np.uint16), weight.dtype
    assert threads % 32 == 0 and 0 < threads <= 1024, threads
    for a in (rows, weight, out):
        assert a.flags["C_CONTIGUOUS"], "rmsnorm needs contiguous arrays"


def launch_rmsnorm(x, weight, eps, out, stream=0, threads=None) -> None:
    """x: [R, N] float32 (or [T, H, Hd], normalised per head over Hd); weight: [N] float32/float16/uint16
    (bfloat16 bits); eps: float; out: same shape as x, float32, written (may be x itself). threads: None picks
    the kernel (a warp per row when N <= WARP_ROW_MAX and there are WARP_KERNEL_MIN_ROWS rows, else a block
    per row, of one thread per element up to THREADS; the same bits either way); a count runs the block-per-row
    kernel with that many threads (bitwise equal to `moe_combine_rmsnorm` launched with the same count)."""
    n = x.shape[x.ndim - 1]                      # (the simulator's shape tuple rejects negative indices)
    assert out.shape == x.shape, (x.shape, out.shape)
    x2, out2 = x.reshape(x.size // n, n), out.reshape(x.size // n, n)
    _check(x2, weight, out2, threads or THREADS)
    rows = x2.shape[0]
    if rows == 0:
        return
    eps = np.float32(eps)
    if threads is None and n <= WARP_ROW_MAX and rows >= WARP_KERNEL_MIN_ROWS:
        kernel = _build_short(np.dtype(weight.dtype), -(-n // WARP), programmatic.mode())[1]
        kernel[-(-rows // ROWS_PER_BLOCK), ROWS_PER_BLOCK * WARP, stream](x2, weight, eps, out2)
    else:
        threads = threads or min(THREADS, -(-n // WARP) * WARP)
        kernel = _build(np.dtype(weight.dtype), per_thread(n, threads), programmatic.mode())[0][1]
        kernel[rows, threads, stream](x2, weight, eps, out2)


def launch_add_rmsnorm(residual, delta, weight, eps, out, stream=0, threads=THREADS) -> None:
    """residual: [R, N] float32, += delta in place; delta: [R, N] float32; weight: [N] W; eps: float;
    out: [R, N] float32 = rmsnorm(residual after the add). out must not alias residual or delta."""
    _check(residual, weight, out, threads)
    assert delta.shape == residual.shape and delta.dtype == np.float32 and delta.flags["C_CONTIGUOUS"]
    if residual.shape[0] == 0:
        return
    kernel = _build(np.dtype(weight.dtype), per_thread(residual.shape[1], threads), programmatic.mode())[1][1]
    kernel[residual.shape[0], threads, stream](residual, delta, weight, np.float32(eps), out)


def sm90_signatures():
    """(python function, numba signature) of each weight-dtype variant (block kernels: 1, 8 and 16 elements a
    thread, head norms and hidden sizes 2048 / 4096; short rows: 1, 4 and 32 elements a lane; a waiting variant
    of each kind, a trigger-only one of the block kernels), for the sm_90 compile check."""
    f2 = types.float32[:, ::1]
    out = []
    for dt, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        for per, mode in ((1, 0), (8, 0), (16, 0), (16, programmatic.WAIT), (16, programmatic.TRIGGER)):
            (norm, _), (add_norm, _) = _build(np.dtype(dt), per, mode)
            out.append((norm, (f2, nb[::1], types.float32, f2)))
            out.append((add_norm, (f2, f2, nb[::1], types.float32, f2)))
        for per_lane, mode in ((1, 0), (4, 0), (4, programmatic.WAIT), (WARP_ROW_MAX // WARP, 0)):
            out.append((_build_short(np.dtype(dt), per_lane, mode)[0], (f2, nb[::1], types.float32, f2)))
    return out
