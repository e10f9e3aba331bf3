"""ModelInfo's expert counts from the model's config.json: a key written null is absent, so Qwen3-MoE's
`"num_experts": null` beside transformers 5's `num_local_experts` is read from the latter, never reported as 0."""

from __future__ import annotations

import random

from router_service.servicer import config_count


def test_a_null_expert_count_falls_to_the_other_spelling_not_to_zero():
    rng = random.Random()
    for _ in range(20):
        n, k = rng.randrange(1, 65536), rng.randrange(1, 64)
        assert config_count({"num_experts": None, "num_local_experts": n}, "num_experts", "num_local_experts") == n
        assert config_count({"num_local_experts": n}, "num_experts", "num_local_experts") == n
        assert config_count({"num_experts": n, "num_local_experts": None}, "num_experts", "num_local_experts") == n
        assert config_count({"num_experts_per_tok": k}, "num_experts_per_tok") == k
    for hf in ({}, {"num_experts": None}, {"num_experts": "8"}, {"num_experts": True}, {"num_experts": 2.5}):
        assert config_count(hf, "num_experts", "num_local_experts") == 0  # what a client reads as "not given"
