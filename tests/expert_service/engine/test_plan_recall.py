"""The recall of the expert cache's plan, measured by the engine on the cpu backend: with the worker's own table
lookup it is the table's prediction for each step's input tokens, decodes fed from the step before included; with
a model whose routing depends only on the token id and its exact table, that is 1.0 on every step; a table that
names other experts scores 0; the router's plan is scored when the worker has no table; routing=lut has none."""

import numpy as np
import pytest

from common.model_format import ModelDir
from common.routing_plan import RoutingPlan
from common.routing_table import TABLE_FILE, RoutingTable, model_digest, write_routing_table
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from tests.helpers import cpu_engine, exact_token_table, make_token_routed_model

PROMPTS = (np.array([5, 17, 42, 99, 3], np.int64), np.array([250, 7, 31], np.int64))


@pytest.fixture(scope="module")
def token_routed(tmp_path_factory):
    """The model and its exact table (every token id traced once on a resident engine)."""
    model = ModelDir.open(make_token_routed_model(tmp_path_factory.mktemp("token_routed")))
    table = exact_token_table(model)
    return model, table


def recalls(engine, plan=None) -> list:
    """The prompts in one step, then 4 decode steps launched two at a time (each fed the one before's token)."""
    first = engine.step([PrefillInput(i, p, SamplingParams(), True) for i, p in enumerate(PROMPTS)])
    out = [first.routing_plan_recall]
    ids = list(range(len(PROMPTS)))
    flight = [engine.launch(decode_ids=ids, routing_plan=plan)]
    for n in range(4):
        if n < 3:
            flight.append(engine.launch(decode_ids=ids, routing_plan=plan))
        out.append(engine.collect(flight.pop(0)).routing_plan_recall)
    return out


def test_the_workers_own_table_is_scored_on_each_steps_input_tokens(token_routed, tmp_path, monkeypatch):
    import expert_service.engine.engine as engine_module

    model, table = token_routed
    E = model.config.num_experts
    digest = model_digest(model.path)
    write_routing_table(tmp_path / "exact.bin", table, E, digest)
    write_routing_table(tmp_path / "wrong.bin", np.sort((table + 1) % E, axis=2), E, digest)  # never the routed ones...
    config = dict(backend="cpu", kv_block_size=4, expert_cache_slots=2, prefetch="plan")
    exact = cpu_engine(model, EngineConfig(**config, plan_table=str(tmp_path / "exact.bin")), overlap=True)
    assert exact.decoder.plan_lookup is not None
    sampled = recalls(exact)  # scored on one step in OWN_PLAN_RECALL_EVERY: the first (serial 0) here
    assert sampled[0] == 1.0 and sampled[1:] == [None] * 4
    monkeypatch.setattr(engine_module, "OWN_PLAN_RECALL_EVERY", 1)
    exact = cpu_engine(model, EngineConfig(**config, plan_table=str(tmp_path / "exact.bin")), overlap=True)
    assert recalls(exact) == [1.0] * 5  # the fed decodes' own tokens, not a placeholder, were looked up
    wrong = cpu_engine(model, EngineConfig(**config, plan_table=str(tmp_path / "wrong.bin")), overlap=True)
    assert all(0.0 <= r < 1.0 for r in recalls(wrong))


def test_the_routers_plan_is_scored_without_a_table_and_lut_has_no_recall(token_routed):
    model, table = token_routed
    cfg = model.config
    engine = build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, expert_cache_slots=2, prefetch="plan"))
    assert engine.decoder.plan_lookup is None  # no table in the model directory
    lookup = RoutingTable(table, cfg.num_experts, cfg.moe_layers)
    plan = lookup.routing_plan(np.concatenate(PROMPTS))
    first = engine.step([PrefillInput(i, p, SamplingParams(), True) for i, p in enumerate(PROMPTS)], routing_plan=plan)
    assert first.routing_plan_recall == 1.0
    lut = build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, routing="lut"))
    result = lut.step(
        [PrefillInput(0, PROMPTS[0], SamplingParams(), True)], routing_plan=lookup.routing_plan(PROMPTS[0])
    )
    assert result.routing_plan_recall is None
    assert isinstance(plan, RoutingPlan) and TABLE_FILE == "routing_table.bin"


