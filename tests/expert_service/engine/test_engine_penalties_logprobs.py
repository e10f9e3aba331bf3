"""The engine's penalties and log-probabilities against transformers on tiny random checkpoints (cpu backend):
greedy decoding with repetition_penalty equals transformers' generate (its RepetitionPenaltyLogitsProcessor),
presence/frequency equal a numpy reference applied to transformers' logits, and top-n / prompt log-probabilities
equal torch.log_softmax of transformers' logits -- with prompts split into chunks across steps and an
unpenalised sequence sharing every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from tests.hf_reference import CASES, hf_logits, make_hf_model, save_and_convert

VOCAB = 211
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=["mixtral-gqa-k2", "qwen3_moe-k4"])
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    hf = make_hf_model(family, overrides, seed=7)
    model_dir = save_and_convert(hf, tmp_path_factory.mktemp(request.param))
    engine = build_engine(
        ModelDir.open(model_dir), EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=2048, max_batch_size=8)
    )
    return request.param, hf, engine


def run(engine, prompt, sampling, chunk=5, companion=None):
    """Prefills `prompt` in chunks of `chunk` (a greedy companion sequence prefilled in the first step and decoded
    in every later one), then decodes; returns the outputs of the sequence's token-bearing steps and its prompt
    scores, chunk by chunk."""
    companion = companion if companion is not None else [5, 9, 11]
    outputs, prompt_scores = [], []
    steps = [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)]
    for i, part in enumerate(steps):
        prefill = [PrefillInput(1, np.array(part), sampling if i == 0 else None, i == len(steps) - 1)]
        if i == 0:
            prefill.append(PrefillInput(2, np.array(companion), SamplingParams(), True))
        result = engine.step(prefill, decode_ids=[2] if i else [])
        out = result.outputs[0]
        prompt_scores.append(out.prompt)
    outputs.append(out)
    while len(outputs) < NEW_TOKENS:
        outputs.append(engine.step(decode_ids=[1, 2]).outputs[0])
    engine.clear()
    assert engine.allocator.num_used_blocks == 0 and not engine.penalty_slots.slots
    return outputs, prompt_scores


def prompt_of(seed, n=13):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def test_repetition_penalty_greedy_equals_transformers_generate(case):
    name, hf, engine = case
    for penalty in (1.5, 0.7):
        prompt = prompt_of(int(penalty * 10))
        outputs, _ = run(engine, prompt, SamplingParams(penalties=PenaltyParams(repetition=penalty)))
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                min_new_tokens=NEW_TOKENS,
                repetition_penalty=penalty,
                pad_token_id=0,
            )
        assert [o.token_id for o in outputs] == want[0, len(prompt) :].tolist(), (name, penalty)
        unpenalised, _ = run(engine, prompt, SamplingParams())
        assert [o.token_id for o in unpenalised] != [o.token_id for o in outputs], "the penalty changed nothing"


def _reference_step(hf, ids, prompt_len, params: PenaltyParams) -> np.ndarray:
    """transformers' logits at the last position, repetition via its processor, presence/frequency as OpenAI
    defines them over the output tokens."""
    logits = torch.tensor(hf_logits(hf, ids)[-1:])
    if params.repetition != 1:
        logits = RepetitionPenaltyLogitsProcessor(params.repetition)(torch.tensor([ids]), logits)
    out = logits[0].double().numpy()
    tokens, counts = np.unique(np.array(ids[prompt_len:], np.int64), return_counts=True)
    out[tokens] -= counts * params.frequency + params.presence
    return out


def test_presence_and_frequency_greedy_equal_the_reference(case):
    name, hf, engine = case
    params = PenaltyParams(repetition=1.2, presence=0.8, frequency=1.5)
    prompt = prompt_of(3)
    outputs, _ = run(engine, prompt, SamplingParams(penalties=params))
    ids = list(prompt)
    for out in outputs:
        ref = _reference_step(hf, ids, len(prompt), params)
        assert out.token_id == int(np.argmax(ref)), name
        ids.append(out.token_id)
    assert len(set(ids[len(prompt) :])) > 3, "frequency penalties should keep the output from looping"


def test_top_and_prompt_logprobs_equal_log_softmax(case):
    name, hf, engine = case
    prompt = prompt_of(4, 12)
    sampling = SamplingParams(
        logprobs=True, top_logprobs=5, prompt_logprobs=3, penalties=PenaltyParams(repetition=1.3, frequency=0.5)
    )
    outputs, prompt_scores = run(engine, prompt, sampling, chunk=5)
    ids = prompt + [o.token_id for o in outputs]
    ref = torch.log_softmax(torch.tensor(hf_logits(hf, ids), dtype=torch.float64), dim=-1).numpy()
    for i, out in enumerate(outputs):  # raw distribution: penalties do not change the numbers
        position = len(prompt) - 1 + i
        assert out.logprob == pytest.approx(ref[position, out.token_id], abs=2e-4), name
        top = np.argsort(-ref[position], kind="stable")[:5]
        assert out.top.top_ids[0].tolist() == top.tolist(), name
        np.testing.assert_allclose(out.top.top_logprobs[0], ref[position, top], atol=2e-4)
    assert [len(s) for s in prompt_scores] == [5, 5, 2]
    scores = np.concatenate([s.logprobs for s in prompt_scores])
    top_ids = np.concatenate([s.top_ids for s in prompt_scores])
    assert np.isnan(scores[0]) and (top_ids[0] == -1).all()
    np.testing.assert_allclose(scores[1:], ref[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
    for j in range(1, len(prompt)):
        assert top_ids[j].tolist() == np.argsort(-ref[j - 1], kind="stable")[:3].tolist(), (name, j)


def test_a_step_scoring_too_many_prompt_tokens_is_refused_and_starts_nothing(case):
    _, _, engine = case
    from common.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        engine.step([PrefillInput(1, np.arange(9), SamplingParams(prompt_logprobs=1), True)])
    assert e.value.field == "prompt_logprobs" and not engine.sequences
    assert engine.step([PrefillInput(1, np.arange(8), SamplingParams(prompt_logprobs=1), True)]).outputs[0].prompt
    engine.clear()
