"""Late masks on the step stream (StepPump, wire.step_request): a step's late masks ride the next message, or one
of their own with no work; late masks nobody waits for, wrong ones and malformed ones refuse their message naming
late_token_masks; rows whose masks cannot come (the message carrying them refused, the stream ended, too late)
fail alone with MISSING_TOKEN_MASK, and the late masks of the message after are ignored. On the cpu engine of the
tiny model, overlapped and one step at a time."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.model_format import ModelDir
from common.pb import worker_pb2 as pb
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import MISSING_TOKEN_MASK, PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.engine.token_masks import mask_words
from expert_service.serving import step_stream, wire
from expert_service.serving.lifecycle import ModelThread
from expert_service.serving.step_stream import StepAnswer, StepLimits, StepPump, StepRequest, StreamSession
from tests.expert_service.engine.test_late_masks import pack
from tests.helpers import cpu_engine

NONE = np.zeros(0, "<u8")
TIMEOUT_S = 30


@pytest.fixture(scope="module", params=[True, False], ids=["overlapped", "sequential"])
def engine(request, tiny_model):
    config = EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024, max_batch_size=8)
    return cpu_engine(ModelDir.open(tiny_model), config, overlap=request.param)


@pytest.fixture
def pump(engine):
    thread = ModelThread()
    pump = StepPump(StreamSession(engine, {}), thread)
    yield pump
    pump.close().result(TIMEOUT_S)
    thread.shutdown()
    assert not engine.sequences and engine.allocator.num_used_blocks == 0


class Masks:
    """Random allowed sets, one per (step, sequence)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng, self.sets = vocab, np.random.default_rng(seed), {}

    def __call__(self, step: int, rid: int) -> np.ndarray:
        if (step, rid) not in self.sets:
            self.sets[step, rid] = self.rng.choice(self.vocab, int(self.rng.integers(1, 6)), replace=False)
        return pack(self.sets[step, rid], self.vocab)

    def allows(self, step: int, rid: int, token: int) -> bool:
        return token in self.sets[step, rid]


def msg(step_id, chunks=(), decodes=(), frees=(), masks=None, late=None) -> StepRequest:
    ids = np.asarray(decodes, "<u8")
    return StepRequest(step_id, np.asarray(frees, "<u8"), list(chunks), ids, None, masks=masks, late_masks=late)


def start(pump, masks) -> StepRequest:
    """Step 0: sequence 10 constrained greedy (its first mask on time) beside plain greedy 12."""
    chunks = [PrefillInput(10, np.arange(3, 9), SamplingParams(constrained=True), True)]
    chunks.append(PrefillInput(12, np.arange(4, 7), SamplingParams(), True))
    return msg(0, chunks, masks={10: masks(0, 10)})


def outputs(answer: StepAnswer) -> dict:
    assert answer.result is not None, answer.refused
    return {o.request_id: o for o in answer.result.outputs}


def test_late_masks_ride_the_next_message_or_one_of_their_own(pump, engine):
    masks = Masks(engine.model_config.vocab_size)
    sent = [start(pump, masks), msg(1, decodes=[10, 12])]
    sent += [msg(k, decodes=[10, 12], late={10: masks(k - 1, 10)}) for k in range(2, 6)]
    sent.append(msg(6, late={10: masks(5, 10)}))  # nothing more to run: the masks alone
    answers = [f.result(TIMEOUT_S) for f in [pump.submit(m) for m in sent]]
    for k, answer in enumerate(answers[:-1]):
        out = outputs(answer)
        assert masks.allows(k, 10, out[10].token_id) and not out[12].error
    assert answers[-1].result is None and answers[-1].refused == "" and answers[-1].kind == "free"
    pump.submit(msg(7, frees=[10, 12])).result(TIMEOUT_S)


def test_a_late_stop_needs_no_mask_and_its_token_is_still_answered(pump, engine):
    masks = Masks(engine.model_config.vocab_size, 1)
    sent = [start(pump, masks), msg(1, decodes=[10, 12]), msg(2, decodes=[12], frees=[10])]
    answers = [f.result(TIMEOUT_S) for f in [pump.submit(m) for m in sent]]
    assert not outputs(answers[1])[10].error and set(outputs(answers[2])) == {12}
    pump.submit(msg(3, frees=[12])).result(TIMEOUT_S)


def test_late_masks_nobody_waits_for_refuse_their_message(pump, engine):
    masks = Masks(engine.model_config.vocab_size, 2)
    first = pump.submit(start(pump, masks))
    stray = pump.submit(msg(1, decodes=[12], late={10: masks(0, 10)})).result(TIMEOUT_S)
    assert stray.result is None and stray.refused.startswith("late_token_masks: no step")
    outputs(first.result(TIMEOUT_S))
    assert not outputs(pump.submit(msg(2, decodes=[12])).result(TIMEOUT_S))[12].error  # the stream goes on
    pump.submit(msg(3, frees=[10, 12])).result(TIMEOUT_S)


