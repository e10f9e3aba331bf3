"""The engine following prefix-cache instructions (cpu, tiny model): a sequence started on another's registered
blocks computes the logits a full prefill computes, its shared blocks are never written, and malformed or stale
instructions fail the step or the sequence alone."""

import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import UNKNOWN_PREFIX_BLOCK, PrefillInput
from expert_service.engine.penalties import PROMPT_BIT, PenaltyParams
from expert_service.engine.prefix_blocks import sequence_block_registrations
from expert_service.engine.sampling import SamplingParams

BLOCK = 4


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request, tiny_model):
    config = EngineConfig(backend=request.param, kv_block_size=BLOCK, kv_cache_tokens=256, max_batch_tokens=64)
    built = build_engine(ModelDir.open(tiny_model), config)
    yield built
    built.close()


def _last_logits(engine, chunk: PrefillInput) -> np.ndarray:
    result = engine.step([chunk])
    assert not result.outputs[0].error, result.outputs[0]
    return np.array(result.logits[0])


def test_a_sequence_on_cached_blocks_equals_a_full_prefill(engine):
    prompt = np.random.default_rng(0).integers(3, 250, 14)
    # sequence 1 computes the prompt in two chunks, registering the three blocks it completes
    engine.step([PrefillInput(1, prompt[:6], SamplingParams(), False, cache_block_ids=(11,))])
    engine.step([PrefillInput(1, prompt[6:], None, True, cache_block_ids=(12, 13))])
    shared = [engine.allocator.cached[(0, i)] for i in (11, 12, 13)]
    before = engine.decoder.kv.k[:, shared].copy() if engine.backend == "cpu" else None  # cuda: on the device
    tail = np.concatenate([prompt[12:], [7, 8, 9]])
    reused = _last_logits(engine, PrefillInput(2, tail, SamplingParams(), True, prefix_block_ids=(11, 12, 13)))
    full = _last_logits(engine, PrefillInput(3, np.concatenate([prompt[:12], tail]), SamplingParams(), True))
    tolerance = 1e-5 if engine.backend == "cpu" else 1e-3  # cuda: kernels tile a 3-token and a 15-token pass apart
    np.testing.assert_allclose(reused, full, rtol=tolerance, atol=tolerance)
    assert engine.allocator.tables[2][:3] == shared and not set(engine.allocator.tables[2][3:]) & set(shared)
    if before is not None:
        np.testing.assert_array_equal(engine.decoder.kv.k[:, shared], before)
    engine.release([1, 2, 3])
    assert engine.allocator.num_used_blocks == 0 and engine.allocator.num_cached_blocks == 3
    engine.clear()
    assert engine.allocator.num_cached_blocks == 0 and engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_bad_instructions_fail_the_step_or_the_sequence(engine):
    prompt = np.arange(3, 13)
    with pytest.raises(InvalidRequestError, match="cache_block_ids"):  # two completed blocks, one id
        engine.step([PrefillInput(1, prompt, SamplingParams(), True, cache_block_ids=(5,))])
    assert 1 not in engine.sequences and engine.allocator.num_used_blocks == 0
    engine.step([PrefillInput(1, prompt, SamplingParams(), True, cache_block_ids=(5, 6))])
    with pytest.raises(InvalidRequestError, match="taken"):
        engine.step([PrefillInput(2, prompt, SamplingParams(), True, cache_block_ids=(5, 0))])
    with pytest.raises(InvalidRequestError, match="first chunk"):
        engine.step([PrefillInput(1, prompt[:2], None, False, prefix_block_ids=(5,))])
    stale = engine.step([PrefillInput(3, prompt[:3], SamplingParams(), True, prefix_block_ids=(5, 99))])
    assert stale.outputs[0].error == UNKNOWN_PREFIX_BLOCK and 3 not in engine.sequences
    other_owner = engine.collect(
        engine.launch([PrefillInput(4, prompt[:3], SamplingParams(), True, prefix_block_ids=(5,))], owner=7)
    )
    assert other_owner.outputs[0].error == UNKNOWN_PREFIX_BLOCK  # another stream's ids are not ours


def test_a_sequence_scoring_its_prompt_is_refused_cached_blocks(engine):
    """prompt_logprobs scores every prompt position: on cached blocks the prefix would go unscored and the first
    computed token would be scored as the prompt's first (NaN). Refused, as a penalty without its prefix tokens."""
    prompt = np.arange(3, 16)
    engine.step([PrefillInput(1, prompt, SamplingParams(), True, cache_block_ids=(21, 22, 23))])
    scoring = SamplingParams(prompt_logprobs=1)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        engine.step([PrefillInput(2, prompt[12:], scoring, True, prefix_block_ids=(21, 22, 23))])
    assert 2 not in engine.sequences and engine.allocator.tables.keys() == {1}
    whole = engine.step([PrefillInput(3, prompt, scoring, True)]).outputs[0]
    assert not whole.error and len(whole.prompt.logprobs) == len(prompt)


