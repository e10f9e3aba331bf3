"""Penalty state updates (layout and semantics: expert_service/engine/penalties.py): for each entry u,
words[slots[u], tokens[u]] gets bit 0 set (output[u] == 0: a prompt token) or counts one more output
occurrence (+2, saturating at 0xFFFE). Numpy reference: ``expert_service.engine.penalties.update_state``.

One thread per entry. A prompt chunk may mark one token many times: those threads all write the same value.
A slot counts at most one output token per step, never in a step that marks its prompt (a sequence either
prefills or decodes), so a count's read-modify-write has no other writer: no atomics (uint16 has none).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit

THREADS = 128


def penalty_update_kernel(words, slots, tokens, output):
    """words [N, V] uint16 (updated); slots, tokens, output [U] int32. Grid (ceil(U / THREADS),), block
    (THREADS,)."""
    u = cuda.grid(1)
    if u < slots.shape[0]:
        s = slots[u]
        t = tokens[u]
        w = words[s, t]
        if output[u] == 0:
            words[s, t] = np.uint16(w | np.uint16(1))
        elif w < np.uint16(0xFFFE):
            words[s, t] = np.uint16(w + np.uint16(2))


_penalty_update = cached_jit(penalty_update_kernel)


def launch_penalty_update(words, slots, tokens, output, stream=0) -> None:
    """words: [N, V] uint16 state (updated in place); slots [U] int32 in [0, N), tokens [U] int32 in [0, V),
    output [U] int32 (1 = count an output token, 0 = mark a prompt token); ids are not checked on the device."""
    assert words.ndim == 2 and words.dtype == np.uint16, (words.shape, words.dtype)
    assert slots.shape == tokens.shape == output.shape and slots.ndim == 1, (slots.shape, tokens.shape, output.shape)
    assert slots.dtype == tokens.dtype == output.dtype == np.int32, (slots.dtype, tokens.dtype, output.dtype)
    n = slots.shape[0]
    if n:
        _penalty_update[-(-n // THREADS), THREADS, stream](words, slots, tokens, output)


def sm90_signatures():
    """(python function, numba signature) for the sm_90 compile check."""
    i1 = types.int32[::1]
    return [(penalty_update_kernel, (types.uint16[:, ::1], i1, i1, i1))]
