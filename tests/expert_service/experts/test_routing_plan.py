import re

import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.pb import worker_pb2 as pb
from common.routing_plan import RoutingPlan, csr_to_ids
from common.tensors import from_pb, to_pb
from expert_service.cpu.layers.moe import route, route_planned
from expert_service.experts.routing_plan import routing_plan_recall, warmup_routing_plan
from expert_service.serving import wire
from router_service import wire as router_wire


def csr(ids: np.ndarray, num_experts: int):
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    offsets = np.zeros(num_experts + 1, np.int32)
    np.cumsum(np.bincount(flat, minlength=num_experts), out=offsets[1:])
    return offsets, (order // ids.shape[1]).astype(np.int32)


def test_csr_round_trip():
    rng = np.random.default_rng(0)
    ids = np.stack([np.sort(rng.choice(7, 3, replace=False)) for _ in range(11)])
    np.testing.assert_array_equal(csr_to_ids(*csr(ids, 7), 7, 11), ids)


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda o, t: (o[:-1], t), "offsets"),
        (lambda o, t: (o, np.where(t == 0, 50, t).astype(np.int32)), "token_indices"),
        (lambda o, t: (o, np.concatenate([t[:-1], t[:1]]).astype(np.int32)), "token_indices"),
    ],
)
def test_malformed_plans_name_the_field(mutate, field):
    ids = np.array([[0, 1], [1, 2], [0, 2]])
    offsets, tokens = mutate(*csr(ids, 3))
    with pytest.raises(InvalidRequestError) as e:
        csr_to_ids(offsets, tokens, 3, 3)
    assert field in e.value.field


def test_every_layer_at_once_equals_each_layer_alone():
    """RoutingPlan.expert_ids converts all layers in one pass; each layer equals csr_to_ids of its own CSR, and a
    malformed layer among good ones is refused with the field named."""
    rng = np.random.default_rng()
    L, T, k, E = 5, 9, 3, 11
    ids = np.stack([np.stack([np.sort(rng.choice(E, k, replace=False)) for _ in range(T)]) for _ in range(L)])
    plan = RoutingPlan.from_expert_ids(list(range(2, 2 + L)), ids.astype(np.uint16), E)
    got = plan.expert_ids(E, T, k)
    assert list(got) == list(range(2, 2 + L))
    for layer, offsets, tokens in plan.csr():
        np.testing.assert_array_equal(got[layer], csr_to_ids(offsets, tokens, E, T, k))
        np.testing.assert_array_equal(got[layer], ids[layer - 2])
    tokens = plan.token_indices.copy()
    tokens[3, 0] = T  # one layer names a token the step does not have
    with pytest.raises(InvalidRequestError) as e:
        RoutingPlan(plan.layers, plan.offsets, tokens).expert_ids(E, T, k)
    assert "token_indices" in e.value.field


def test_routing_plan_from_pb_and_recall():
    exact = {0: np.array([[0, 1], [2, 3]]), 1: np.array([[1, 2], [0, 3]])}
    predicted = {0: np.array([[0, 1], [2, 0]]), 1: np.array([[3, 0], [0, 3]])}
    packed = [csr(v, 4) for v in predicted.values()]
    message = pb.RoutingPlan(
        layers=list(predicted),
        offsets=to_pb(np.stack([o for o, _ in packed])),
        token_indices=to_pb(np.stack([t for _, t in packed])),
    )
    decoded = wire.routing_plan(message, [0, 1]).expert_ids(4, 2)
    for layer in predicted:
        np.testing.assert_array_equal(np.sort(decoded[layer], axis=1), np.sort(predicted[layer], axis=1))
    assert routing_plan_recall(decoded, exact) == pytest.approx(5 / 8)
    with pytest.raises(InvalidRequestError, match="MoE layers"):
        wire.routing_plan(
            pb.RoutingPlan(
                layers=[5], offsets=to_pb(np.zeros((1, 5), np.int32)), token_indices=to_pb(np.zeros((1, 0), np.int32))
            ),
            [0, 1],
        )
    assert wire.routing_plan(pb.RoutingPlan(), [0, 1]) is None  # no layers: no plan


