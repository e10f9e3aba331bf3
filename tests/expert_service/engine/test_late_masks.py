"""Late masks on the engine (Engine.launch with greedy constrained decodes whose masks come after launch,
apply_late_masks, fail_late_masks, collect): a stream whose masks come one message late gives the tokens on-time
masks give, overlapped or one step at a time; a step waiting for its masks cannot be collected or followed;
wrong late masks are refused with one line naming late_token_masks and change nothing; only plain greedy decodes
may wait for theirs. The masks come from a random "grammar": each token's allowed next tokens."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.model_format import ModelDir
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import MISSING_TOKEN_MASK, PrefillInput
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from expert_service.engine.token_masks import mask_words
from tests.helpers import cpu_engine

GREEDY = SamplingParams(constrained=True)
CONFIG = dict(kv_block_size=4, kv_cache_tokens=2048, max_batch_tokens=256, max_batch_size=8)


def pack(ids, vocab: int) -> np.ndarray:
    words = np.zeros(mask_words(vocab), np.uint32)
    for t in ids:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words


def grammar(seed: int, seq: int, prev: int, vocab: int) -> np.ndarray:
    """The tokens a sequence may take after `prev`: 1 to 12 random ids, fixed per (seed, sequence, prev)."""
    rng = np.random.default_rng([seed, seq, prev])
    return rng.choice(vocab, size=int(rng.integers(1, 13)), replace=False)


class Stream:
    """Random sequences: constrained greedy ones, plain greedy ones and (penalised) a penalised unconstrained
    one; the tokens each takes, checked against its grammar as they come."""

    def __init__(self, engine, seed: int, penalised: bool = False):
        rng = np.random.default_rng(seed)
        self.engine, self.seed, self.vocab = engine, seed, engine.model_config.vocab_size
        n_constrained, n_plain = int(rng.integers(1, 4)), int(rng.integers(0, 3))
        kinds = [GREEDY] * n_constrained + [SamplingParams()] * n_plain
        if penalised:
            kinds.append(SamplingParams(penalties=PenaltyParams(1.3, 0.4, 0.2)))
        self.params = {10 + i: p for i, p in enumerate(kinds)}
        self.prompts = {rid: rng.integers(1, self.vocab, int(rng.integers(2, 9))) for rid in self.params}
        self.tokens: dict[int, list[int]] = {rid: [] for rid in self.params}

    @property
    def constrained(self) -> list[int]:
        return [rid for rid, p in self.params.items() if p.constrained]

    def mask(self, rid: int) -> np.ndarray:
        prev = self.tokens[rid][-1] if self.tokens[rid] else int(self.prompts[rid][-1])
        return pack(grammar(self.seed, rid, prev, self.vocab), self.vocab)

    def masks(self, ids) -> dict[int, np.ndarray]:
        return {rid: self.mask(rid) for rid in ids}

    def first(self):
        chunks = [PrefillInput(rid, self.prompts[rid], p, True) for rid, p in self.params.items()]
        return self.engine.launch(chunks, masks=self.masks(self.constrained))

    def record(self, result) -> None:
        for out in result.outputs:
            assert not out.error, out
            if self.params[out.request_id].constrained:
                allowed = self.mask(out.request_id)
                assert allowed[out.token_id // 32] >> np.uint32(out.token_id % 32) & 1, out
            self.tokens[out.request_id].append(out.token_id)


def on_time(engine, stream: Stream, steps: int) -> dict[int, list[int]]:
    """Depth 1: each step's masks sent with it, once the step before is collected."""
    step = stream.first()
    for k in range(steps):
        stream.record(engine.collect(step))
        if k + 1 < steps:
            step = engine.launch(decode_ids=list(stream.params), masks=stream.masks(stream.constrained))
    engine.clear()
    return stream.tokens


def late(engine, stream: Stream, steps: int) -> dict[int, list[int]]:
    """Depth 2 as the step pump runs it: message k carries no masks of its own decodes (their input tokens are not
    back when it is built) and the late masks of step k-1, applied before step k launches; step k-1 is collected
    after (or before, when the engine cannot overlap them)."""
    step = stream.first()
    for _ in range(steps - 1):
        if step.late:
            engine.apply_late_masks(step, stream.masks(step.late), set())
        ahead = step
        if not engine.can_launch:
            stream.record(engine.collect(ahead))
            ahead = None
        step = engine.launch(decode_ids=list(stream.params))
        assert set(step.late) == set(stream.constrained)
        if ahead is not None:
            stream.record(engine.collect(ahead))
    engine.apply_late_masks(step, stream.masks(step.late), set())
    stream.record(engine.collect(step))
    engine.clear()
    return stream.tokens


@pytest.fixture(scope="module", params=[True, False], ids=["overlapped", "sequential"])
def engine(request, tiny_model):
    return cpu_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu", **CONFIG), overlap=request.param)