@pytest.mark.parametrize("how", ["missing", "extra", "empty", "malformed"])
def test_rows_whose_masks_are_refused_fail_alone_and_the_next_late_masks_are_ignored(pump, engine, how):
    vocab = engine.model_config.vocab_size
    masks = Masks(vocab, 3)
    late = {
        "missing": {},
        "extra": {10: masks(1, 10), 12: masks(1, 12)},
        "empty": {10: np.zeros(mask_words(vocab), np.uint32)},
    }
    futures = [pump.submit(start(pump, masks)), pump.submit(msg(1, decodes=[10, 12]))]
    if how == "malformed":  # refused while parsing (wire.refused_step_request): it never became a step
        refused = wire.refused_step_request(
            pb.StepStreamRequest(step_id=2), StepLimits.of(engine), "late_token_masks: 3 bytes"
        )
        futures.append(pump.submit(refused))
    else:
        futures.append(pump.submit(msg(2, decodes=[12], late=late[how])))
    futures.append(pump.submit(msg(3, decodes=[12], late={10: masks(2, 10)})))  # for step 2, which did not run
    answers = [f.result(TIMEOUT_S) for f in futures]
    out = outputs(answers[1])
    assert out[10].error == MISSING_TOKEN_MASK and not out[12].error
    assert answers[2].result is None and answers[2].refused.startswith("late_token_masks: ")
    assert not outputs(answers[3])[12].error
    assert 10 not in engine.sequences
    pump.submit(msg(4, frees=[10, 12])).result(TIMEOUT_S)


def test_the_stream_ending_fails_the_rows_waiting_for_late_masks(engine):
    thread = ModelThread()
    pump = StepPump(StreamSession(engine, {}), thread)
    masks = Masks(engine.model_config.vocab_size, 4)
    futures = [pump.submit(start(pump, masks)), pump.submit(msg(1, decodes=[10, 12]))]
    pump.close().result(TIMEOUT_S)
    out = outputs(futures[1].result(TIMEOUT_S))
    assert out[10].error == MISSING_TOKEN_MASK and not out[12].error
    assert not engine.sequences and engine.allocator.num_used_blocks == 0
    thread.shutdown()


def test_late_masks_that_take_too_long_fail_their_rows(pump, engine, monkeypatch):
    monkeypatch.setattr(step_stream, "LATE_MASKS_TIMEOUT_S", 0.05)
    masks = Masks(engine.model_config.vocab_size, 5)
    pump.submit(start(pump, masks))
    out = outputs(pump.submit(msg(1, decodes=[10, 12])).result(TIMEOUT_S))
    assert out[10].error == MISSING_TOKEN_MASK and not out[12].error
    late = pump.submit(msg(2, decodes=[12], late={10: masks(1, 10)})).result(TIMEOUT_S)
    assert set(outputs(late)) == {12}  # the masks that came after all are ignored
    pump.submit(msg(3, frees=[12])).result(TIMEOUT_S)


def test_the_wire_reads_late_masks_and_refuses_a_wrong_size_naming_the_field():
    limits = StepLimits((0,), 16, 4, vocab_size=40)
    words = np.stack([pack([1, 39], 40), pack([5], 40)]).astype("<u4")
    request = pb.StepStreamRequest(late_mask_request_ids=np.array([4, 9], "<u8").tobytes())
    request.late_token_masks = words.tobytes()
    got = wire.step_request(request, limits).late_masks
    assert got is not None and sorted(got) == [4, 9] and (got[9] == words[1]).all()
    hostile = [
        (words.tobytes()[:-4], [4, 9], "late_token_masks: "),
        (words.tobytes() + b"\0" * 4, [4, 9], "late_token_masks: "),
        (np.concatenate([words, words]).tobytes(), [4, 4, 9, 9], "late_mask_request_ids: a sequence is named twice"),
        (np.tile(words, (3, 1)).tobytes(), [1, 2, 3, 4, 5, 6], "late_mask_request_ids: 6 ids, at most"),
        (b"", [4], "late_token_masks: 0 bytes"),
    ]
    for data, ids, why in hostile:
        request.late_mask_request_ids, request.late_token_masks = np.asarray(ids, "<u8").tobytes(), data
        with pytest.raises(InvalidRequestError) as refused:
            wire.step_request(request, limits)
        assert str(refused.value).startswith(why) and "\n" not in str(refused.value)
    request.late_mask_request_ids = b"\1\2\3"  # not whole uint64s
    with pytest.raises(InvalidRequestError, match="late_mask_request_ids"):
        wire.step_request(request, limits)