def test_a_penalised_sequence_counts_its_cached_prefix(engine):
    prompt = np.random.default_rng(1).integers(3, 250, 13)
    engine.step([PrefillInput(1, prompt, SamplingParams(), True, cache_block_ids=(21, 22, 23))])
    penalised = SamplingParams(penalties=PenaltyParams(repetition=1.8))
    with pytest.raises(InvalidRequestError, match="prefix_token_ids"):  # without the tokens: refused, not wrong
        engine.step([PrefillInput(2, prompt[12:], penalised, True, prefix_block_ids=(21, 22, 23))])
    with pytest.raises(InvalidRequestError, match="prefix_token_ids"):
        engine.step(
            [PrefillInput(2, prompt[12:], penalised, True, prefix_block_ids=(21, 22, 23), prefix_token_ids=(3,))]
        )
    reused = engine.step(
        [
            PrefillInput(
                2, prompt[12:], penalised, True, prefix_block_ids=(21, 22, 23), prefix_token_ids=tuple(prompt[:12])
            )
        ]
    )
    reused_logits = np.array(reused.logits.processed(0))  # the cuda engine's next step reuses the device rows
    full = engine.step([PrefillInput(3, prompt, penalised, True)])
    assert reused.outputs[0].token_id == full.outputs[0].token_id
    tolerance = 1e-5 if engine.backend == "cpu" else 1e-3
    np.testing.assert_allclose(reused_logits, full.logits.processed(0), rtol=tolerance, atol=tolerance)
    assert not np.allclose(full.logits.processed(0), full.logits[0])  # the penalty acted on the prompt's tokens


def test_a_sequence_on_blocks_its_decodes_filled_equals_a_full_prefill(engine):
    """Generated blocks (cache_sequence_blocks): sequence 1's decodes fill block 1 (prompt tail and two generated
    tokens), which is registered once the decode writing its last position was launched; sequence 2 starts on
    blocks 0 and 1 and computes the logits a full prefill of the same tokens computes (on the cuda backend the
    decodes wrote that K/V from graph replays)."""
    prompt = np.random.default_rng(2).integers(3, 250, 6)
    first = engine.step([PrefillInput(1, prompt, SamplingParams(), True, cache_block_ids=(31,))])
    generated = [first.outputs[0].token_id, engine.step(decode_ids=[1]).outputs[0].token_id]  # feeds position 6
    rows = np.array([[1, 1, 32]], "<u8")
    registrations = sequence_block_registrations(engine.allocator, engine.sequences, rows, 0, lambda _: True, {1: 1})
    engine.step(decode_ids=[1])  # feeds position 7: block 1 is full once this step is launched
    for seq_id, index, key in registrations:
        assert engine.allocator.register(seq_id, index, key)
    tail = np.array([5, 99, 31])
    reused = _last_logits(engine, PrefillInput(2, tail, SamplingParams(), True, prefix_block_ids=(31, 32)))
    whole = np.concatenate([prompt, generated, tail])
    full = _last_logits(engine, PrefillInput(3, whole, SamplingParams(), True))
    tolerance = 1e-5 if engine.backend == "cpu" else 1e-3
    np.testing.assert_allclose(reused, full, rtol=tolerance, atol=tolerance)
    engine.release([1, 2, 3])
    assert engine.allocator.num_used_blocks == 0 and engine.allocator.num_cached_blocks == 2
    engine.clear()


def test_a_presence_or_frequency_sequence_on_cached_blocks_needs_no_prefix_tokens(engine):
    """Presence and frequency count output tokens only: such a sequence on cached blocks runs without the prefix's
    tokens (as the router sends it to a worker that says so), and with them (as older routers send it), decoding as
    a full prefill does; no prompt token is marked in its penalty state, since nothing reads the marks."""
    rng = np.random.default_rng()
    prompt = rng.integers(3, 250, 13)
    engine.step([PrefillInput(1, prompt, SamplingParams(), True, cache_block_ids=(41, 42, 43))])
    presence, frequency = [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0)][rng.integers(3)] * rng.uniform(0.5, 2.0, 2)
    params = SamplingParams(penalties=PenaltyParams(presence=float(presence), frequency=float(frequency)))
    bare = PrefillInput(2, prompt[12:], params, True, prefix_block_ids=(41, 42, 43))
    sent = PrefillInput(
        3, prompt[12:], params, True, prefix_block_ids=(41, 42, 43), prefix_token_ids=tuple(prompt[:12])
    )
    tolerance = 1e-5 if engine.backend == "cpu" else 1e-3
    result = engine.step([bare, sent, PrefillInput(4, prompt, params, True)])
    for decodes in range(7):  # the penalties act from the first generated token on
        assert not any(out.error for out in result.outputs), result.outputs
        assert len({out.token_id for out in result.outputs}) == 1, result.outputs
        rows = [np.array(result.logits.processed(i)) for i in range(3)]
        np.testing.assert_allclose(rows[0], rows[2], rtol=tolerance, atol=tolerance)
        np.testing.assert_allclose(rows[1], rows[2], rtol=tolerance, atol=tolerance)
        if decodes < 6:
            result = engine.step(decode_ids=[2, 3, 4])
    if engine.backend == "cpu":
        words = engine.decoder.penalties.words[[engine.penalty_slots.slots[rid] for rid in (2, 3, 4)]]
        assert not (words & PROMPT_BIT).any() and (words >> 1).sum() == 3 * 6
    engine.release([1, 2, 3, 4])
    engine.clear()
