"""tile_slots vs numpy (every element written, garbage past the used tiles cleared), and the expert cache's waves
on the tensor-core grouped kernels: the step's tiles split over waves of a few slots, each wave's experts copied
into a slot buffer at random slots and run through their tile -> slot map, give bitwise the h and y of one pass
over all experts (each tile is computed by the same kernel from the same values, only in another launch)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles
from expert_service.kernels.moe_gemm_mma import SIM_CONFIG, SIM_CONFIG_2, launch_moe_gemm_down, launch_moe_gemm_gate_up
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.tile_slots import launch_tile_slots
from tests.helpers import expert_buffer, random_ids

GARBAGE = -7
NAN16 = 0x7FC1


def reference(tile_expert, num_tiles, wave_map):
    t = np.arange(tile_expert.size)
    return np.where(t < num_tiles, wave_map[np.clip(tile_expert, 0, wave_map.size - 1)], -1).astype(np.int32)


@pytest.mark.parametrize("tiles,used,E", [(1, 1, 3), (37, 20, 8), (70, 70, 128), (5, 0, 4)])
def test_matches_numpy(tiles, used, E):
    rng = np.random.default_rng(tiles * 100 + used)
    tile_expert = np.full(tiles, 10_000, np.int32)  # past the used tiles: out of range, must not be read
    tile_expert[:used] = np.sort(rng.integers(0, E, used))
    wave_map = np.where(rng.random(E) < 0.5, rng.permutation(E), -1).astype(np.int32)
    out = cuda.to_device(np.full(tiles, GARBAGE, np.int32))
    launch_tile_slots(
        cuda.to_device(tile_expert), cuda.to_device(np.array([used], np.int32)), cuda.to_device(wave_map), out
    )
    np.testing.assert_array_equal(out.copy_to_host(), reference(tile_expert, used, wave_map))


def test_refuses_wrong_buffers():
    i = cuda.to_device(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="tile_slot"):
        launch_tile_slots(i, cuda.to_device(np.zeros(1, np.int32)), i, cuda.to_device(np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match="num_tiles"):
        launch_tile_slots(i, i, i, i)


def _pass(xs, tile_expert, num_tiles, sorted_ids, W, F, D, h, y, cfg):
    launch_moe_gemm_gate_up(xs, tile_expert, num_tiles, W, F, D, h, config=cfg)
    launch_moe_gemm_down(h, tile_expert, num_tiles, sorted_ids, W, F, D, y, combine="store", config=cfg)


def _sorted_step(rng, ids, E, D, F, bm):
    """The step's assignments sorted into tiles (moe_align) and their rows gathered in bf16, then two (h, y) output
    pairs starting as NaN: (sorted_ids, tile_expert, num_tiles, xs, [(h_ref, y_ref), (h, y)])."""
    n_tok, K = ids.shape
    n = ids.size
    tiles = max_tiles(n, E, bm)
    sorted_ids, tile_expert, num_tiles, position = (
        cuda.to_device(np.full(s, GARBAGE, np.int32)) for s in (tiles * bm, tiles, 1, n)
    )
    launch_moe_align(cuda.to_device(ids), E, bm, sorted_ids, tile_expert, num_tiles, position)
    x = cuda.to_device(rng.standard_normal((n_tok, D)).astype(np.float32))
    xs = cuda.to_device(np.full((tiles * bm, D), NAN16, np.uint16))
    launch_moe_gather_bf16(x, sorted_ids, num_tiles, K, bm, xs)
    outputs = [
        (
            cuda.to_device(np.full((tiles * bm, F), NAN16, np.uint16)),
            cuda.to_device(np.full((n, D), np.nan, np.float32)),
        )
        for _ in "ab"
    ]
    return sorted_ids, tile_expert, num_tiles, xs, outputs


def _waves(rng, ids, E, W, slots, fill, tile_expert, num_tiles, tile_slot):
    """Yields the slot buffer [slots, stride] of each wave (the step's experts in random order, a few at a time,
    each in a random slot; the other slots hold `fill`) after writing the wave's tile -> slot map into tile_slot."""
    needed = rng.permutation(np.unique(ids))
    slot_buffer = cuda.to_device(np.full((slots, W.shape[1]), fill, W.dtype))
    for first in range(0, needed.size, slots):
        wave = needed[first : first + slots]
        wave_map = np.full(E, -1, np.int32)
        host = np.full((slots, W.shape[1]), fill, W.dtype)
        for e, s in zip(wave, rng.permutation(slots)):
            wave_map[e], host[s] = s, W[e]
        slot_buffer.copy_to_device(host)
        launch_tile_slots(tile_expert, num_tiles, cuda.to_device(wave_map), tile_slot)
        yield slot_buffer


