"""A model with several EOS ids: llguidance is given one (older releases take no list), and the matcher itself
allows or forbids every EOS id where the grammar accepts, and takes any of them as the end of the output."""

import numpy as np
import pytest

from router_service.constraints import Constraint, ConstraintCompiler, GrammarError
from tests.helpers import byte_ids

EOS_IDS = (2, 1)  # the tokenizer's own EOS first, then another special id the model also ends with


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return ConstraintCompiler((tiny_model / "tokenizer.json").read_text(), 259, EOS_IDS)


def allowed(mask: bytes) -> set[int]:
    words = np.frombuffer(mask, "<u4")
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def matcher_after(compiler, text: str):
    matcher = compiler.matcher(Constraint("regex", "ab"))
    for token in byte_ids(text):
        assert token in allowed(matcher.mask())
        matcher.consume(token)
    return matcher


def test_no_eos_id_is_allowed_before_the_grammar_accepts(compiler):
    mask = allowed(matcher_after(compiler, "a").mask())
    assert mask == {byte_ids("b")[0]}


@pytest.mark.parametrize("eos", EOS_IDS)
def test_every_eos_id_ends_a_complete_output(compiler, eos):
    matcher = matcher_after(compiler, "ab")
    assert set(EOS_IDS) <= allowed(matcher.mask())
    matcher.consume(eos)  # the second id is unknown to llguidance as EOS: it must still end the output
    assert matcher.is_stopped


def test_with_ignore_eos_no_eos_id_is_ever_allowed(compiler):
    """A complete output then offers nothing: the grammar is stopped, and a mask asked for anyway is an error."""
    matcher = compiler.matcher(Constraint("regex", "ab"), ignore_eos=True)
    for token in byte_ids("ab"):
        assert not set(EOS_IDS) & allowed(matcher.mask())
        matcher.consume(token)
    assert matcher.is_stopped
    with pytest.raises(GrammarError, match="allows no next token"):
        matcher.mask()


def test_a_token_outside_the_mask_is_the_samplers_fault(compiler):
    matcher = compiler.matcher(Constraint("regex", "ab"))
    matcher.mask()
    with pytest.raises(GrammarError) as e:
        matcher.consume(EOS_IDS[1])
    assert e.value.outside_mask