def test_a_router_table_wider_than_the_models_top_k_is_a_prediction_under_exact_and_refused_under_lut(token_routed):
    """A router table may keep more experts a token than the model routes to (docs/routing.md: more prefetched bytes
    for a higher recall): under routing=exact its plan is a prediction the step prefetches and scores; under
    routing=lut it would be the routing, so it must have the model's top-k."""
    from common.errors import InvalidRequestError

    model, table = token_routed
    cfg = model.config
    spare = np.stack([[[next(e for e in range(cfg.num_experts) if e not in row)] for row in layer] for layer in table])
    wider = RoutingTable(np.concatenate([table, spare.astype(np.uint16)], axis=2), cfg.num_experts, cfg.moe_layers)
    assert wider.top_k == cfg.num_experts_per_tok + 1
    tokens = np.concatenate(PROMPTS)
    plan = wider.routing_plan(tokens)
    chunks = [PrefillInput(i, p, SamplingParams(), True) for i, p in enumerate(PROMPTS)]
    config = dict(backend="cpu", kv_block_size=4, expert_cache_slots=3, prefetch="plan", prefetch_large_steps=True)
    engine = build_engine(model, EngineConfig(**config))
    result = engine.step(chunks, routing_plan=plan)
    assert result.routing_plan_recall == 1.0 and result.expert_cache.prefetches_issued > 0
    lut = build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, routing="lut"))
    with pytest.raises(InvalidRequestError, match="^routing_plan.token_indices: every token needs 2 experts$"):
        lut.step(chunks, routing_plan=plan)


@pytest.mark.parametrize("source", ["worker", "router"])
def test_a_gated_tables_no_expert_entries_predict_and_prefetch_nothing(token_routed, tmp_path, monkeypatch, source):
    """A version-3 table (router-gen --min-share): a NO_EXPERT entry is no prediction. The cpu cache prefetches
    only the real ones, from the worker's own lookup or the router's padded plan, and the recall counts them: the
    exact table's kept predictions are all hits, so recall = kept predictions / (tokens x layers x k)."""
    from common.routing_table import NO_EXPERT
    from expert_service.experts.cache import ExpertCache

    model, table = token_routed
    cfg = model.config
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    gated = table.copy()
    gated[:, ::2, 1:] = NO_EXPERT  # even token ids keep their first prediction
    gated[:, ::3, :] = NO_EXPERT  # every third predicts nothing
    gated[1:, 42] = table[1:, 42]  # one token predicts at some layers and not at others
    path = write_routing_table(tmp_path / "gated.bin", gated, E, model_digest(model.path))
    prefetched: list[int] = []
    prefetch = ExpertCache.prefetch

    def spy(self, layer, experts):
        experts = list(experts)
        prefetched.extend(experts)
        return prefetch(self, layer, experts)

    monkeypatch.setattr(ExpertCache, "prefetch", spy)
    # a prefill chunk prefetches only with prefetch_large_steps (its tokens' experts exceed the slots)
    config = dict(backend="cpu", kv_block_size=4, expert_cache_slots=2, prefetch="plan", prefetch_large_steps=True)
    tokens = np.concatenate(PROMPTS)
    chunks = [PrefillInput(i, p, SamplingParams(), True) for i, p in enumerate(PROMPTS)]
    if source == "worker":
        engine = cpu_engine(model, EngineConfig(**config, plan_table=str(path)), overlap=False)
        result = engine.step(chunks)  # serial 0: scored
    else:
        engine = build_engine(model, EngineConfig(**config, plan_table="router"))
        plan = RoutingTable.load(path, cfg, model_digest(model.path)).routing_plan(tokens)
        result = engine.step(chunks, routing_plan=plan)
    kept = int((gated[:, tokens] != NO_EXPERT).sum())
    assert 0 < kept < gated[:, tokens].size
    assert result.routing_plan_recall == pytest.approx(kept / (len(tokens) * len(cfg.moe_layers) * K))
    assert prefetched and all(0 <= e < E for e in prefetched)