def test_routing_plan_pb_round_trip_and_expert_ids():
    """The router's side (from expert ids, its wire) and the worker's (its wire, expert_ids) agree."""
    rng = np.random.default_rng(3)
    ids = np.stack([[rng.choice(6, 2, replace=False) for _ in range(9)] for _ in range(3)])  # [L, T, k]
    plan = RoutingPlan.from_expert_ids([1, 3, 4], ids.astype(np.uint16), 6)
    for l, (_layer, offsets, tokens) in enumerate(plan.csr()):
        ref_offsets, ref_tokens = csr(ids[l], 6)
        np.testing.assert_array_equal(offsets, ref_offsets)
        np.testing.assert_array_equal(tokens, ref_tokens)
    back = wire.routing_plan(pb.RoutingPlan.FromString(router_wire.routing_plan(plan).SerializeToString()), [1, 3, 4])
    assert back.layers == (1, 3, 4)
    decoded = back.expert_ids(6, 9)
    for l, layer in enumerate(back.layers):
        np.testing.assert_array_equal(decoded[layer], np.sort(ids[l], axis=1))


def test_warmup_routing_plan_sends_every_token_to_the_first_experts():
    plan = warmup_routing_plan([0, 2], num_experts=5, top_k=2, num_tokens=3)
    for ids in plan.expert_ids(5, 3).values():
        np.testing.assert_array_equal(ids, [[0, 1]] * 3)


def test_tensor_wire_checks():
    t = to_pb(np.arange(6, dtype=np.int32).reshape(2, 3))
    np.testing.assert_array_equal(from_pb(t, "x", "int32"), np.arange(6).reshape(2, 3))
    with pytest.raises(InvalidRequestError, match="bytes do not fit"):
        from_pb(pb.Tensor(data=b"\0" * 5, dtype="int32", shape=[2]), "x")
    with pytest.raises(InvalidRequestError, match="dtype must be int32"):
        from_pb(pb.Tensor(data=b"\0" * 8, dtype="int64", shape=[1]), "x", "int32")


def test_planned_weights_equal_exact_renormalised_topk_on_the_same_experts():
    """With the planned experts equal to the exact top-k, LUT weights = the renormalised top-k weights
    (Mixtral's routing), which is why a token-determined model gives identical outputs under both."""
    logits = np.random.default_rng(1).standard_normal((9, 6)).astype(np.float32)
    ids, weights = route(logits, 2, normalize=True)
    np.testing.assert_allclose(route_planned(logits, ids), weights, rtol=1e-6)


def test_worker_plan_table_resolution(tmp_path, caplog):
    """EngineConfig.plan_table: the model directory's table by default, a file named, or the router's plans; a
    named file that is missing or does not fit the model is refused in one line naming plan_table and the file
    (a table that did not fit named only the file); a file that is no table at all is refused after reading its
    header only."""
    from common.errors import ConfigError, ModelFormatError
    from common.model_format import ModelDir
    from common.routing_table import TABLE_FILE, model_digest, write_routing_table
    from expert_service.engine.config import EngineConfig
    from expert_service.experts.routing_plan import worker_plan_table
    from expert_service.tools.tiny_model import make_tiny

    model = ModelDir.open(make_tiny(tmp_path / "m", seed=3), verify=False)
    cfg = model.config
    L, V, E, K = len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts, cfg.num_experts_per_tok
    rng = np.random.default_rng(5)
    table = np.stack([[rng.choice(E, K, replace=False) for _ in range(V)] for _ in range(L)]).astype(np.uint16)
    assert worker_plan_table(model, EngineConfig(prefetch="plan")) is None  # no table in the directory yet
    digest = model_digest(model.path)
    write_routing_table(model.path / TABLE_FILE, table, E, digest)
    found = worker_plan_table(model, EngineConfig(prefetch="plan,lookahead"))
    assert found is not None and np.array_equal(found.table, table)
    assert worker_plan_table(model, EngineConfig(prefetch="lookahead")) is None  # no plan prefetch: no table
    assert worker_plan_table(model, EngineConfig(prefetch="plan", plan_table="router")) is None
    other = write_routing_table(tmp_path / "other.bin", table[:, :, :1], E, digest)
    assert worker_plan_table(model, EngineConfig(prefetch="plan", plan_table=str(other))).top_k == 1
    with pytest.raises(ConfigError, match=r"^plan_table: .*missing.bin is not a file"):
        worker_plan_table(model, EngineConfig(prefetch="plan", plan_table=str(tmp_path / "missing.bin")))
    wrong = write_routing_table(tmp_path / "wrong.bin", table[:, : V - 1], E, digest)
    with pytest.raises(ModelFormatError, match=rf"^plan_table: {re.escape(str(wrong))}: .*vocab_size"):
        worker_plan_table(model, EngineConfig(prefetch="plan", plan_table=str(wrong)))
    huge = tmp_path / "experts.bin"
    huge.write_bytes(b"\0" * (1 << 20))
    with pytest.raises(ModelFormatError, match=rf"^plan_table: {re.escape(str(huge))}: .*magic"):
        worker_plan_table(model, EngineConfig(prefetch="plan", plan_table=str(huge)))
    # routing=lut: the router's plan is the routing, so it is also what the prefetch reads
    assert worker_plan_table(model, EngineConfig(prefetch="plan", routing="lut")) is None
    # a stale table in the model directory (another vocabulary) is passed over with a warning, not fatal
    write_routing_table(model.path / TABLE_FILE, table[:, : V - 1], E, digest)
    with caplog.at_level("WARNING", logger="colibri.worker"):
        assert worker_plan_table(model, EngineConfig(prefetch="plan")) is None
    assert any("vocab_size" in r.getMessage() and "passed over" in r.getMessage() for r in caplog.records)


