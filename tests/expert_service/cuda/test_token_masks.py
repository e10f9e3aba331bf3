"""The cuda engine (graphs and eager) honours grammar masks as the cpu engine does: greedy and sampled constrained
sequences take only allowed tokens (the device argmax of the masked rows, graph replay untouched), penalised ones
too, log-probabilities of the constrained distribution, and a plain greedy neighbour keeps its tokens (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

ENGINE = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
STEPS = 6


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.tools.tiny_model import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("token_masks") / "m", family="qwen3_moe", seed=5)
    engines = [
        build_engine(ModelDir.open(model), EngineConfig(backend=backend, cuda_graphs=graphs, **ENGINE))
        for backend, graphs in (("cpu", True), ("cuda", True), ("cuda", False))
    ]
    for engine in engines:
        engine.warmup()
    return engines


def _mask(allowed, vocab):
    words = np.zeros(-(-vocab // 32), np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words


def _run(engine, params):
    """Constrained sequences (one per params) beside a plain greedy one (last): tokens and logprobs per sequence."""
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(3)
    allowed = [sorted(rng.choice(np.arange(3, 259), 5, replace=False).tolist()) for _ in range(STEPS)]
    n = len(params)
    prompts = [rng.integers(3, 259, 5 + i) for i in range(n + 1)]
    inputs = [PrefillInput(i, p, s, True) for i, (p, s) in enumerate(zip(prompts, [*params, SamplingParams()]))]
    launched = engine.launch(inputs, masks={i: _mask(allowed[0], vocab) for i in range(n)})
    got: list[list] = [[] for _ in range(n + 1)]
    for step in range(STEPS):
        result = engine.collect(launched)
        for i, out in enumerate(result.outputs):
            assert not out.error
            got[i].append((out.token_id, round(out.logprob, 3)))
            if i < n:
                assert out.token_id in allowed[step], (engine.config, step)
        if step + 1 < STEPS:
            launched = engine.launch(
                decode_ids=list(range(n + 1)), masks={i: _mask(allowed[step + 1], vocab) for i in range(n)}
            )
    engine.clear()
    return got


@pytest.mark.gpu
def test_cuda_engine_honours_masks_as_the_cpu_one_does(engines):
    from expert_service.engine.penalties import PenaltyParams
    from expert_service.engine.sampling import SamplingParams

    params = [
        SamplingParams(constrained=True, logprobs=True),
        SamplingParams(constrained=True, temperature=1.0, seed=9),
        SamplingParams(constrained=True, penalties=PenaltyParams(1.4, 0.3, 0.3)),
    ]
    want = _run(engines[0], params)
    for engine in engines[1:]:
        got = _run(engine, params)
        assert [[t for t, _ in seq] for seq in got] == [[t for t, _ in seq] for seq in want], engine.config
        for g, w in zip(got[0], want[0]):
            assert g[1] == pytest.approx(w[1], abs=0.02)  # constrained logprobs, bf16-close
