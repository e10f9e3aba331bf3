"""DeviceLogits (cuda/device_logits.py), in the CUDA simulator unless on a GPU: a step's rows are fetched lazily from a
workspace the next step overwrites, so a fetch after that raises instead of returning the later step's rows."""

from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from expert_service.cuda.device_logits import DeviceLogits

ROWS, VOCAB, MAX_SEQS = 3, 37, 5


def step_results(rng):
    """One step's device logits [MAX_SEQS, VOCAB] and its host argmax / non-finite flags [MAX_SEQS]."""
    return (
        rng.standard_normal((MAX_SEQS, VOCAB)).astype(np.float32),
        rng.integers(0, VOCAB, MAX_SEQS).astype(np.int32),
        rng.integers(0, 2, MAX_SEQS).astype(np.int32),
    )


def fake_decoder(rng):
    """What DeviceLogits reads of a CudaDecoder, holding one staged step's results."""
    logits, ids, flags = step_results(rng)
    host = {"logits": np.full((MAX_SEQS, VOCAB), np.nan, np.float32), "greedy_ids": ids, "nonfinite": flags}
    return SimpleNamespace(
        ws=SimpleNamespace(logits=cuda.to_device(logits), host=host), stream=cuda.stream(), staged_steps=1
    ), logits


def next_step(decoder, rng):
    """The next step: staged, then its results overwrite the workspace and the host readbacks."""
    logits, ids, flags = step_results(rng)
    decoder.staged_steps += 1
    decoder.ws.logits.copy_to_device(logits)
    decoder.ws.host["greedy_ids"][:], decoder.ws.host["nonfinite"][:] = ids, flags
    return logits, ids, flags


def test_rows_fetched_within_their_step_stay_that_steps():
    rng = np.random.default_rng()
    decoder, logits = fake_decoder(rng)
    ids, flags = decoder.ws.host["greedy_ids"].copy(), decoder.ws.host["nonfinite"].copy()
    read = DeviceLogits(decoder, ROWS)
    assert len(read) == ROWS
    np.testing.assert_array_equal(np.stack(list(read)), logits[:ROWS])
    next_step(decoder, rng)
    np.testing.assert_array_equal(np.stack([read[r] for r in range(ROWS)]), logits[:ROWS])
    assert [read.greedy(r) for r in range(ROWS)] == [(int(ids[r]), not flags[r]) for r in range(ROWS)]


def test_rows_fetched_after_the_next_step_raise():
    rng = np.random.default_rng()
    decoder, _ = fake_decoder(rng)
    ids, flags = decoder.ws.host["greedy_ids"].copy(), decoder.ws.host["nonfinite"].copy()
    stale = DeviceLogits(decoder, ROWS)
    later, _, _ = next_step(decoder, rng)
    with pytest.raises(RuntimeError, match="logits of step 1 read after step 2"):
        stale[0]
    with pytest.raises(RuntimeError):
        list(stale)
    assert [stale.greedy(r) for r in range(ROWS)] == [(int(ids[r]), not flags[r]) for r in range(ROWS)]
    np.testing.assert_array_equal(np.stack(list(DeviceLogits(decoder, ROWS))), later[:ROWS])


def test_processed_rows_are_the_penalised_ones_then_the_raw_ones():
    rng = np.random.default_rng()
    decoder, logits = fake_decoder(rng)
    penalised = rng.standard_normal((2, VOCAB)).astype(np.float32)
    decoder.penalties = SimpleNamespace(download=lambda n: penalised[:n].copy())
    read = DeviceLogits(decoder, ROWS, penalized=2)
    np.testing.assert_array_equal(
        np.stack([read.processed(r) for r in range(ROWS)]), np.concatenate([penalised, logits[2:ROWS]])
    )
    np.testing.assert_array_equal(read[0], logits[0])  # indexing stays the raw rows
    stale = DeviceLogits(decoder, ROWS, penalized=2)
    next_step(decoder, rng)
    with pytest.raises(RuntimeError, match="read after step"):
        stale.processed(0)
