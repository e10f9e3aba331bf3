"""The cuda backend's DevicePenalties against the cpu backend's HostPenalties over several steps (resets,
prompt marks, output counts, penalised and unpenalised rows): in Numba's simulator, and at a real vocabulary
size on a GPU."""
from __future__ import annotations

import types

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.penalties import HostPenalties
from expert_service.cuda.penalties import DevicePenalties
from expert_service.kernels.greedy_split import parts
from expert_service.penalties import PenaltyParams, PenaltySlots


def _workspace(rows: int, vocab: int):
    """The workspace arrays DevicePenalties writes its argmax into, pre-filled so unwritten values show."""
    p = parts(vocab)
    return types.SimpleNamespace(
        greedy_ids=cuda.to_device(np.full(rows, -1, np.int32)), nonfinite=cuda.to_device(np.full(rows, -1, np.int32)),
        greedy_part_values=cuda.device_array((rows, p), np.float32),
        greedy_part_ids=cuda.device_array((rows, p), np.int32), greedy_part_flags=cuda.device_array((rows, p), np.int32))


def _compare(vocab: int, steps: int, seed=None):
    rng = np.random.default_rng(seed)
    num_slots, max_rows = 3, 4
    stream = cuda.stream()
    ws = _workspace(max_rows, vocab)
    device = DevicePenalties(num_slots, vocab, max_rows, 64, ws, stream)
    host, slots = HostPenalties(num_slots, vocab), PenaltySlots(num_slots)
    params = {1: PenaltyParams(1.3, 0.4, 0.2), 2: PenaltyParams(), 3: PenaltyParams(0.8, -0.5, 1.1),
              4: PenaltyParams(repetition=2.0)}
    last = {}
    for step in range(steps):
        builder = slots.builder()
        if step == 0:
            for rid in (1, 3):
                builder.reset(slots.acquire(rid))
        if step == 2:          # sequence 1 leaves; 4 takes its slot, which must start from zero
            slots.release(1)
            builder.reset(slots.acquire(4))
            del last[1]
        rids = [rid for rid in (1, 2, 3, 4) if (rid != 1 or step < 2) and (rid != 4 or step >= 2)]
        for rid in rids:
            if rid in last:
                builder.output(rid, last[rid])
            else:
                builder.prompt(rid, rng.integers(0, vocab, 7))
            builder.row(rid, params[rid])
        batch = builder.build()
        logits = (rng.standard_normal((len(rids), vocab)) * 3).astype(np.float32)
        want = host.apply(batch, logits)
        n = device.apply(batch, cuda.to_device(logits, stream=stream))
        assert n == len(rids)
        got = device.download(n)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(ws.greedy_ids.copy_to_host()[:n], np.argmax(want, axis=1))
        assert not ws.nonfinite.copy_to_host()[:n].any()
        np.testing.assert_array_equal(device.words.copy_to_host(), host.words)
        for r, rid in enumerate(rids):
            last[rid] = int(np.argmax(want[r])) if rng.random() < 0.5 else last.get(rid, 0)


def test_device_penalties_match_the_host_over_steps():
    _compare(vocab=41, steps=5)


def test_a_step_of_updates_only_writes_no_rows():
    stream = cuda.stream()
    device = DevicePenalties(2, 30, 2, 16, _workspace(2, 30), stream)
    slots = PenaltySlots(2)
    builder = slots.builder()
    builder.reset(slots.acquire(7))
    builder.prompt(7, np.array([3, 3, 29]))                # a prompt chunk that does not end its prompt
    batch = builder.build()
    assert device.apply(batch, cuda.to_device(np.zeros((0, 30), np.float32))) == 0
    words = device.words.copy_to_host()
    assert words[slots.slots[7], [3, 29]].tolist() == [1, 1] and words.sum() == 2


@pytest.mark.gpu
def test_device_penalties_match_the_host_at_a_real_vocabulary():
    _compare(vocab=151936, steps=6, seed=0)
