"""Greedy decoding through the expert cache equals the resident engine bit for bit on the cpu backend, on random
traffic drawn from a fresh seed each run (printed on failure): prompts arriving over several steps beside the
decodes of earlier ones, every slot count below the experts, both policies, every prefetch mode, the plan read from
the model directory's own routing table; three families and int8 experts. Each step's counters add up against the
experts the step routed to."""

import random

import numpy as np
import pytest

from common.model_format import ModelDir
from common.routing_table import TABLE_FILE, model_digest, write_routing_table
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.sampling import SamplingParams
from expert_service.engine.step import PrefillInput
from expert_service.tools.tiny_model import make_tiny

SEED = random.SystemRandom().randrange(1 << 32)
MODELS = [("mixtral", None), ("qwen3_moe", None), ("qwen2_moe", None), ("mixtral", "int8")]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-{m[1] or 'f32'}")
def model(request, tmp_path_factory):
    family, expert_dtype = request.param
    path = make_tiny(tmp_path_factory.mktemp(family) / "m", family=family, seed=3, expert_dtype=expert_dtype)
    cfg = ModelDir.open(path).config
    # a random table, one expert wider than the top-k: the plan prefetch predicts more than a token uses
    scores = np.random.default_rng(SEED).random((len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts))
    width = min(cfg.num_experts_per_tok + 1, cfg.num_experts)
    table = np.argsort(scores, axis=2)[:, :, :width].astype(np.uint16)
    write_routing_table(path / TABLE_FILE, table, cfg.num_experts, model_digest(path))
    return ModelDir.open(path)


def traffic(rng: random.Random) -> list[list[tuple[int, list[int]]]]:
    """Per step, the prompts that arrive (request id, tokens); every earlier one decodes beside them."""
    steps, rid = [], 0
    for _ in range(rng.randint(3, 7)):
        arrivals = []
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            arrivals.append((rid, [rng.randrange(3, 250) for _ in range(rng.randint(1, 13))]))
            rid += 1
        steps.append(arrivals)
    steps[0] = steps[0] or [(rid, [rng.randrange(3, 250)])]
    return steps


def run(model: ModelDir, steps, **cache):
    engine = build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024, **cache))
    live, tokens, logits, stats = [], [], [], []
    try:
        for arrivals in steps:
            prefill = [PrefillInput(rid, np.asarray(p), SamplingParams(), True) for rid, p in arrivals]
            result = engine.step(prefill=prefill, decode_ids=list(live))
            live += [rid for rid, _ in arrivals]
            tokens.append([(o.request_id, o.token_id, o.error) for o in result.outputs])
            logits.append(np.asarray(result.logits.array))
            routed = sum(len(np.unique(ids)) for ids in result.trace.expert_ids.values())
            stats.append((result.expert_cache, routed))
    finally:
        engine.close()
    return tokens, logits, stats, engine


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("prefetch", ["none", "plan", "lookahead", "plan,lookahead"])
def test_greedy_through_the_cache_equals_resident_experts_bitwise(model, policy, prefetch):
    case = f"seed {SEED}, {policy}, prefetch {prefetch}"
    rng = random.Random(f"{SEED}-{policy}-{prefetch}")
    for _ in range(2):
        steps = traffic(rng)
        slots = rng.randint(1, model.config.num_experts - 1)
        ref_tokens, ref_logits, _, _ = run(model, steps)
        tokens, logits, stats, engine = run(
            model, steps, expert_cache_slots=slots, expert_cache_policy=policy, prefetch=prefetch
        )
        where = f"{case}, {slots} slots, steps {steps}"
        assert tokens == ref_tokens, where
        assert all(np.array_equal(a, b) for a, b in zip(logits, ref_logits)), where
        assert (engine.decoder.plan_lookup is not None) == ("plan" in prefetch)
        for step_stats, routed in stats:
            assert step_stats.hits + step_stats.misses == routed, where
        if prefetch == "none":
            assert all(s.prefetches_issued == 0 for s, _ in stats), where
