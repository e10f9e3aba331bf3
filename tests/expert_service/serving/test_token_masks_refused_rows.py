"""The token mask of a constrained sequence the stream refuses alone (a new sequence while the worker drains,
another stream's sequence) goes with it: the rest of the step runs. On the cpu engine of the tiny model."""

from __future__ import annotations

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.serving.step_stream import DRAINING, FOREIGN_SEQUENCE, StepRequest, StreamSession
from tests.expert_service.engine.test_late_masks import pack
from tests.helpers import cpu_engine

NONE = np.zeros(0, "<u8")
CONSTRAINED = SamplingParams(constrained=True)


def _step(step_id, chunks=(), decodes=(), masks=None) -> StepRequest:
    return StepRequest(step_id, NONE, list(chunks), np.asarray(decodes, "<u8"), None, masks=masks)


@pytest.mark.parametrize("error", [DRAINING, FOREIGN_SEQUENCE])
def test_the_mask_of_a_row_refused_alone_is_dropped_with_it(tiny_model, error):
    model = ModelDir.open(tiny_model)
    engine = cpu_engine(model, EngineConfig(backend="cpu", kv_block_size=4), False)
    owners, drains = {}, []
    session = StreamSession(engine, owners, lambda: bool(drains))
    vocab = model.config.vocab_size
    first = session.run(
        _step(1, [PrefillInput(1, np.array([5, 6, 7]), CONSTRAINED, True)], masks={1: pack([9], vocab)})
    )
    assert [o.token_id for o in first.result.outputs] == [9]
    if error == DRAINING:
        drains.append(True)
    else:  # sequence 2 belongs to another stream
        StreamSession(engine, owners).run(_step(1, [PrefillInput(2, np.array([4]), SamplingParams(), False)]))
    chunk = PrefillInput(2, np.array([8, 9]), CONSTRAINED if error == DRAINING else None, True)
    masks = {2: pack([3, 4], vocab), 1: pack([11], vocab)}
    answer = session.run(_step(2, [chunk], [1], masks))
    assert answer.refused == "", answer.refused
    assert sorted((o.request_id, o.token_id, o.error) for o in answer.result.outputs) == [(1, 11, ""), (2, None, error)]
