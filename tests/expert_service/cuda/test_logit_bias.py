"""The cuda engine honours logit_bias as the cpu one does: a biased sequence is not plain greedy, so its logits
row is copied to the host and sampled there, while a plain greedy neighbour in the same steps keeps the
device's argmax (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

ENGINE = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
STEPS = 6


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """cpu, cuda (graphs) and cuda (eager) engines of one tiny model."""
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.tools.tiny_model import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("logit_bias") / "m", family="qwen3_moe", seed=5)
    return [
        build_engine(ModelDir.open(model), EngineConfig(backend=backend, cuda_graphs=graphs, **ENGINE))
        for backend, graphs in (("cpu", True), ("cuda", True), ("cuda", False))
    ]


def _run(engine, bias):
    """A biased sequence (0) and a plain greedy one (1) prefilled together, then decoded: tokens per sequence."""
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 259, n) for n in (9, 6)]
    sampling = [SamplingParams(logit_bias=bias), SamplingParams()]
    result = engine.step([PrefillInput(i, p, s, True) for i, (p, s) in enumerate(zip(prompts, sampling))])
    tokens: list[list[int]] = [[], []]
    for _ in range(STEPS):
        for i, out in enumerate(result.outputs):
            tokens[i].append(out.token_id)
        result = engine.step(decode_ids=[0, 1])
    engine.clear()
    assert engine.allocator.num_used_blocks == 0
    return tokens


@pytest.mark.gpu
def test_cuda_engine_honours_a_plus_100_bias_as_the_cpu_one_does(engines):
    cpu = engines[0]
    unbiased, plain = _run(cpu, ())
    chosen = next(t for t in range(3, 259) if t not in unbiased)
    for engine in engines:
        biased, neighbour = _run(engine, ((chosen, 100.0),))
        assert biased == [chosen] * STEPS, engine.config
        assert neighbour == plain, engine.config  # the greedy neighbour's device argmax is untouched


@pytest.mark.gpu
def test_cuda_engine_never_yields_a_token_biased_by_minus_100(engines):
    cpu, gpu, _ = engines
    unbiased, _ = _run(cpu, ())
    banned = unbiased[0]
    got_cpu, _ = _run(cpu, ((banned, -100.0),))
    got_gpu, _ = _run(gpu, ((banned, -100.0),))
    assert banned not in got_gpu and got_gpu == got_cpu
