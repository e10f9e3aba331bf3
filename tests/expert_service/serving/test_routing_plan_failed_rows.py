"""A step's routing plan counts every token the router sent, the rows that then fail alone included (a new
sequence while the worker drains, another stream's sequence, an unknown sequence or prefix block): the rest of
the step runs, routed by its own rows of the plan, as it would in a step without those rows. Under routing=lut,
where the plan is the routing, on the cpu engine of the tiny model and a random table."""

from __future__ import annotations

import numpy as np
import pytest

from common.model_format import ModelDir
from common.routing_table import RoutingTable
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.serving.step_stream import StepRequest, StreamSession
from tests.expert_service.serving.test_step_pump_differential import GREEDY
from tests.helpers import cpu_engine

PROMPT, HEAD, TAIL = np.array([5, 17, 42, 99, 3]), np.array([250, 7]), np.array([31, 8, 64])
DROPPED = np.array([11, 12, 13])


def _lut(model):
    return cpu_engine(model, EngineConfig(backend="cpu", kv_block_size=4, routing="lut"), False)


def _table(model) -> RoutingTable:
    cfg = model.config
    rng = np.random.default_rng(0)
    shape = (len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts)
    table = np.sort(rng.random(shape).argsort(axis=2)[:, :, : cfg.num_experts_per_tok], axis=2)
    return RoutingTable(table.astype(np.uint16), cfg.num_experts, cfg.moe_layers)


def _step(step_id, table, chunks, decodes, decode_tokens, plan_tokens=None):
    tokens = np.concatenate([*(c.token_ids for c in chunks), decode_tokens]).astype(np.int64)
    plan = table.routing_plan(tokens if plan_tokens is None else plan_tokens)
    return StepRequest(step_id, np.zeros(0, "<u8"), list(chunks), np.asarray(decodes, "<u8"), plan)


def _started(engine, table, owners=None, draining=lambda: False):
    """Sequence 1 sampled its first token, sequence 2 holds the head of its prompt."""
    session = StreamSession(engine, {} if owners is None else owners, draining)
    chunks = [PrefillInput(1, PROMPT, GREEDY, True), PrefillInput(2, HEAD, GREEDY, False)]
    first = session.run(_step(1, table, chunks, [], []))
    return session, first.result.outputs[0].token_id


def _survivors(model, table, dropped_chunk, dropped_decode, draining=False, foreign=False):
    """Sequence 2's last chunk and sequence 1's decode, in a step that also carries rows failing alone (before
    each of them, so the plan's token indices of the survivors move), and alone."""
    engine, owners = _lut(model), {}
    if foreign:  # sequence 7 belongs to another stream
        StreamSession(engine, owners).run(_step(1, table, [PrefillInput(7, PROMPT, GREEDY, True)], [], []))
    drains = []  # the worker starts draining once the sequences are started
    session, token = _started(engine, table, owners, lambda: bool(drains))
    drains += [draining] if draining else []
    chunks = [c for c in (dropped_chunk,) if c is not None] + [PrefillInput(2, TAIL, None, True)]
    decodes = [d for d in (dropped_decode,) if d is not None] + [1]
    mixed = session.run(_step(2, table, chunks, decodes, [DROPPED[0]] * (len(decodes) - 1) + [token]))
    alone_session, _ = _started(_lut(model), table)
    alone = alone_session.run(_step(2, table, [PrefillInput(2, TAIL, None, True)], [1], [token]))
    return mixed, alone


@pytest.mark.parametrize(
    "dropped_chunk, dropped_decode, draining, foreign, error",
    [
        (PrefillInput(6, DROPPED, GREEDY, True), None, True, False, "DRAINING"),
        (PrefillInput(7, DROPPED, None, True), None, False, True, "FOREIGN_SEQUENCE"),
        (None, 7, False, True, "FOREIGN_SEQUENCE"),
        (None, 9, False, False, "UNKNOWN_SEQUENCE"),
        (PrefillInput(5, DROPPED, GREEDY, True, prefix_block_ids=(77,)), None, False, False, "UNKNOWN_PREFIX_BLOCK"),
        (PrefillInput(8, DROPPED, None, True, start_position=4), 9, False, False, "UNKNOWN_SEQUENCE"),
    ],
)
def test_the_rest_of_the_step_runs_on_its_own_rows_of_the_plan(
    tiny_model, dropped_chunk, dropped_decode, draining, foreign, error
):
    model = ModelDir.open(tiny_model)
    mixed, alone = _survivors(model, _table(model), dropped_chunk, dropped_decode, draining, foreign)
    assert mixed.refused == "", mixed.refused
    ran = {o.request_id: o for o in mixed.result.outputs if not o.error}
    assert sorted(ran) == [1, 2] and {o.error for o in mixed.result.outputs if o.error} == {error}
    assert [ran[o.request_id].token_id for o in alone.result.outputs] == [o.token_id for o in alone.result.outputs]
    np.testing.assert_allclose(mixed.result.logits.array, alone.result.logits.array, rtol=1e-5, atol=1e-6)


def test_a_plan_of_another_token_count_is_still_refused_naming_the_field(tiny_model):
    model = ModelDir.open(tiny_model)
    table = _table(model)
    engine = _lut(model)
    session, token = _started(engine, table)
    chunks = [PrefillInput(2, TAIL, None, True)]
    step = _step(2, table, chunks, [9, 1], [token, token], plan_tokens=np.concatenate([TAIL, [token]]))
    answer = session.run(step)
    assert answer.result is None and answer.refused.startswith("routing_plan.token_indices: ")
    assert engine.sequences[2].num_cached == len(HEAD)
