"""Embedding gather: out[t, :] = W[ids[t], :] widened to float32 (numpy reference: ``W[ids]`` as in
expert_service.cpu.decoder.CpuDecoder.forward).

With `feed` the id of token t is fed[feed[t]] where feed[t] >= 0: a step launched before the step ahead of it
was collected takes its decodes' input tokens straight from that step's argmax on the device. A fed id outside
[0, V) (the argmax of a row that was not finite) reads row 0: the step ahead reports that sequence as failed and
its output of this step is dropped, but the read stays in bounds.

Grid (T, Y): the Y blocks of a token stride together over D (`numeric.blocks_per_row`: Y = 1 for large steps,
up to one element a thread for a decode token, whose row was otherwise one block's chain of 32 dependent
round trips, ~7 us on the H200). Each token's table row is one contiguous run, so the reads of W and the
writes of out are coalesced; the op is pure bandwidth (T*D elements).
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import blocks_per_row, widener

THREADS = 128   # 4 warps; D=4096 -> 32 elements per thread


@functools.cache
def _build(weight_dtype, mode: int = 0):
    widen = widener(weight_dtype)
    prologue = programmatic.prologue(mode)  # kernels/programmatic.py

    def embedding_kernel(ids, table, out):
        """ids: [T] int32 token ids (0 <= id < V). table: [V, D] W. out: [T, D] float32.
        Grid (T, Y), block (THREADS,): the Y blocks of a token stride together over D."""
        prologue()
        t = cuda.blockIdx.x
        row = ids[t]
        first, step = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x, cuda.gridDim.y * cuda.blockDim.x
        for d in range(first, out.shape[1], step):
            out[t, d] = widen(table[row, d])

    def embedding_fed_kernel(ids, feed, fed, table, out):
        """ids, feed: [T] int32; fed: [R] int32 (rows feed points at); table: [V, D] W; out: [T, D] float32.
        Grid (T, Y), block (THREADS,): the Y blocks of a token stride together over D."""
        prologue()
        t = cuda.blockIdx.x
        row = ids[t]
        source = feed[t]
        if source >= 0:
            row = fed[source]
            if row < 0 or row >= table.shape[0]:
                row = 0
        first, step = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x, cuda.gridDim.y * cuda.blockDim.x
        for d in range(first, out.shape[1], step):
            out[t, d] = widen(table[row, d])

    return (
        embedding_kernel,
        programmatic.compiled(embedding_kernel, mode),
        embedding_fed_kernel,
        programmatic.compiled(embedding_fed_kernel, mode),
    )


def launch_embedding(ids, table, out, stream=0, threads=THREADS, feed=None, fed=None) -> None:
    """ids: [T] int32 device array (ids must be < V; not checked on the device); table: [V, D] device array
    of float32, float16 or uint16 (bfloat16 bits); out: [T, D] float32, written. feed: [T] int32, the row of
    `fed` ([R] int32 token ids, any values) holding token t's id, or -1 (ids[t] is it); both or neither."""
    assert (feed is None) == (fed is None), "feed and fed go together"
    assert ids.ndim == 1 and ids.dtype == np.int32, (ids.shape, ids.dtype)
    assert table.ndim == 2 and out.shape == (ids.shape[0], table.shape[1]), (table.shape, out.shape)
    assert out.dtype == np.float32 and table.dtype in (np.float32, np.float16, np.uint16), (out.dtype, table.dtype)
    assert threads % 32 == 0 and 0 < threads <= 1024, threads
    for a in (ids, table, out):
        assert a.flags["C_CONTIGUOUS"], "embedding needs contiguous arrays"
    if feed is not None:
        assert feed.shape == ids.shape and feed.dtype == np.int32 and fed.ndim == 1 and fed.dtype == np.int32, \
            (feed.shape, feed.dtype, fed.shape, fed.dtype)
    if ids.shape[0] == 0:
        return
    kernels = _build(np.dtype(table.dtype), programmatic.mode())
    grid = (ids.shape[0], blocks_per_row(ids.shape[0], table.shape[1], threads))
    if feed is None:
        kernels[1][grid, threads, stream](ids, table, out)
    else:
        kernels[3][grid, threads, stream](ids, feed, fed, table, out)


def sm90_signatures():
    """(python function, numba signature) of each weight-dtype variant, plain and fed, each also waiting, for
    the sm_90 compile check."""
    ids = types.int32[::1]
    out = []
    for (dt, nb), wait in itertools.product(((np.float32, types.float32), (np.float16, types.float16),
                                             (np.uint16, types.uint16)), (False, True)):
        kernels = _build(np.dtype(dt), wait)
        out += [(kernels[0], (ids, nb[:, ::1], types.float32[:, ::1])),
                (kernels[2], (ids, ids, ids, nb[:, ::1], types.float32[:, ::1]))]
    return out