def test_a_table_built_for_another_model_of_the_same_shape_is_not_read(tmp_path, caplog):
    """The table header recorded no model: a table built for one conversion was read for another of the same
    shape. The model directory's is passed over with a warning naming the digest; a named one stops the worker."""
    from common.errors import ModelFormatError
    from common.model_format import ModelDir
    from common.routing_table import TABLE_FILE, model_digest, write_routing_table
    from expert_service.engine.config import EngineConfig
    from expert_service.experts.routing_plan import worker_plan_table
    from expert_service.tools.tiny_model import make_tiny

    seed = int(np.random.default_rng().integers(0, 1000))
    model = ModelDir.open(make_tiny(tmp_path / "m", seed=seed), verify=False)
    other = make_tiny(tmp_path / "other", seed=seed + 1)  # same shape, other weights
    cfg = model.config
    L, V, E = len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts
    table = np.argsort(np.random.default_rng(seed).random((L, V, E)), axis=2)[:, :, :2].astype(np.uint16)
    write_routing_table(model.path / TABLE_FILE, table, E, model_digest(other))
    with caplog.at_level("WARNING", logger="colibri.worker"):
        assert worker_plan_table(model, EngineConfig(prefetch="plan")) is None
    assert any("model digest" in r.getMessage() and "passed over" in r.getMessage() for r in caplog.records)
    named = write_routing_table(tmp_path / "named.bin", table, E, model_digest(other))
    with pytest.raises(ModelFormatError, match=rf"^plan_table: {re.escape(str(named))}: model digest is "):
        worker_plan_table(model, EngineConfig(prefetch="plan", plan_table=str(named)))
    write_routing_table(model.path / TABLE_FILE, table, E, model_digest(model.path))  # its own: read
    assert worker_plan_table(model, EngineConfig(prefetch="plan")) is not None


def test_offsets_that_wrap_around_int32_are_refused_in_one_line():
    """int32 offsets whose differences wrap around (0, 2**31 - 1, -2**31, -1, n) look non-decreasing to an int32
    diff; they are refused naming the field, not expanded into a 2**32-entry array."""
    wrapped = np.array([[0, 2**31 - 1, -(2**31), -1, 4], [0, 1, 2, 3, 4]], np.int32)
    tokens = np.array([[0, 0, 1, 1], [0, 1, 0, 1]], np.int32)
    message = pb.RoutingPlan(layers=[0, 1], offsets=to_pb(wrapped), token_indices=to_pb(tokens))
    with pytest.raises(InvalidRequestError) as e:
        wire.routing_plan(message, [0, 1]).expert_ids(4, 2, 2)
    assert e.value.field == "routing_plan.offsets" and "\n" not in str(e.value)
    with pytest.raises(InvalidRequestError, match="offsets"):  # a non-integer offset is no offset either
        csr_to_ids(np.array([0, 0.5, 2, 3, 4]), np.array([0, 0, 1, 1], np.int32), 4, 2)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.tools.tiny_model import make_tiny

    model = ModelDir.open(make_tiny(tmp_path_factory.mktemp("plan") / "m", seed=4), verify=False)
    return build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, routing="lut", expert_cache_slots=2))