@pytest.mark.parametrize("seed", range(6))
def test_late_masks_give_the_tokens_on_time_masks_give(engine, seed):
    penalised = seed % 2 == 1
    want = on_time(engine, Stream(engine, seed, penalised), steps=8)
    assert late(engine, Stream(engine, seed, penalised), steps=8) == want


def _waiting(engine):
    """A step whose constrained decodes (sequences 10, 11) wait for late masks, beside a plain greedy one (12)."""
    vocab = engine.model_config.vocab_size
    chunks = [
        PrefillInput(10 + i, np.arange(3, 7 + i), p, True) for i, p in enumerate([GREEDY, GREEDY, SamplingParams()])
    ]
    engine.collect(engine.launch(chunks, masks={10: pack([5, 9], vocab), 11: pack([7], vocab)}))
    step = engine.launch(decode_ids=[10, 11, 12])
    assert step.late == {10: 0, 11: 1}
    return step


def test_a_step_waiting_for_late_masks_is_neither_collected_nor_followed(engine):
    step = _waiting(engine)
    assert not engine.can_launch and not engine.ready(step)
    with pytest.raises(RuntimeError, match="late masks"):
        engine.collect(step)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.launch(decode_ids=[12])
    vocab = engine.model_config.vocab_size
    engine.apply_late_masks(step, {10: pack([3], vocab), 11: pack([4, 200], vocab)}, set())
    assert engine.ready(step) and not step.late
    tokens = [o.token_id for o in engine.collect(step).outputs]
    assert tokens[0] == 3 and tokens[1] in (4, 200)
    engine.clear()


def test_wrong_late_masks_are_refused_naming_the_field_and_change_nothing(engine):
    vocab = engine.model_config.vocab_size
    step = _waiting(engine)
    good = {10: pack([3], vocab), 11: pack([4], vocab)}
    past = pack([3], vocab)
    past[-1] |= np.uint32(1) << np.uint32(31) if vocab % 32 else np.uint32(0)
    bad = [
        ({10: good[10]}, "sequence 11 is waiting"),
        ({**good, 12: pack([3], vocab)}, "sequence 12 has no row"),
        ({**good, 99: pack([3], vocab)}, "sequence 99 has no row"),
        ({**good, 11: good[11][:-1]}, "uint32 words"),
        ({**good, 11: good[11].astype(np.int64)}, "uint32 words"),
        ({**good, 11: np.zeros_like(good[11])}, "allows no token"),
    ]
    if vocab % 32:
        bad.append(({**good, 10: past}, "past the vocabulary"))
    for masks, why in bad:
        with pytest.raises(InvalidRequestError, match=why) as refused:
            engine.apply_late_masks(step, masks, set())
        assert str(refused.value).startswith("late_token_masks: ") and "\n" not in str(refused.value)
        assert step.late == {10: 0, 11: 1}
    engine.apply_late_masks(step, good, set())
    assert [o.token_id for o in engine.collect(step).outputs][:2] == [3, 4]
    engine.clear()


def test_a_sequence_freed_meanwhile_needs_no_late_mask(engine):
    vocab = engine.model_config.vocab_size
    step = _waiting(engine)
    engine.apply_late_masks(step, {10: pack([8], vocab)}, {11})
    outs = engine.collect(step).outputs
    assert outs[0].token_id == 8 and not outs[1].error  # 11 sampled unconstrained: the router drops its token
    engine.clear()


def test_late_masks_that_never_come_fail_those_rows_alone(engine):
    step = _waiting(engine)
    engine.fail_late_masks(step)
    outs = {o.request_id: o for o in engine.collect(step).outputs}
    assert outs[10].error == outs[11].error == MISSING_TOKEN_MASK
    assert not outs[12].error and outs[12].token_id is not None
    assert set(engine.sequences) == {12}
    engine.clear()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(constrained=True, temperature=1.0, seed=3),
        SamplingParams(constrained=True, logprobs=True),
        SamplingParams(constrained=True, penalties=PenaltyParams(1.2, 0.0, 0.0)),
        SamplingParams(constrained=True, logit_bias=((5, 1.0),)),
    ],
    ids=["sampled", "logprobs", "penalised", "biased"],
)
def test_only_plain_greedy_decodes_may_wait_for_their_masks(engine, params):
    vocab = engine.model_config.vocab_size
    engine.collect(engine.launch([PrefillInput(20, np.arange(3, 8), params, True)], masks={20: pack([6], vocab)}))
    with pytest.raises(InvalidRequestError, match="token_masks: sequence 20 is constrained"):
        engine.launch(decode_ids=[20])
    with pytest.raises(InvalidRequestError, match="token_masks: sequence 21 is constrained"):
        engine.launch([PrefillInput(21, np.arange(3, 8), GREEDY, True)])  # a prompt's first token is never late
    assert not engine._in_flight
    engine.clear()
