"""generation_config.json read as request defaults: the keys applied, values out of range left out (with a
warning naming the file and key), files that are missing, not JSON or not an object."""

from __future__ import annotations

import json
import logging

import pytest

from router_service.generation_defaults import GenerationDefaults


def test_reads_the_sampling_defaults_and_eos_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [7, 9],
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "do_sample": True,
                "max_new_tokens": 100,
            }
        )
    )
    d = GenerationDefaults.from_model_dir(tmp_path)
    assert d == GenerationDefaults((7, 9), 0.6, 0.95, 20, 1.05)
    assert "temperature=0.6" in d.describe() and "eos_token_ids=[7, 9]" in d.describe()


def test_a_single_eos_id_and_greedy_temperature():
    d = GenerationDefaults.from_dict({"eos_token_id": 2, "temperature": 0})
    assert d.eos_token_ids == (2,) and d.temperature == 0.0 and d.top_p is None


@pytest.mark.parametrize(
    "key,value",
    [
        ("temperature", 0.001),
        ("temperature", -1),
        ("temperature", 1000),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", "1.1"),
        ("temperature", True),
    ],
)
def test_values_out_of_range_are_left_out_with_a_warning(key, value, caplog):
    with caplog.at_level(logging.WARNING):
        d = GenerationDefaults.from_dict({key: value, "top_p" if key != "top_p" else "top_k": 1}, "m/gen.json")
    assert getattr(d, key) is None
    assert f"m/gen.json: {key} = {value!r}" in caplog.text


def test_bad_eos_entries_are_ignored(caplog):
    with caplog.at_level(logging.WARNING):
        assert GenerationDefaults.from_dict({"eos_token_id": [3, -1, "x", True]}).eos_token_ids == (3,)
    assert "eos_token_id" in caplog.text


@pytest.mark.parametrize("text", [None, "{not json", "[1, 2]"])
def test_missing_or_unreadable_files_give_no_defaults(tmp_path, text):
    if text is not None:
        (tmp_path / "generation_config.json").write_text(text)
    assert GenerationDefaults.from_model_dir(tmp_path) == GenerationDefaults()
    assert GenerationDefaults.from_model_dir("") == GenerationDefaults()
