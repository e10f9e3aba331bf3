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
    assert d == GenerationDefaults((7, 9), 0.6, 0.95, 20, 1.05, max_new_tokens=100)
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


def test_min_p_and_max_new_tokens_are_applied_where_requests_leave_them_unset():
    """They were read from the file and dropped: a model's min_p never applied, and its max_new_tokens gave way
    to the router's default (vLLM applies both)."""
    import random

    from common.pb import router_pb2
    from router_service.config import RouterConfig
    from router_service.validation import ModelLimits, validate_request

    min_p, most = round(random.uniform(0.01, 0.5), 3), random.randint(30, 60)
    d = GenerationDefaults.from_dict({"min_p": min_p, "max_new_tokens": most}, "m/gen.json")
    assert (d.min_p, d.max_new_tokens) == (min_p, most) and f"max_new_tokens={most}" in d.describe()
    config = RouterConfig(max_new_tokens=100, default_max_new_tokens=20)
    limits = ModelLimits(258, 4096, 4096, (256,), False, generation=d)

    def validated(**params):
        r = router_pb2.GenerateRequest(parameters=router_pb2.SamplingParameters(**params))
        r.token_ids.ids.extend([1, 2, 3])
        return validate_request(r, config, limits)

    unset = validated()
    assert unset.min_p == pytest.approx(min_p) and unset.max_new_tokens == most
    explicit = validated(min_p=0.7, max_new_tokens=5)
    assert explicit.min_p == pytest.approx(0.7) and explicit.max_new_tokens == 5
    assert validated(min_p=0.0).min_p == 0.0  # an explicit 0 turns the model's min_p off
    from router_service.openai_request import parse_request

    for body, want in (({}, min_p), ({"min_p": 0}, 0.0), ({"min_p": 0.2}, 0.2)):  # the OpenAI front: the same
        parsed = parse_request({"model": "m", "prompt": [1, 2], **body}, "completion", "m", d)
        r = router_pb2.GenerateRequest(parameters=parsed.parameters)
        r.token_ids.ids.extend([1, 2])
        assert validate_request(r, config, limits).min_p == pytest.approx(want), body
    capped = ModelLimits(258, 4096, 4096, (256,), False, generation=GenerationDefaults(max_new_tokens=10**6))
    r = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1]))
    assert validate_request(r, config, capped).max_new_tokens == 100  # the router's --max-new-tokens still caps it
    short = ModelLimits(258, 40, 40, (256,), False, generation=d)
    assert validate_request(r, config, short).max_new_tokens == min(most, 39)  # shortened to fit the context


@pytest.mark.parametrize("key,value", [("min_p", 1.5), ("min_p", -0.1), ("max_new_tokens", 0), ("max_new_tokens", 2.5)])
def test_min_p_and_max_new_tokens_out_of_range_are_left_out(key, value, caplog):
    with caplog.at_level(logging.WARNING):
        assert getattr(GenerationDefaults.from_dict({key: value}, "m/gen.json"), key) is None
    assert f"m/gen.json: {key} = {value!r}" in caplog.text


def test_several_choices_are_sized_with_the_models_default_length():
    """n choices without max_tokens were sized with the router's default_max_new_tokens even where the model's
    max_new_tokens applies: 8 x 1,000 tokens passed as 8 x 20 (and would hold the queue's head), and a model
    default of 20 was refused naming a max_tokens the client never sent."""
    from types import SimpleNamespace

    from common.errors import InvalidRequestError
    from common.pb import router_pb2
    from router_service.config import RouterConfig
    from router_service.openai_choices import _check_fits
    from router_service.openai_request import ParsedRequest
    from router_service.validation import ModelLimits

    config = RouterConfig(max_new_tokens=2000, default_max_new_tokens=20, max_concurrent_requests=64)

    def server(model_default):
        limits = ModelLimits(258, 8192, 4096, (), True, generation=GenerationDefaults(max_new_tokens=model_default))
        return SimpleNamespace(config=config, frontend=SimpleNamespace(check_ready=lambda: limits))

    chat = ParsedRequest(
        "chat", router_pb2.SamplingParameters(), n=8, best_of=8, max_tokens_name="max_completion_tokens"
    )
    with pytest.raises(InvalidRequestError, match=r"n 8 x the default max_completion_tokens 1000 = 8000 tokens"):
        _check_fits(server(1000), chat, 1)
    _check_fits(server(20), chat, 1)  # 8 x 20 fits
    chat.parameters.max_new_tokens = 600  # the client's own wins, and is named as sent
    with pytest.raises(InvalidRequestError, match=r"n 8 x max_completion_tokens 600 = 4800 tokens"):
        _check_fits(server(20), chat, 1)
