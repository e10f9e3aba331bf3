"""Each family against Hugging Face transformers on tiny random fp32 checkpoints."""

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from tests.helpers import rel_error
from tests.hf_reference import CASES, hf_greedy, hf_logits, make_hf_model, save_and_convert

TOLERANCE = 1e-4
VOCAB = 211
WORST: dict[str, float] = {}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    hf = make_hf_model(family, overrides, seed=sorted(CASES).index(request.param))
    model_dir = save_and_convert(hf, tmp_path_factory.mktemp(request.param))
    engine = build_engine(ModelDir.open(model_dir), EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=2048))
    return request.param, hf, engine


def check(name: str, ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    err = rel_error(ours, ref)
    WORST[name] = max(WORST.get(name, 0.0), err)
    assert err <= TOLERANCE, f"{name}: {what}: relative error {err:.2e} > {TOLERANCE}"


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def test_prefill_logits_every_position(case):
    name, hf, engine = case
    for n in (1, 7, 23):
        ids = prompt(n, n)
        check(name, engine.prompt_logits(ids), hf_logits(hf, ids), f"prefill of {n} tokens")
    assert engine.allocator.num_used_blocks == 0


def test_greedy_generation_identical(case):
    name, hf, engine = case
    ids = prompt(2, 9)
    ours, _, _ = engine.generate(ids, max_new_tokens=16)
    assert ours == hf_greedy(hf, ids, 16), name


def test_chunked_prefill_and_decode_match_full_recompute(case):
    """Two prompt chunks, then token-by-token decode through the KV cache: logits at every step equal
    HF's single full forward over the same tokens."""
    name, hf, engine = case
    ids = prompt(3, 10)
    step = engine.step([PrefillInput(7, np.array(ids[:6]), SamplingParams(), False)])
    assert step.outputs[0].token_id is None
    step = engine.step([PrefillInput(7, np.array(ids[6:]), None, True)])
    logits, generated = [step.logits[0]], [step.outputs[0].token_id]
    for _ in range(8):
        step = engine.step(decode_ids=[7])
        logits.append(step.logits[0])
        generated.append(step.outputs[0].token_id)
    engine.release([7])
    ref = hf_logits(hf, ids + generated[:-1])[len(ids) - 1 :]
    check(name, np.stack(logits), ref, "chunked prefill + cached decode")
    assert engine.allocator.num_used_blocks == 0


def test_batch_of_different_lengths_equals_each_alone(case):
    name, hf, engine = case
    prompts = [prompt(10 + i, n) for i, n in enumerate((1, 5, 13, 8))]
    alone = [engine.generate(p, max_new_tokens=6)[0] for p in prompts]
    first = engine.step([PrefillInput(100 + i, np.array(p), SamplingParams(), True) for i, p in enumerate(prompts)])
    together = [[o.token_id] for o in first.outputs]
    batch_logits = [[row] for row in first.logits]
    for _ in range(5):
        step = engine.step(decode_ids=[100 + i for i in range(len(prompts))])
        for i, o in enumerate(step.outputs):
            together[i].append(o.token_id)
            batch_logits[i].append(step.logits[i])
    engine.clear()
    assert together == alone, name
    for p, toks, rows in zip(prompts, together, batch_logits):
        check(name, np.stack(rows), hf_logits(hf, p + toks[:-1])[len(p) - 1 :], "batched decode")


def test_report_worst_error():
    """Prints the worst relative error per case (collected above); run with -s to see it."""
    for name, err in sorted(WORST.items()):
        print(f"parity {name}: max relative error {err:.2e}")