@pytest.mark.parametrize(
    "bad,field",
    [
        (lambda p, moe: RoutingPlan(tuple(l + 5 for l in moe), p.offsets, p.token_indices), "routing_plan.layers"),
        (lambda p, moe: RoutingPlan(tuple(moe[:1]), p.offsets[:1], p.token_indices[:1]), "routing_plan.layers"),
        (lambda p, moe: RoutingPlan(tuple(moe[:1]) * len(moe), p.offsets, p.token_indices), "routing_plan.layers"),
        (lambda p, moe: RoutingPlan(tuple(moe), p.offsets[:1], p.token_indices[:1]), "routing_plan"),
        (lambda p, moe: RoutingPlan(tuple(moe), p.offsets, p.token_indices[0]), "routing_plan"),
    ],
)
def test_the_engine_refuses_a_plan_that_is_not_for_the_models_moe_layers(tiny_engine, bad, field):
    """engine.step checks a plan's layer list against the model's MoE layers and its rows against that list, as
    the worker's wire does: under routing=lut a layer the plan misses would silently take the exact routing."""
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    moe, cfg = tiny_engine.model_config.moe_layers, tiny_engine.model_config
    tokens = np.array([3, 4, 5], np.int64)
    ids = np.broadcast_to(np.arange(cfg.num_experts_per_tok), (len(moe), len(tokens), cfg.num_experts_per_tok))
    plan = RoutingPlan.from_expert_ids(moe, ids, cfg.num_experts)
    rid = 100 + len(tiny_engine.sequences)
    with pytest.raises(InvalidRequestError) as e:
        tiny_engine.step([PrefillInput(rid, tokens, SamplingParams(), True)], routing_plan=bad(plan, moe))
    assert e.value.field.startswith(field) and "\n" not in str(e.value)
    assert rid not in tiny_engine.sequences  # refused whole: nothing started
    good = tiny_engine.step([PrefillInput(rid, tokens, SamplingParams(), True)], routing_plan=plan)
    assert [o.error for o in good.outputs] == [""]


def test_random_hostile_plans_on_the_wire_are_refused_in_one_line_or_are_valid():
    """Seeded fuzz of the CSR tensors a router sends (int32 extremes and wrap-arounds, off-by-one and negative
    entries): the worker's parsing either refuses in one line naming a routing_plan field or returns expert ids
    in range, distinct per token, that round-trip to the same CSR."""
    rng = np.random.default_rng(5)
    L, T, k, E = 2, 5, 2, 6
    extremes = np.array([-(2**31), -1, 0, 1, T, T * k, 2**31 - 1], np.int64)
    refused = 0
    for _ in range(400):
        ids = np.stack([[np.sort(rng.choice(E, k, replace=False)) for _ in range(T)] for _ in range(L)])
        plan = RoutingPlan.from_expert_ids([0, 1], ids.astype(np.uint16), E)
        offsets, tokens = plan.offsets.astype(np.int64), plan.token_indices.astype(np.int64)
        if rng.random() < 0.1:  # int32 differences that wrap around and look non-decreasing
            at = int(rng.integers(1, E - 2))
            offsets[int(rng.integers(0, L)), at : at + 3] = [2**31 - 1, -(2**31), -1]
        for _ in range(int(rng.integers(1, 3))):
            target = offsets if rng.random() < 0.5 else tokens
            at = tuple(int(rng.integers(0, n)) for n in target.shape)
            target[at] = rng.choice(extremes) if rng.random() < 0.5 else target[at] + rng.integers(-2, 3)
        message = pb.RoutingPlan(
            layers=[0, 1], offsets=to_pb(offsets.astype(np.int32)), token_indices=to_pb(tokens.astype(np.int32))
        )
        try:
            got = wire.routing_plan(message, [0, 1]).expert_ids(E, T, k, [0, 1])
        except InvalidRequestError as error:
            assert error.field.startswith("routing_plan") and "\n" not in str(error)
            refused += 1
            continue
        for layer, layer_ids in got.items():
            assert layer_ids.shape == (T, k) and layer_ids.min() >= 0 and layer_ids.max() < E
            assert (np.diff(layer_ids, axis=1) > 0).all()
            again = RoutingPlan.from_expert_ids([layer], layer_ids[None].astype(np.uint16), E)
            np.testing.assert_array_equal(again.offsets[0], offsets[layer])
    assert refused > 300


@pytest.mark.parametrize(
    "settings, why",
    [
        (dict(), "every expert is resident"),
        (dict(expert_cache_slots=2, prefetch="lookahead"), "--prefetch lookahead has no plan"),
        (dict(expert_cache_slots=2, prefetch="none"), "--prefetch none has no plan"),
        (dict(expert_cache_slots=2, routing="lut"), "routing=lut"),
    ],
)
def test_a_plan_table_the_settings_leave_unread_is_named_in_a_warning(tiny_model, tmp_path, caplog, settings, why):
    """A --plan-table file (here not even a table) that nothing reads was passed over in silence."""
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    named = tmp_path / "typo.bin"
    config = EngineConfig(backend="cpu", plan_table=str(named), kv_cache_tokens=256, **settings)
    with caplog.at_level("WARNING", logger="colibri.worker"):
        build_engine(ModelDir.open(tiny_model, verify=False), config).close()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(f"plan_table: {named} is not read (") and why in m for m in warned), warned