def _check_equal(bm, num_tiles, outputs):
    (h_ref, y_ref), (h, y) = outputs
    used = int(num_tiles.copy_to_host()[0]) * bm
    np.testing.assert_array_equal(h.copy_to_host()[:used], h_ref.copy_to_host()[:used])
    y_host = y.copy_to_host()
    assert np.isfinite(y_host).all(), "a routed row of y was not written by its wave"
    np.testing.assert_array_equal(y_host, y_ref.copy_to_host())


@pytest.mark.skipif(not SIMULATOR, reason="simulator shapes (the GPU's cached-engine tests cover real configs)")
@pytest.mark.parametrize("cfg,slots", [(SIM_CONFIG, 1), (SIM_CONFIG_2, 2), (SIM_CONFIG, 3)], ids=["1", "2", "3"])
def test_waves_through_slots_equal_one_pass(cfg, slots):
    rng = np.random.default_rng(slots)
    n_tok, K, E, F, D = 9, 2, 6, 24, 40
    ids = random_ids(rng, n_tok, K, E)
    W, _ = expert_buffer(rng, E, F, D, np.uint16, scale=1.0 / np.sqrt(D))
    bm = cfg.block_m
    sorted_ids, tile_expert, num_tiles, xs, outputs = _sorted_step(rng, ids, E, D, F, bm)
    (h_ref, y_ref), (h, y) = outputs
    _pass(xs, tile_expert, num_tiles, sorted_ids, cuda.to_device(W), F, D, h_ref, y_ref, cfg)
    tile_slot = cuda.to_device(np.full(tile_expert.shape[0], GARBAGE, np.int32))
    for slot_buffer in _waves(rng, ids, E, W, slots, NAN16, tile_expert, num_tiles, tile_slot):
        _pass(xs, tile_slot, num_tiles, sorted_ids, slot_buffer, F, D, h, y, cfg)
    _check_equal(bm, num_tiles, outputs)


@pytest.mark.skipif(not SIMULATOR, reason="simulator shapes (the GPU's cached-engine tests cover real configs)")
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_q8_waves_through_slots_equal_one_pass(slots):
    """The same on the 8-bit kernels (moe_gemm_q8mma's tile_slot): mixed int8 / fp8 experts of both scale schemes,
    meta read by expert id while the bytes come from the slot; slots start as 0xFF (fp8 NaN) and tiles of other
    waves are skipped."""
    from expert_service.kernels.moe_gemm_q8mma import SIM_CONFIG as Q8_SIM
    from expert_service.kernels.moe_gemm_q8mma import launch_q8mma_down, launch_q8mma_gate_up
    from tests.expert_service.kernels.test_moe_gemm_q8mma import KINDS, q8_layer

    rng = np.random.default_rng(10 + slots)
    n_tok, K, E, F, D = 7, 2, 5, 32, 144
    ids = random_ids(rng, n_tok, K, E)
    W, meta = q8_layer(rng, KINDS, F, D)
    dmeta, bm = cuda.to_device(meta), Q8_SIM.block_m
    sorted_ids, tile_expert, num_tiles, xs, outputs = _sorted_step(rng, ids, E, D, F, bm)
    (h_ref, y_ref), (h, y) = outputs
    dW = cuda.to_device(W)
    launch_q8mma_gate_up(xs, tile_expert, num_tiles, dW, dmeta, F, D, h_ref, config=Q8_SIM)
    launch_q8mma_down(h_ref, tile_expert, num_tiles, sorted_ids, dW, dmeta, F, D, y_ref, config=Q8_SIM)
    tile_slot = cuda.to_device(np.full(tile_expert.shape[0], GARBAGE, np.int32))
    for slot_buffer in _waves(rng, ids, E, W, slots, 0xFF, tile_expert, num_tiles, tile_slot):
        q8 = dict(config=Q8_SIM, tile_slot=tile_slot)
        launch_q8mma_gate_up(xs, tile_expert, num_tiles, slot_buffer, dmeta, F, D, h, **q8)
        launch_q8mma_down(h, tile_expert, num_tiles, sorted_ids, slot_buffer, dmeta, F, D, y, **q8)
    _check_equal(bm, num_tiles, outputs)
