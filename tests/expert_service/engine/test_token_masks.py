"""Grammar masks on the worker: packing against a plain reference, the engine's checks (a constrained sequence
needs a mask in each step that samples it, nothing else may have one), and the cpu engine honouring masks for
greedy, sampled, penalised and logprob-scoring sequences, an unconstrained neighbour unchanged."""

import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.pb import worker_pb2 as pb
from expert_service.engine.engine import PrefillInput
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from expert_service.engine.token_masks import allowed, apply_masks_reference, check_masks, mask_words
from expert_service.serving import wire
from expert_service.serving.step_stream import StepLimits


def pack(allowed_ids, vocab: int) -> np.ndarray:
    """A mask by the definition: bit i of word j allows token 32 j + i."""
    words = np.zeros(mask_words(vocab), np.uint32)
    for t in allowed_ids:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 259, 4096])
def test_allowed_unpacks_every_bit(vocab):
    rng = np.random.default_rng(vocab)
    ids = sorted(set(rng.integers(0, vocab, max(1, vocab // 3)).tolist()))
    got = allowed(pack(ids, vocab), vocab)
    assert got.shape == (vocab,) and np.flatnonzero(got).tolist() == ids


def test_apply_masks_sets_every_disallowed_logit_to_minus_inf():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 70)).astype(np.float32)
    keep = [[0, 69], [33], list(range(70))]
    out = apply_masks_reference(logits, np.stack([pack(k, 70) for k in keep]))
    for row, ids in enumerate(keep):
        want = np.full(70, -np.inf, np.float32)
        want[ids] = logits[row, ids]
        np.testing.assert_array_equal(out[row], want)


def test_check_masks_refuses_an_empty_mask_and_bits_past_the_vocabulary():
    check_masks(pack([3], 40)[None], 40, [7])
    with pytest.raises(InvalidRequestError, match="sequence 7: the mask allows no token"):
        check_masks(np.zeros((1, 2), np.uint32), 40, [7])
    over = pack([3], 40)
    over[1] |= np.uint32(1 << 9)  # token 41
    with pytest.raises(InvalidRequestError, match="past the vocabulary"):
        check_masks(over[None], 40, [8])
    with pytest.raises(InvalidRequestError, match=r"\[sequences, 2\]"):
        check_masks(np.zeros((1, 3), np.uint32), 40, [8])


def test_the_wire_reads_packed_masks_and_refuses_a_wrong_size():
    limits = StepLimits((0,), 16, 8, vocab_size=40)
    masks = np.stack([pack([1, 39], 40), pack([5], 40)])
    request = pb.StepStreamRequest(
        mask_request_ids=np.array([4, 9], "<u8").tobytes(), token_masks=masks.astype("<u4").tobytes()
    )
    got = wire.token_masks(request.mask_request_ids, request.token_masks, limits)
    assert sorted(got) == [4, 9] and (got[9] == masks[1]).all()
    request.token_masks = request.token_masks[:-1]
    with pytest.raises(InvalidRequestError, match="token_masks"):
        wire.token_masks(request.mask_request_ids, request.token_masks, limits)
    assert wire.token_masks(b"", b"", limits) is None
    assert wire.sampling_params(pb.SamplingParams(constrained=True)).constrained


def test_unary_calls_refuse_a_constrained_sequence():
    chunk = pb.PrefillChunk(request_id=1, token_ids=[3], is_last=True, sampling=pb.SamplingParams(constrained=True))
    with pytest.raises(InvalidRequestError, match="step stream only"):
        wire.unary_step_request(pb.PrefillRequest(chunks=[chunk]), StepLimits((0,), 16, 8, 40))


@pytest.fixture(scope="module")
def engine(tiny_model):
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    return build_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu"))


PROMPTS = ([5, 6, 7, 8], [9, 10, 11])


def run(engine, params, allowed_sets, steps=5):
    """Sequence 0 constrained to allowed_sets[step] each step (params), sequence 1 plain greedy beside it."""
    vocab = engine.model_config.vocab_size

    def masks(step):
        return {0: pack(allowed_sets[step], vocab)} if params.constrained else None

    out = engine.launch(
        [
            PrefillInput(0, np.array(PROMPTS[0]), params, True),
            PrefillInput(1, np.array(PROMPTS[1]), SamplingParams(), True),
        ],
        masks=masks(0),
    )
    got: list[list] = [[], []]
    try:
        for step in range(steps):
            result = engine.collect(out)
            for i, o in enumerate(result.outputs):
                assert not o.error, o
                got[i].append((o.token_id, o.logprob, o.top))
            if step + 1 < steps:
                out = engine.launch(decode_ids=[0, 1], masks=masks(step + 1))
    finally:
        engine.clear()
    return got


ALLOWED = [[3, 40, 77], [12], [100, 101, 102, 103], [5, 250], list(range(0, 259, 2))]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(temperature=0.7, top_k=2, seed=5),
        SamplingParams(penalties=PenaltyParams(1.3, 0.5, 0.5)),
        SamplingParams(logit_bias=((12, -100.0), (3, 100.0))),
    ],
    ids=["greedy", "sampled", "top_k", "penalised", "biased"],
)
def test_every_token_of_a_constrained_sequence_is_allowed(engine, params):
    params = SamplingParams(**{**{f: getattr(params, f) for f in params.__slots__}, "constrained": True})
    plain = run(engine, SamplingParams(), [list(range(259))] * 5)[1]
    got = run(engine, params, ALLOWED)
    for step, (token, _, _) in enumerate(got[0]):
        assert token in ALLOWED[step]
    assert [t for t, _, _ in got[1]] == [t for t, _, _ in plain]  # the neighbour is untouched


def test_greedy_constrained_takes_the_best_allowed_token_and_logprobs_are_constrained(engine):
    vocab = engine.model_config.vocab_size
    params = SamplingParams(constrained=True, logprobs=True, top_logprobs=5)
    free = engine.launch([PrefillInput(0, np.array(PROMPTS[0]), params, True)], masks={0: pack(range(vocab), vocab)})
    raw = engine.collect(free).logits[0].copy()
    engine.clear()
    got = run(engine, params, ALLOWED, steps=1)[0][0]
    token, logprob, top = got
    keep = ALLOWED[0]
    assert token == keep[int(np.argmax(raw[keep]))]
    want = raw[keep] - np.log(np.exp(raw[keep] - raw[keep].max()).sum()) - raw[keep].max()
    assert logprob == pytest.approx(float(want[keep.index(token)]), abs=1e-5)
    assert sorted(top.top_ids[0].tolist()) == sorted(keep)  # only the 3 allowed, none at -inf
    assert np.isfinite(top.top_logprobs).all()


def test_a_constrained_sequence_without_its_mask_or_a_stray_mask_refuses_the_step(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="sequence 0 is constrained"):
        engine.launch([PrefillInput(0, np.array(PROMPTS[0]), SamplingParams(constrained=True), True)])
    assert not engine.sequences
    with pytest.raises(InvalidRequestError, match="sequence 1 is no constrained"):
        engine.launch([PrefillInput(1, np.array(PROMPTS[1]), SamplingParams(), True)], masks={1: pack([3], vocab)})
    with pytest.raises(InvalidRequestError, match="allows no token"):
        engine.launch(
            [PrefillInput(0, np.array(PROMPTS[0]), SamplingParams(constrained=True), True)],
            masks={0: np.zeros(mask_words(vocab), np.uint32)},
        )
    assert not engine.sequences and engine.allocator.num_used_blocks == 0
