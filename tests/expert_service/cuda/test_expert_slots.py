"""DeviceSlots on 8-bit and mixed-dtype experts in the CUDA simulator: two MoE layers of different strides (one
holds a float32 expert), a slot buffer of bytes per layer, the slot map planning waves, the fetch kernel copying
blocks from the (mapped) host copy and moe_q8 reading them through each wave's slot map. Over several steps every
output row equals the numpy reference of its expert, and each copy is counted at its own layer's stride."""

from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from expert_service.cuda.expert_slots import DeviceSlots
from expert_service.experts.grouping import group_by_expert
from expert_service.kernels.expert_quant import layer_kinds
from expert_service.kernels.expert_slot_map import MISSES, PREFETCHES_ISSUED
from expert_service.kernels.moe_q8 import launch_q8_down, launch_q8_gate_up
from tests.expert_service.kernels.test_moe_q8 import KINDS, check_close, mixed_layer, reference

F, D, T, K, S = 16, 32, 3, 2, 2
LAYER_KINDS = {1: KINDS[:5], 3: [KINDS[5], KINDS[0], KINDS[1], KINDS[2], KINDS[0]]}  # layer 3: a float32 expert


def _weights(rng):
    layers = {layer: mixed_layer(rng, kinds, F, D) for layer, kinds in LAYER_KINDS.items()}
    weights = SimpleNamespace(
        config=SimpleNamespace(num_experts=5),
        model=SimpleNamespace(expert_strides={layer: W.shape[1] for layer, (W, _, _) in layers.items()}),
        quantized=True,
        dtype=np.dtype(np.uint16),
        expert_host={layer: W.reshape(-1) for layer, (W, _, _) in layers.items()},
        expert_pinned={layer: False for layer in layers},  # the staged, mapped host copy
    )
    return weights, layers


@pytest.mark.slow  # tens of seconds in the simulator
def test_quantized_slots_compute_every_expert_from_its_own_bytes():
    rng = np.random.default_rng(21)
    weights, layers = _weights(rng)
    strides = [W.shape[1] for W, _, _ in layers.values()]
    assert strides[0] != strides[1]
    moe = list(layers)
    slots = DeviceSlots(weights, moe, S, T * K, "lru", 0)
    assert [b.shape for b in slots.buffers] == [(S, s) for s in strides] and slots.buffers[0].dtype == np.uint8
    metas = {layer: cuda.to_device(meta) for layer, (_, meta, _) in layers.items()}
    E = weights.config.num_experts
    previous = np.zeros((len(moe), 4), np.int64)
    for step in range(3):
        slots.advance(0)
        x = rng.standard_normal((T, D)).astype(np.float32)
        for layer in moe:
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
            groups = group_by_expert(ids, E)
            order, offsets = groups.order.astype(np.int32), groups.offsets.astype(np.int32)
            dorder, doffsets = cuda.to_device(order), cuda.to_device(offsets)
            h = cuda.to_device(np.full((T * K, F), np.nan, np.float32))
            y = cuda.to_device(np.full((T * K, D), np.nan, np.float32))
            waves = slots.waves(T * K)
            slots.plan(layer, cuda.to_device(ids.reshape(-1)), waves, 0)
            buffer, meta, kinds = slots.weights_of(layer), metas[layer], layer_kinds(layers[layer][1])
            for w in range(waves):
                slots.fetch(layer, w, 0)
                q8 = dict(offsets=doffsets, slot_of=slots.wave_slots(layer, w), kinds=kinds)
                launch_q8_gate_up(cuda.to_device(x), buffer, meta, F, D, h, order=dorder, **q8)
                launch_q8_down(h, buffer, meta, F, D, y, **q8)
            h, y = h.copy_to_host(), y.copy_to_host()
            assert np.isfinite(h).all() and np.isfinite(y).all(), f"step {step} layer {layer}: a row was never written"
            mats = layers[layer][2]
            for e in range(E):
                lo, hi = offsets[e], offsets[e + 1]
                if lo < hi:
                    ref_h, down = reference(x[order[lo:hi] // K], mats[e], F)
                    check_close(h[lo:hi], ref_h)
                    check_close(y[lo:hi], h[lo:hi].astype(np.float64) @ down.T)
        slots.download_stats(step % 2, 0)
        stats = slots.step_stats(step % 2)
        now = slots.stats.copy_to_host()
        copies = (now - previous)[:, MISSES] + (now - previous)[:, PREFETCHES_ISSUED]
        previous = now
        assert stats.bytes_copied == int(copies @ np.array(strides)) and stats.misses == int(copies.sum()) > 0
    slots.close()


def test_a_slot_holds_the_stored_bytes():
    """What the fetch kernel left in a slot is the expert's block as the experts file holds it."""
    rng = np.random.default_rng(3)
    weights, layers = _weights(rng)
    slots = DeviceSlots(weights, list(layers), S, T * K, "lru", 0)
    slots.advance(0)
    ids = np.array([4, 1], np.int32)
    slots.plan(3, cuda.to_device(ids), 1, 0)
    slots.fetch(3, 0, 0)
    slot_of = slots.wave_slots(3, 0).copy_to_host()
    held = slots.weights_of(3).copy_to_host()
    W = layers[3][0]
    for e in ids:
        assert slot_of[e] >= 0 and np.array_equal(held[slot_of[e]], W[e])
    slots.close()
