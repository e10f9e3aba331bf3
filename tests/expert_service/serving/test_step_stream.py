"""StreamSession on the cpu engine of the tiny model: which sequences a session owns, and that everything a
sequence holds (its KV blocks, its penalty state slot) comes back when it is freed or its stream ends."""

from __future__ import annotations

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import UNKNOWN_SEQUENCE, PrefillInput
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from expert_service.serving.step_stream import FOREIGN_SEQUENCE, StepRequest, StreamSession

PENALISED = SamplingParams(penalties=PenaltyParams(repetition=1.3, frequency=0.5))


@pytest.fixture(scope="module")
def engine(tiny_model):
    return build_engine(
        ModelDir.open(tiny_model), EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=512, max_batch_size=4)
    )


@pytest.fixture
def owners(engine):
    owners: dict[int, int] = {}
    yield owners
    engine.clear()


def _step(session, chunks=(), decodes=(), frees=()):
    return session.run(StepRequest(0, np.asarray(frees, "<u8"), list(chunks), np.asarray(decodes, "<u8"), None))


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 200, n)


def _holds_nothing(engine) -> bool:
    return not engine.sequences and not engine.penalty_slots.slots and engine.allocator.num_used_blocks == 0


def test_a_decode_sent_mid_prefill_fails_alone_and_the_sequence_stays_the_sessions_to_free(engine, owners):
    """The decode fails with UNKNOWN_SEQUENCE, but the engine still holds the half-prefilled sequence: the
    session keeps owning it, so the router's free (or the stream's end) returns its blocks and penalty slot, and
    no other stream may step it."""
    session, other = StreamSession(engine, owners), StreamSession(engine, owners)
    _step(session, [PrefillInput(7, _prompt(1, 5), PENALISED, False)])
    assert _step(session, decodes=[7]).result.outputs[0].error == UNKNOWN_SEQUENCE
    assert _step(other, [PrefillInput(7, _prompt(2, 2), None, True)]).result.outputs[0].error == FOREIGN_SEQUENCE
    _step(session, frees=[7])
    assert _holds_nothing(engine), (list(engine.sequences), engine.penalty_slots.slots)

    _step(session, [PrefillInput(8, _prompt(3, 5), PENALISED, False)])
    _step(session, decodes=[8])
    session.close()
    assert _holds_nothing(engine), (list(engine.sequences), engine.penalty_slots.slots)
