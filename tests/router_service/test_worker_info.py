"""worker_info: the scheduler limits, validation limits and prefix index the router derives from a worker's Info."""

from __future__ import annotations

import random

from common.pb import worker_pb2 as wpb
from router_service.config import RouterConfig
from router_service.generation_defaults import GenerationDefaults
from router_service.validation import ValidatedRequest
from router_service.worker_info import model_limits, prefix_index, scheduler_limits, sends_prefix_tokens


def info(**fields) -> wpb.InfoResponse:
    base = dict(
        model_name="m",
        family="mixtral",
        dtype="bfloat16",
        routing="exact",
        hf_config_json="{}",
        vocab_size=1000,
        max_position_embeddings=4096,
        kv_block_size=16,
        num_kv_blocks=64,
        eos_token_ids=[2],
        prefix_caching=True,
        caches_generated_blocks=True,
    )
    return wpb.InfoResponse(**(base | fields))


def test_scheduler_limits_take_the_smaller_cap_and_the_workers_pool():
    rng = random.Random()
    for _ in range(50):
        router_size, router_tokens = rng.randint(1, 512), rng.randint(1, 8192)
        worker_size, worker_tokens = rng.choice([0, rng.randint(1, 512)]), rng.choice([0, rng.randint(1, 8192)])
        blocks, block = rng.randint(1, 10_000), rng.choice([8, 16, 32])
        config = RouterConfig(max_batch_size=router_size, max_batch_tokens=router_tokens)
        got = scheduler_limits(
            config,
            info(
                max_batch_size=worker_size,
                max_batch_tokens=worker_tokens,
                kv_block_size=block,
                num_kv_blocks=blocks,
            ),
        )
        assert got.max_batch_size == min(router_size, worker_size or router_size)  # 0: the worker sets no cap
        assert got.max_batch_tokens == min(router_tokens, worker_tokens or router_tokens)
        assert (got.kv_block_size, got.num_kv_blocks) == (block, blocks)


def test_model_limits_merge_end_tokens_inside_the_vocabulary():
    defaults = GenerationDefaults(eos_token_ids=(7, 2, 5000))
    got = model_limits(info(eos_token_ids=[2, 3], kv_block_size=16, num_kv_blocks=10), defaults, has_tokenizer=False)
    assert got.eos_token_ids == (2, 3, 7)  # the worker's first, no repeats, 5000 is past the vocabulary
    assert got.kv_capacity_tokens == 160
    assert (got.vocab_size, got.max_sequence_length, got.has_tokenizer) == (1000, 4096, False)
    assert got.generation is defaults


def test_prefix_index_off_unless_both_sides_cache():
    assert prefix_index(RouterConfig(prefix_caching=False), info()) is None
    assert prefix_index(RouterConfig(), info(prefix_caching=False)) is None
    index = prefix_index(RouterConfig(), info(caches_generated_blocks=False))
    assert index is not None and index.block_size == 16 and not index.caches_generated
    assert prefix_index(RouterConfig(), info()).caches_generated


def test_prefix_index_hashes_depend_on_every_identity_field():
    """Two workers differing in any field that changes a block's KV never share a hash; a fresh index of the
    same worker hashes alike (the router's view after a reconnect starts empty but compatible)."""
    tokens = [random.randrange(1000) for _ in range(48)]
    same = prefix_index(RouterConfig(), info()).hashes(tokens)
    assert prefix_index(RouterConfig(), info()).hashes(tokens) == same and len(same) == 3
    for field, value in [
        ("model_name", "n"),
        ("family", "qwen3_moe"),
        ("dtype", "float32"),
        ("routing", "lut"),
        ("hf_config_json", '{"a": 1}'),
    ]:
        other = prefix_index(RouterConfig(), info(**{field: value})).hashes(tokens)
        assert not set(other) & set(same), field


def test_prefix_tokens_go_for_a_repetition_penalty_and_for_any_penalty_to_an_older_worker():
    """A repetition penalty counts the cached prefix's tokens, presence and frequency do not; a worker whose Info
    lacks prefix_tokens_for_repetition_only (older ones) refuses any penalised sequence on cached blocks without
    them, so it gets them for every penalty."""
    rng = random.Random()
    current, older = info(prefix_tokens_for_repetition_only=True), info()
    for _ in range(50):
        repetition = rng.choice([1.0, rng.uniform(0.1, 3.0)])
        presence, frequency = rng.choice([0.0, rng.uniform(-2, 2)]), rng.choice([0.0, rng.uniform(-2, 2)])
        req = ValidatedRequest(
            "", (1, 2, 3), 4, 0, 0.0, 0, 1.0, 7, (), (), False, False,
            repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
        )  # fmt: skip
        assert sends_prefix_tokens(req, current) == (repetition != 1.0)
        assert sends_prefix_tokens(req, older) == req.penalized
