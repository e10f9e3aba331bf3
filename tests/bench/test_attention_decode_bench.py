"""bench/attention_decode.py's host-side parts (the bench itself needs a GPU): case selection."""

import argparse

import pytest

from bench.attention_decode import CASES, SHAPES, _case


def test_every_case_can_be_named():
    for shape in SHAPES:
        for b, ctx in CASES:
            assert _case(f"{shape}:{b}:{ctx}") == (shape, b, ctx)


@pytest.mark.parametrize("text", ["qwen3moe-shape:x:2", "qwen3moe-shape:64", "llama:1:128", "qwen3moe-shape:2:128"])
def test_unknown_cases_are_refused_with_the_known_ones(text):
    with pytest.raises(argparse.ArgumentTypeError, match="one of mixtral-shape:1:128"):
        _case(text)
