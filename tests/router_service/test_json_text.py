"""JSON text read as the standard has it (router_service/json_text.py)."""

import pytest

from router_service.json_text import strict_json


@pytest.mark.parametrize(
    "text",
    ['{"a": "\\ud800"}', '{"\\udfff": 1}', '["x\\uDC00y"]', '"\\ud83d"', '{"a": ["\\ud83d\\u0041"]}'],
)
def test_a_lone_surrogate_escape_is_not_json_text(text):
    """A lone surrogate escape is no character: a value holding one cannot be encoded as UTF-8 later (protobuf,
    the tokenizer), which was an internal error instead of the caller's 400."""
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        strict_json(text)


def test_surrogate_pairs_and_plain_text_still_parse():
    assert strict_json('{"e": "\\ud83d\\ude00", "k": "\\\\ud800"}') == {"e": "\U0001f600", "k": "\\ud800"}
    assert strict_json('{"\\ud83d\\ude00": [1, "\\u00e9"]}') == {"\U0001f600": [1, "\u00e9"]}


@pytest.mark.parametrize("name", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_constants_are_not_json_text(name):
    with pytest.raises(ValueError, match="not a JSON number"):
        strict_json(f'{{"a": {name}}}')
