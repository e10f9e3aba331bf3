"""Grammar token masks on logits rows, out of place (semantics: expert_service/engine/token_masks.py, its numpy
reference ``apply_masks_reference``): out[r, v] = src[r, v] where bit v of masks[r] is set, else -inf, with
src[r] = penalized[r] for r < num_penalized (the penalised rows) and logits[r] otherwise.

Grid (column blocks, R): each thread walks its row with a stride of the row's threads, coalesced; a mask word is
read once per 32 logits from L1. The raw logits stay untouched (prompt log-probabilities read them); the output is
what the argmax and the host's sampling read. Reads only preallocated buffers, so it may sit inside a graph.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR

THREADS = 32 if SIMULATOR else 256
ITEMS = 4                     # logits per thread (a column block spans THREADS * ITEMS)
NEG_INF = np.float32(-np.inf)


def apply_token_mask_kernel(logits, penalized, num_penalized, masks, out):
    """logits [R, V] f32; penalized [>= num_penalized, V] f32; num_penalized int32; masks [R, W] uint32 with
    W = ceil(V / 32); out [R, V] f32 (written). Grid (ceil(V / (THREADS * ITEMS)), R), block (THREADS,)."""
    r = cuda.blockIdx.y
    vocab = logits.shape[1]
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    for v in range(start, vocab, stride):
        x = penalized[r, v] if r < num_penalized else logits[r, v]
        word = masks[r, v >> 5]
        out[r, v] = x if (word >> np.uint32(v & 31)) & np.uint32(1) else NEG_INF


_apply_token_mask = cached_jit(apply_token_mask_kernel)


def launch_apply_token_mask(logits, penalized, num_penalized: int, masks, out, stream=0) -> None:
    """logits: [R, V] float32 (read); penalized: [P, V] float32 with P >= num_penalized (its first rows replace
    the raw ones); masks: [R, ceil(V / 32)] uint32; out: [R, V] float32, written."""
    rows, vocab = logits.shape
    assert logits.dtype == out.dtype == penalized.dtype == np.float32 and out.shape == (rows, vocab), out.shape
    assert masks.dtype == np.uint32 and masks.shape == (rows, -(-vocab // 32)), (masks.shape, masks.dtype)
    assert penalized.shape[1] == vocab and 0 <= num_penalized <= min(rows, penalized.shape[0]), penalized.shape
    if rows == 0:
        return
    blocks = max(1, -(-vocab // (THREADS * ITEMS)))
    _apply_token_mask[(blocks, rows), THREADS, stream](logits, penalized, np.int32(num_penalized), masks, out)


def sm90_signatures():
    """(python function, numba signature) for the sm_90 compile check."""
    f2 = types.float32[:, ::1]
    return [(apply_token_mask_kernel, (f2, f2, types.int32, types.uint32[:, ::1], f2))]
