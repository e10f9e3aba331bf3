"""Repetition, frequency and presence penalties on logits rows, out of place (semantics and state layout:
expert_service/engine/penalties.py): out[r] = logits[r] penalised under state words[row_slots[r]] and row r's
parameters, or a copy of logits[r] where row_slots[r] < 0. Numpy reference:
``expert_service.engine.penalties.apply_penalties``.

Grid (column blocks, R): each thread walks its row with a stride of the row's threads, so loads and stores
are coalesced; a word of 0 (token never seen) leaves the logit as it is. The raw logits stay untouched:
log-probabilities are of the model's own distribution. Finite logits are clamped to the float32 range;
NaN and inf pass through, so the argmax still flags them.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR

THREADS = 32 if SIMULATOR else 256
ITEMS = 4                     # logits per thread (a column block spans THREADS * ITEMS)
FLT_MAX = np.float32(np.finfo(np.float32).max)


def apply_penalties_kernel(logits, row_slots, repetition, presence, frequency, words, out):
    """logits [R, V] f32; row_slots [R] int32; repetition, presence, frequency [R] f32; words [N, V] uint16;
    out [R, V] f32 (written). Grid (ceil(V / (THREADS * ITEMS)), R), block (THREADS,)."""
    r = cuda.blockIdx.y
    vocab = logits.shape[1]
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    slot = row_slots[r]
    if slot < 0:
        for v in range(start, vocab, stride):
            out[r, v] = logits[r, v]
        return
    rep = repetition[r]
    pres = presence[r]
    freq = frequency[r]
    for v in range(start, vocab, stride):
        x = logits[r, v]
        w = words[slot, v]
        if w == 0:
            out[r, v] = x
            continue
        y = x * rep if x < np.float32(0) else x / rep
        n = np.float32(w >> 1)
        y = y - freq * n
        if n > np.float32(0):
            y = y - pres
        if math.isfinite(x):
            if y > FLT_MAX:
                y = FLT_MAX
            elif y < -FLT_MAX:
                y = -FLT_MAX
        out[r, v] = y


_apply_penalties = cached_jit(apply_penalties_kernel)


def launch_apply_penalties(logits, row_slots, repetition, presence, frequency, words, out, stream=0) -> None:
    """logits: [R, V] float32 (read); row_slots: [R] int32 (-1 = copy the row unchanged); repetition,
    presence, frequency: [R] float32; words: [N, V] uint16 state with N > max(row_slots); out: [R, V] float32,
    written."""
    rows, vocab = logits.shape
    assert logits.dtype == out.dtype == np.float32 and out.shape == (rows, vocab), (logits.shape, out.shape)
    assert words.dtype == np.uint16 and words.ndim == 2 and words.shape[1] == vocab, (words.shape, words.dtype)
    assert row_slots.shape == (rows,) and row_slots.dtype == np.int32, (row_slots.shape, row_slots.dtype)
    for a in (repetition, presence, frequency):
        assert a.shape == (rows,) and a.dtype == np.float32, (a.shape, a.dtype)
    if rows == 0:
        return
    blocks = max(1, -(-vocab // (THREADS * ITEMS)))
    _apply_penalties[(blocks, rows), THREADS, stream](logits, row_slots, repetition, presence, frequency, words, out)


def sm90_signatures():
    """(python function, numba signature) for the sm_90 compile check."""
    f2, f1, i1 = types.float32[:, ::1], types.float32[::1], types.int32[::1]
    return [(apply_penalties_kernel, (f2, i1, f1, f1, f1, types.uint16[:, ::1], f2))]
