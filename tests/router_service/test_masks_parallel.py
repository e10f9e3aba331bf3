"""masks_of computes several requests' masks at once on llguidance's executor: every row equals the mask the
request's matcher computes alone, at every step of random walks through different grammars, and a matcher that
fails gets the any-token mask and its error while the others' rows stay exact."""

from __future__ import annotations

import types

import numpy as np
import pytest

from router_service import constraints
from router_service.constraints import Constraint, ConstraintCompiler, masks_of
from tests.helpers import byte_ids

VOCAB, EOS = 259, 2
KINDS = [
    Constraint.json_schema('{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}'),
    Constraint("regex", "[a-z]{2,9}( [0-9]+)?"),
    Constraint("choice", ("yes", "no", "maybe later")),
    Constraint.json_schema('{"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 5}'),
]


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return ConstraintCompiler((tiny_model / "tokenizer.json").read_text(), VOCAB, [EOS])


def allowed(mask: bytes) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:VOCAB])


@pytest.mark.parametrize("seed", range(3))
def test_parallel_rows_equal_single_masks_along_random_walks(compiler, seed):
    rng = np.random.default_rng(seed)
    picks = [KINDS[int(k)] for k in rng.integers(0, len(KINDS), 9)]
    batch = {i: types.SimpleNamespace(matcher=compiler.matcher(c), grammar_error="") for i, c in enumerate(picks)}
    alone = {i: compiler.matcher(c) for i, c in enumerate(picks)}
    for _ in range(12):
        live = [i for i in batch if not batch[i].matcher.is_stopped]
        if len(live) < constraints.MIN_PARALLEL_MASKS:
            break
        rows = masks_of(live + [99], batch, VOCAB)  # 99: no such request, skipped
        assert sorted(rows) == live
        for i in live:
            assert rows[i] == alone[i].mask(), f"request {i} ({picks[i].kind})"
            token = int(rng.choice(allowed(rows[i])))
            batch[i].matcher.consume(token)
            alone[i].consume(token)


def test_the_parallel_path_is_taken_and_a_failing_matcher_fails_alone(compiler, monkeypatch):
    calls = []
    real = constraints.GrammarMatcher.mask
    monkeypatch.setattr(constraints.GrammarMatcher, "mask", lambda self: calls.append(1) or real(self))
    ok = compiler.matcher(KINDS[1])
    done = compiler.matcher(Constraint("regex", "ab"), ignore_eos=True)  # complete: nothing may follow
    for token in byte_ids("ab"):
        done.consume(token)
    requests = {
        1: types.SimpleNamespace(matcher=ok, grammar_error=""),
        2: types.SimpleNamespace(matcher=done, grammar_error=""),
    }
    rows = masks_of([1, 2], requests, VOCAB)
    assert not calls  # both rows came from the executor
    assert rows[1] == compiler.matcher(KINDS[1]).mask()
    assert rows[2] == constraints.any_token_mask(VOCAB) and "allows no next token" in requests[2].grammar_error
    assert not requests[1].grammar_error
