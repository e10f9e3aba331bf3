"""Late masks on the cuda backend. In the CUDA simulator unless on a GPU: DeviceMasks stages each step's masks in
its own host copy, so a step whose late masks are queued right before the next step stages its on-time ones keeps
its own (the upload may not have run yet), and the masked argmax replaces the greedy ids. GPU only: the cuda
engine (graphs and eager) gives the same tokens, bit for bit, when the masks of its greedy constrained decodes
come one message late as when they come with their step (tests/expert_service/engine/test_late_masks.py's
streams: random grammars, plain greedy and penalised neighbours)."""

from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from expert_service.cuda.token_masks import DeviceMasks
from expert_service.engine.token_masks import apply_masks_reference
from expert_service.kernels.greedy_split import parts
from tests.expert_service.engine.test_late_masks import Stream, late, on_time, pack

ROWS, VOCAB = 4, 300


def workspace(rows: int, vocab: int):
    p = parts(vocab)
    return SimpleNamespace(
        greedy_ids=cuda.to_device(np.full(rows, -1, np.int32)),
        greedy_part_values=cuda.device_array((rows, p), np.float32),
        greedy_part_ids=cuda.device_array((rows, p), np.int32),
        greedy_part_flags=cuda.device_array((rows, p), np.int32),
    )


def test_the_planned_bytes_are_what_is_allocated():
    """The start-up device-memory check sizes the masks before any exist."""
    assert (
        DeviceMasks.planned_nbytes(ROWS, VOCAB)
        == DeviceMasks(ROWS, VOCAB, workspace(ROWS, VOCAB), cuda.stream()).nbytes
    )


def test_each_step_stages_its_masks_in_its_own_host_copy_and_the_masked_argmax_replaces_the_greedy_ids():
    rng = np.random.default_rng()
    stream = cuda.stream()
    ws = workspace(ROWS, VOCAB)
    masks = DeviceMasks(ROWS, VOCAB, ws, stream)
    logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
    allowed = [[rng.choice(VOCAB, int(rng.integers(1, 9)), replace=False) for _ in range(ROWS)] for _ in range(2)]
    words = [np.stack([pack(a, VOCAB) for a in step]) for step in allowed]
    masks.apply(words[0], cuda.to_device(logits), cuda.to_device(logits), 0, twin=0)
    staged = masks.host_masks[0][:ROWS].copy()
    ids = ws.greedy_ids.copy_to_host(stream=stream)
    stream.synchronize()
    masks.apply(words[1], cuda.to_device(logits), cuda.to_device(logits), 0, twin=1)
    np.testing.assert_array_equal(masks.host_masks[0][:ROWS], staged)  # the other step's staging is left alone
    np.testing.assert_array_equal(staged, words[0])
    want = np.argmax(apply_masks_reference(logits, words[0]), axis=1)
    np.testing.assert_array_equal(ids, want)
    stream.synchronize()
    want = np.argmax(apply_masks_reference(logits, words[1]), axis=1)
    np.testing.assert_array_equal(ws.greedy_ids.copy_to_host(), want)


@pytest.fixture(scope="module", params=[True, False], ids=["graphs", "eager"])
def engine(request, tmp_path_factory):
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.tools.tiny_model import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("late_masks") / "m", family="qwen3_moe", seed=7)
    config = EngineConfig(
        backend="cuda",
        cuda_graphs=request.param,
        kv_block_size=8,
        kv_cache_tokens=4096,
        max_batch_tokens=512,
        max_batch_size=16,
    )
    engine = build_engine(ModelDir.open(model), config)
    engine.warmup()
    return engine


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_late_masked_greedy_streams_equal_on_time_ones_bit_for_bit(engine, seed):
    penalised = seed % 2 == 1
    want = on_time(engine, Stream(engine, seed, penalised), steps=12)
    got = late(engine, Stream(engine, seed, penalised), steps=12)
    assert got == want
    assert engine.decoder.supports_overlap  # the late run overlapped its steps: fed the masked argmax on the device
