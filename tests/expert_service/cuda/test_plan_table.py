"""The plan prefetch looked up on the device (GPU only): a model whose routing depends only on the token id, with
its exact routing table in the model directory, so every plan predicts exactly what the step routes to. The
cached engine gets no plan from the host; each pass looks its own input tokens up (kernels/table_hints.py),
including decodes fed from the step before's argmax while that step was still in flight (launched before the
step ahead was collected: the case a router's plan, made from the last token it knows, gets wrong)."""

import numpy as np
import pytest

from common.model_format import ModelDir
from common.routing_table import TABLE_FILE, model_digest, write_routing_table
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.experts.cache import CacheStats
from tests.helpers import exact_token_table, make_token_routed_model

pytestmark = pytest.mark.gpu

PROMPT = np.array([5, 17, 42, 99, 3, 250, 7, 31, 64], np.int64)
DECODES = 6


@pytest.fixture(scope="module")
def token_routed(tmp_path_factory):
    """The model directory with its exact table as routing_table.bin (every token id traced once)."""
    model = ModelDir.open(make_token_routed_model(tmp_path_factory.mktemp("token_routed")))
    cfg = model.config
    table = exact_token_table(model, backend="cuda")
    write_routing_table(model.path / TABLE_FILE, table, cfg.num_experts, model_digest(model.path))
    return model


def decode_in_flight(engine) -> tuple[list[int], list[CacheStats]]:
    """The prompt, then DECODES steps launched two at a time (each fed the one before's argmax on the device)."""
    first = engine.step([PrefillInput(1, PROMPT, SamplingParams(), True)])
    tokens, stats = [first.outputs[0].token_id], []
    flight = [engine.launch(decode_ids=[1])]
    for n in range(DECODES):
        if n + 1 < DECODES:
            flight.append(engine.launch(decode_ids=[1]))
        result = engine.collect(flight.pop(0))
        tokens.append(result.outputs[0].token_id)
        stats.append(result.expert_cache)
    return tokens, stats


def test_device_plan_predicts_every_expert_of_fed_decodes(token_routed):
    cfg = token_routed.config
    K = cfg.num_experts_per_tok
    resident = build_engine(token_routed, EngineConfig(backend="cuda", kv_block_size=4))
    expected, _ = decode_in_flight(resident)
    resident.decoder.close()
    cached = build_engine(
        token_routed, EngineConfig(backend="cuda", kv_block_size=4, expert_cache_slots=K, prefetch="plan")
    )
    assert cached.decoder.cached.plan_table is not None  # found in the model directory
    assert cached.decoder.router_plan_width == 0  # its own table: the router's plans are not read
    tokens, stats = decode_in_flight(cached)
    assert tokens == expected
    total = sum(stats, CacheStats())
    assert total.misses == 0, stats  # every expert was prefetched before its layer ran
    assert total.prefetches_issued > 0 and total.prefetches_used == total.prefetches_issued
    cached.decoder.close()


def test_router_plans_when_asked_for(token_routed):
    cfg = token_routed.config
    config = EngineConfig(
        backend="cuda",
        kv_block_size=4,
        expert_cache_slots=cfg.num_experts_per_tok,
        prefetch="plan",
        plan_table="router",
    )
    engine = build_engine(token_routed, config)
    assert engine.decoder.cached.plan_table is None
    K = cfg.num_experts_per_tok
    assert engine.decoder.router_plan_width == K  # Info.plan_width: a router sends each token's first K
    tokens, stats = decode_in_flight(engine)  # no plan sent: the plan prefetch copies nothing
    assert sum(stats, CacheStats()).prefetches_issued == 0 and len(tokens) == DECODES + 1
    # a plan wider than that (a router before the field) is staged token by token, no token's predictions dropped
    cached, layer = engine.decoder.cached, cfg.moe_layers[0]
    wide = np.arange(3 * (K + 1), dtype=np.int64).reshape(3, K + 1) % cfg.num_experts
    cached.host_hints[0] = -7
    cached.stage_hints({layer: wide}, 0, 3)  # 3 x K assignments, K slots: a pass that never prefetches
    assert (cached.host_hints[0] == -7).all()  # ... so nothing was staged for it
    cached.prefetch_large_steps = True
    cached.stage_hints({layer: wide}, 0, 3)
    assert np.array_equal(cached.host_hints[0, 0, : 3 * K], wide[:, :K].reshape(-1))
    engine.decoder.close()


def test_no_plan_width_without_plan_prefetch(token_routed):
    """A cache that prefetches by lookahead alone reads no router plan: Info.plan_width 0 (the router sends its
    plans whole, for the recall it reports)."""
    config = EngineConfig(
        backend="cuda",
        kv_block_size=4,
        expert_cache_slots=token_routed.config.num_experts_per_tok,
        prefetch="lookahead",
        plan_table="router",
    )
    engine = build_engine(token_routed, config)
    assert not engine.decoder.cached.reads_router_plans and engine.decoder.router_plan_width == 0
    engine.decoder.close()


def test_a_table_predicting_more_experts_than_the_model_routes_to(token_routed, tmp_path):
    """A table of k = K + 1 (a router-gen --top-k above the model's): the hints hold k ids a token, so every
    routed expert is still predicted, plus one more."""
    from common.routing_table import RoutingTable

    cfg = token_routed.config
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    exact = RoutingTable.load(token_routed.path / TABLE_FILE, cfg, model_digest(token_routed.path)).table
    rng = np.random.default_rng(7)
    extra = np.array([[rng.choice(np.setdiff1d(np.arange(E), row)) for row in layer] for layer in exact], np.uint16)
    wider_ids = np.concatenate([exact, extra[:, :, None]], axis=2)
    wider = write_routing_table(tmp_path / "wider.bin", wider_ids, E, model_digest(token_routed.path))
    config = EngineConfig(
        backend="cuda", kv_block_size=4, expert_cache_slots=K + 1, prefetch="plan", plan_table=str(wider)
    )
    engine = build_engine(token_routed, config)
    assert engine.decoder.cached.hint_width == K + 1
    tokens, stats = decode_in_flight(engine)
    resident = build_engine(token_routed, EngineConfig(backend="cuda", kv_block_size=4))
    assert tokens == decode_in_flight(resident)[0]
    assert sum(stats, CacheStats()).misses == 0
    engine.decoder.close()
    resident.decoder.close()
