import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.pb import worker_pb2 as pb
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import Sampler, SamplingParams, filter_logits
from expert_service.serving import wire


def draw(params, logits, n):
    sampler = Sampler(params)
    return [sampler.sample(logits) for _ in range(n)]


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    assert draw(SamplingParams(), logits, 3) == [int(np.argmax(logits))] * 3


def test_top_k_never_emits_excluded_tokens():
    logits = np.random.default_rng(1).standard_normal(40).astype(np.float32)
    allowed = set(np.argsort(-logits)[:5].tolist())
    tokens = draw(SamplingParams(temperature=1.5, top_k=5, seed=3), logits, 2000)
    assert set(tokens) <= allowed and len(set(tokens)) == 5


def test_top_k_with_ties_keeps_exactly_k():
    out = filter_logits(np.zeros(10, dtype=np.float32), top_k=3, top_p=1.0)
    assert np.isfinite(out).sum() == 3


def test_top_p_never_emits_outside_nucleus():
    probs = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = np.log(probs).astype(np.float32)
    tokens = draw(SamplingParams(temperature=1.0, top_p=0.85, seed=5), logits, 3000)
    assert set(tokens) == {0, 1, 2}  # 0.5 + 0.3 < 0.85, so token 2 completes the nucleus
    freq = np.bincount(tokens, minlength=5)[:3] / len(tokens)
    np.testing.assert_allclose(freq, probs[:3] / probs[:3].sum(), atol=0.03)


def test_temperature_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.25, 0.15])
    tokens = draw(SamplingParams(temperature=1.0, seed=11), np.log(probs).astype(np.float32), 5000)
    np.testing.assert_allclose(np.bincount(tokens, minlength=3) / 5000, probs, atol=0.03)


def test_same_seed_same_tokens_different_seed_differs():
    logits = np.random.default_rng(2).standard_normal(100).astype(np.float32)
    a = draw(SamplingParams(temperature=1.0, seed=42), logits, 50)
    assert a == draw(SamplingParams(temperature=1.0, seed=42), logits, 50)
    assert a != draw(SamplingParams(temperature=1.0, seed=43), logits, 50)


def test_min_new_tokens_suppresses_stop_ids():
    logits = np.array([0.0, 10.0, 0.0], dtype=np.float32)  # token 1 (EOS) is overwhelmingly likely
    sampler = Sampler(SamplingParams(stop_token_ids=(1,), min_new_tokens=2))
    assert [sampler.sample(logits) for _ in range(3)] == [0, 0, 1]


def test_non_finite_logits_fail_instead_of_emitting_a_token():
    logits = np.array([0.0, np.nan, 1.0], dtype=np.float32)
    assert Sampler(SamplingParams()).sample(logits) is None


def test_the_token_comes_from_the_processed_row_and_finiteness_from_the_raw_one():
    raw = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    processed = np.array([1.0, 2.5, -3.0], dtype=np.float32)  # a penalty pushed token 2 down
    assert Sampler(SamplingParams()).sample(raw, processed) == 1
    assert Sampler(SamplingParams()).sample(raw) == 2
    assert Sampler(SamplingParams()).sample(np.array([np.inf, 0, 0], np.float32), processed) is None


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(penalties=PenaltyParams(0.5)), None),
    ],
)
def test_invalid_parameters_name_the_field(kwargs, field):
    if field is None:  # valid: a control that the others fail for their field alone
        SamplingParams(**kwargs)
        return
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_wire_reads_top_p_zero_as_off_and_checks_the_rest():
    params = wire.sampling_params(
        pb.SamplingParams(temperature=0.5, top_k=4, seed=9, stop_token_ids=[2, 3], min_new_tokens=1, logprobs=True)
    )
    assert params == SamplingParams(0.5, 4, 1.0, 9, (2, 3), 1, True)
    with pytest.raises(InvalidRequestError) as e:
        wire.sampling_params(pb.SamplingParams(top_p=1.5))
    assert e.value.field == "top_p"


def test_wire_reads_logprobs_and_penalties_unset_as_off():
    params = wire.sampling_params(
        pb.SamplingParams(
            logprobs=True,
            top_logprobs=5,
            prompt_logprobs=0,
            repetition_penalty=1.2,
            presence_penalty=-0.5,
            frequency_penalty=2.0,
        )
    )
    assert (params.top_logprobs, params.prompt_logprobs) == (5, 0)
    penalties = params.penalties
    assert (penalties.repetition, penalties.presence, penalties.frequency) == (pytest.approx(1.2), -0.5, 2.0)
    plain = wire.sampling_params(pb.SamplingParams())
    assert plain.prompt_logprobs is None and not plain.penalties.active
    for message, field in (
        (pb.SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (pb.SamplingParams(frequency_penalty=3.0), "frequency_penalty"),
        (pb.SamplingParams(prompt_logprobs=30), "prompt_logprobs"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            wire.sampling_params(message)
        assert e.value.field == field


def test_offline_generation_fails_with_its_own_error_on_non_finite_logits(tiny_model, monkeypatch):
    from common.errors import NonFiniteLogitsError
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.step import HostLogits

    engine = build_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu"))
    original = engine.decoder.forward
    monkeypatch.setattr(
        engine.decoder, "forward", lambda *a, **k: HostLogits(np.full_like(np.stack(list(original(*a, **k))), np.nan))
    )
    with pytest.raises(NonFiniteLogitsError, match="non-finite"):
        engine.generate([5, 6, 7], 4)
    assert engine.allocator.num_used_blocks == 0 and not engine.sequences


def test_a_negative_seed_is_an_invalid_request():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(temperature=1.0, seed=-1)
    assert str(e.value) == "seed: must be >= 0, got -1"
