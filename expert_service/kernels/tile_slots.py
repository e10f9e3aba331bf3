"""The slots one wave of a cached grouped step reads its tiles' experts from, for the tensor-core grouped kernels
(moe_gemm_mma.py): tile_slot[t] = wave_map[tile_expert[t]] for the step's tiles (t < num_tiles[0]), -1 past them.
Reference: numpy ``np.where(arange(tiles) < num_tiles, wave_map[tile_expert], -1)``
(tests/expert_service/kernels/test_tile_slots.py).

moe_gemm_mma's kernels read tile t's weights as row tile_expert[t] of their W and skip a tile whose entry is
negative; given these slots as tile_expert and the layer's slot buffer [S, stride] as W, a launch computes the
tiles of the wave's experts from the slots the plan put them in and leaves every other tile (expert outside the
wave: wave_map -1) for its own wave. All on the device: graph-capturable, whatever the routing.

  tile_expert [tiles] int32   moe_align's expert of each tile (entries past num_tiles are not read)
  num_tiles [1] int32         moe_align's count of used tiles
  wave_map [E] int32          the wave's slot map (expert_slot_map.py: the slot expert e reads in the wave, -1: not
                              in it)
  tile_slot [tiles] int32     out: the slot each tile reads, -1: not this wave's (or past the used tiles)
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR

THREADS = 32 if SIMULATOR else 128


@cached_jit
def _tile_slots_kernel(tile_expert, num_tiles, wave_map, tile_slot):
    """Module docstring: one thread per tile."""
    t = cuda.grid(1)
    if t < tile_slot.shape[0]:
        s = -1
        if t < num_tiles[0]:
            s = wave_map[tile_expert[t]]
        tile_slot[t] = s


def _check(name, a, n=None):
    if a.dtype != np.int32 or a.ndim != 1 or not a.flags["C_CONTIGUOUS"] or (n is not None and a.shape[0] != n):
        size = "" if n is None else f"[{n}] "
        raise ValueError(f"{name} must be C-contiguous 1-d int32 {size}got {a.dtype} {list(a.shape)}")


def launch_tile_slots(tile_expert, num_tiles, wave_map, tile_slot, stream=0) -> None:
    """tile_expert [tiles], num_tiles [1], wave_map [E], tile_slot [tiles] int32 (module docstring); no tiles
    launches nothing."""
    _check("tile_expert", tile_expert)
    _check("num_tiles", num_tiles, 1)
    _check("wave_map", wave_map)
    tiles = tile_expert.shape[0]
    _check("tile_slot", tile_slot, tiles)
    if tiles == 0:
        return
    _tile_slots_kernel[-(-tiles // THREADS), THREADS, stream](tile_expert, num_tiles, wave_map, tile_slot)


def sm90_signatures():
    """(python function, numba signature) of the kernel, for the sm_90 compile check."""
    i1 = types.int32[::1]
    return [(_tile_slots_kernel.py_func, (i1, i1, i1, i1))]