def test_a_plan_table_that_is_read_or_the_router_warns_nothing(tmp_path, caplog):
    from expert_service.engine.config import EngineConfig
    from expert_service.experts.routing_plan import warn_unread_plan_table

    with caplog.at_level("WARNING", logger="colibri.worker"):
        assert warn_unread_plan_table(EngineConfig(plan_table=str(tmp_path / "t.bin")), cached=True) is None
        assert warn_unread_plan_table(EngineConfig(plan_table="router"), cached=False) is None
        assert warn_unread_plan_table(EngineConfig(), cached=False) is None
    assert not caplog.records


def gapped_ids(rng, L: int, T: int, k: int, E: int) -> np.ndarray:
    """[L, T, k] uint16: each token's first 0..k of k distinct experts, NO_EXPERT after them (a gated table's)."""
    from common.routing_plan import NO_EXPERT

    ids = np.argsort(rng.random((L, T, E)), axis=2)[:, :, :k].astype(np.uint16)
    ids[np.arange(k)[None, None, :] >= rng.integers(0, k + 1, (L, T))[:, :, None]] = NO_EXPERT
    return ids


def test_a_gapped_plan_round_trips_through_the_wire_as_padded_ids():
    """A prediction naming fewer experts for some tokens: each CSR row lists the real entries, -1 padding after
    them; the worker reads back each token's experts ascending, then -1; keep_rows renumbers it as a full plan."""
    from common.routing_plan import NO_EXPERT

    rng = np.random.default_rng(21)
    L, T, k, E = 3, 11, 3, 7
    ids = gapped_ids(rng, L, T, k, E)
    plan = RoutingPlan.from_expert_ids([1, 2, 4], ids, E)
    real = (ids != NO_EXPERT).sum(axis=(1, 2))
    assert plan.offsets[:, -1].tolist() == real.tolist() and plan.token_indices.shape == (L, T * k)
    for l in range(L):
        assert (plan.token_indices[l, real[l] :] == -1).all() and (plan.token_indices[l, : real[l]] >= 0).all()
    back = wire.routing_plan(pb.RoutingPlan.FromString(router_wire.routing_plan(plan).SerializeToString()), [1, 2, 4])
    got = back.expert_ids(E, T)
    for l, layer in enumerate((1, 2, 4)):
        for t in range(T):
            named = sorted(int(e) for e in ids[l, t] if e != NO_EXPERT)
            assert got[layer][t].tolist() == named + [-1] * (k - len(named))
    kept = plan.keep_rows([4, 7], [False, True], E)  # the first 4 tokens' row failed alone
    again = kept.expert_ids(E, 7)
    for layer in (1, 2, 4):
        np.testing.assert_array_equal(again[layer], got[layer][4:])
    assert routing_plan_recall(got, {layer: np.tile([[0, 1]], (T, 1)) for layer in got}) is not None
    with pytest.raises(InvalidRequestError, match=f"every token needs {k} experts"):  # a routing needs all k
        back.expert_ids(E, T, k)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda o, t: (o, np.where(np.arange(t.shape[1]) < o[:, -1:], t, 99).astype(np.int32)), None),  # padding
        (lambda o, t: (o, np.where(t == 0, 5, t).astype(np.int32)), "token_indices"),  # a token listed too often
        (lambda o, t: (np.minimum(o + 1, 99).astype(np.int32), t), "offsets"),  # past the row
    ],
)
def test_a_gapped_plans_padding_is_ignored_and_its_entries_checked(mutate, field):
    """Entries past a row's offsets[E] are padding, whatever they hold; the real ones still index the step's
    tokens, each at most k times; offsets still end inside the row."""
    rng = np.random.default_rng(22)
    L, T, k, E = 2, 6, 2, 5
    ids = gapped_ids(rng, L, T, k, E)
    ids[:, 0, :] = [1, 3]  # token 0 has both experts at every layer
    ids[:, 5, :] = [2, 0xFFFF]  # token 5 one: every row has padding, and token 0's two more are three
    plan = RoutingPlan.from_expert_ids([0, 1], ids, E)
    good = plan.expert_ids(E, T)
    offsets, tokens = mutate(plan.offsets, plan.token_indices)
    if field is None:
        got = RoutingPlan((0, 1), offsets, tokens).expert_ids(E, T)
        assert all(np.array_equal(got[layer], good[layer]) for layer in good)
        return
    with pytest.raises(InvalidRequestError) as e:
        RoutingPlan((0, 1), offsets, tokens).expert_ids(E, T)
    assert e.value.field == f"routing_plan.{field}" and "\n" not in str(e.value)
