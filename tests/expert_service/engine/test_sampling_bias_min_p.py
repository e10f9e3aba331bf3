"""logit_bias and min_p on the worker: the sampler's filter against a numpy reference, and the cpu engine
honouring a bias end to end (the bias is not plain greedy: the backend's argmax would ignore it)."""

import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.pb import worker_pb2 as pb
from expert_service.engine.sampling import Sampler, SamplingParams, filter_logits
from expert_service.serving import wire


def min_p_reference(logits: np.ndarray, min_p: float) -> np.ndarray:
    """vLLM's definition, through probabilities: drop p_i < min_p * max p."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    return np.where(probs < min_p * probs.max(), -np.inf, logits)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 0.9, 1.0])
def test_min_p_filter_equals_the_probability_reference(min_p):
    logits = np.random.default_rng(int(min_p * 100)).standard_normal(300) * 3
    got = filter_logits(logits, top_k=0, top_p=1.0, min_p=min_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(min_p_reference(logits, min_p)))
    assert 0 < np.isfinite(got).sum() < logits.size or min_p == 0.01


def test_min_p_applies_with_top_k_and_top_p():
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = np.log(probs)
    kept = np.isfinite(filter_logits(logits, top_k=4, top_p=0.95, min_p=0.3))
    assert kept.tolist() == [True, True, True, False, False]  # min_p keeps >= 0.12, top-k drops the last


def test_min_p_never_emits_filtered_tokens():
    probs = np.array([0.5, 0.3, 0.12, 0.08])
    tokens = [Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=s)).sample(np.log(probs)) for s in range(400)]
    assert set(tokens) == {0, 1, 2}  # 0.08 < 0.2 * 0.5


def test_min_p_one_at_temperature_one_is_greedy():
    logits = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=7))
    assert [sampler.sample(logits) for _ in range(50)] == [int(np.argmax(logits))] * 50


def test_bias_is_added_before_greedy_and_makes_the_sequence_sample_on_the_host():
    logits = np.array([0.0, 5.0, 1.0], dtype=np.float32)
    params = SamplingParams(logit_bias=((2, 4.5),))
    sampler = Sampler(params)
    assert not sampler.plain_greedy  # the backend's argmax (token 1) would be wrong
    assert sampler.sample(logits) == 2
    assert Sampler(SamplingParams(logit_bias=((1, -100.0),))).sample(logits) == 2


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(logit_bias=((3, 101.0),)), "logit_bias[3]"),
        (dict(logit_bias=((4, float("nan")),)), "logit_bias[4]"),
        (dict(logit_bias=tuple((i, 1.0) for i in range(301))), "logit_bias"),
    ],
)
def test_invalid_min_p_and_bias_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_bias_ids_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias=((9, 1.0),)).check_vocabulary(10)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=((10, 1.0),)).check_vocabulary(10)
    assert e.value.field == "logit_bias[10]"


def test_wire_carries_min_p_and_the_bias():
    message = pb.SamplingParams(min_p=0.25, logit_bias={7: -3.5, 2: 100.0})
    params = wire.sampling_params(message)
    assert params.min_p == 0.25 and params.logit_bias == ((2, 100.0), (7, -3.5))
    with pytest.raises(InvalidRequestError) as e:
        wire.sampling_params(pb.SamplingParams(logit_bias={5: 200.0}))
    assert e.value.field == "logit_bias[5]"


@pytest.fixture(scope="module")
def engine(tiny_model):
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    return build_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu"))


PROMPT = [5, 6, 7, 8]


def test_engine_greedy_with_a_plus_100_bias_always_yields_that_token(engine):
    greedy, _, _ = engine.generate(PROMPT, 6)
    chosen = next(t for t in range(3, 50) if t not in greedy)
    tokens, _, _ = engine.generate(PROMPT, 6, SamplingParams(logit_bias=((chosen, 100.0),)))
    assert tokens == [chosen] * 6


def test_engine_greedy_with_a_minus_100_bias_never_yields_the_greedy_token(engine):
    greedy, _, _ = engine.generate(PROMPT, 6)
    banned = greedy[0]
    tokens, _, _ = engine.generate(PROMPT, 6, SamplingParams(logit_bias=((banned, -100.0),)))
    assert banned not in tokens and tokens[0] != greedy[0]


def test_engine_min_p_one_at_temperature_one_equals_greedy(engine):
    greedy, _, _ = engine.generate(PROMPT, 6)
    tokens, _, _ = engine.generate(PROMPT, 6, SamplingParams(temperature=1.0, min_p=1.0, seed=3))
    assert tokens == greedy


def test_engine_log_probabilities_stay_those_of_the_raw_logits(engine):
    plain = SamplingParams(logprobs=True)
    greedy, raw_logprobs, _ = engine.generate(PROMPT, 1, plain)
    _, biased_logprobs, _ = engine.generate(PROMPT, 1, SamplingParams(logprobs=True, logit_bias=((greedy[0], 50.0),)))
    assert biased_logprobs == pytest.approx(raw_logprobs)


def test_the_worker_wire_refuses_an_oversized_bias_map_before_copying_it():
    from common.pb import worker_pb2
    from expert_service.engine.sampling import MAX_LOGIT_BIAS_ENTRIES
    from expert_service.serving import wire

    message = worker_pb2.SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})
    with pytest.raises(InvalidRequestError) as e:
        wire.sampling_params(message)
    assert e.value.field == "logit_bias"
