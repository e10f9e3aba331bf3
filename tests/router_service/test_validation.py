"""Every GenerateRequest field is validated: each case names the field, the limit and the value."""

import math
import re

import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.pb import router_pb2
from router_service import validation
from router_service.config import RouterConfig
from router_service.validation import ModelLimits, validate_request
from tests.helpers import byte_ids

CONFIG = RouterConfig(
    max_new_tokens=100,
    default_max_new_tokens=20,
    max_stop_sequences=2,
    max_stop_sequence_length=8,
    max_request_id_length=16,
    max_stop_token_ids=3,
)
LIMITS = ModelLimits(
    vocab_size=258, max_sequence_length=64, kv_capacity_tokens=1000, eos_token_ids=(256,), has_tokenizer=True
)


def req(ids=(1, 2, 3), text=None, request_id="", **params):
    r = router_pb2.GenerateRequest(request_id=request_id, parameters=router_pb2.SamplingParameters(**params))
    if text is not None:
        r.text = text
    elif ids is not None:
        r.token_ids.ids.extend(ids)
    return r


def test_cache_salt_is_bounded_and_carried():
    r = req()
    r.cache_salt = "é" * 128  # 256 bytes
    assert validate_request(r, CONFIG, LIMITS).cache_salt == r.cache_salt
    r.cache_salt += "x"
    with pytest.raises(InvalidRequestError, match="cache_salt: must be at most 256 bytes, got 257"):
        validate_request(r, CONFIG, LIMITS)


CASES = [
    # (name, request, limits override, field, words the message must contain)
    ("prompt missing", req(ids=None), {}, "prompt", ["text or token_ids"]),
    ("empty ids", req(ids=()), {}, "token_ids.ids", ["empty"]),
    ("empty text", req(text=""), {}, "text", ["empty"]),
    ("id = vocab", req(ids=(1, 258)), {}, "token_ids.ids[1]", ["[0, 258)", "258"]),
    ("id huge", req(ids=(2**32 - 1,)), {}, "token_ids.ids[0]", ["4294967295"]),
    ("text without tokenizer", req(text="hi"), {"tokenizer": None}, "text", ["tokenizer"]),
    ("stop id out of vocab", req(stop_token_ids=[5, 300]), {}, "parameters.stop_token_ids[1]", ["258", "300"]),
    ("too many stop ids", req(stop_token_ids=[1, 2, 3, 4]), {}, "parameters.stop_token_ids", ["3", "4"]),
    ("temperature negative", req(temperature=-1), {}, "parameters.temperature", ["0.01", "-1"]),
    ("temperature nan", req(temperature=math.nan), {}, "parameters.temperature", ["nan"]),
    ("temperature inf", req(temperature=math.inf), {}, "parameters.temperature", ["inf"]),
    ("top_p above 1", req(top_p=1.5), {}, "parameters.top_p", ["(0, 1] (0 = the model's default, else 1)", "1.5"]),
    ("top_p negative", req(top_p=-0.1), {}, "parameters.top_p", ["(0, 1]"]),
    ("top_p nan", req(top_p=math.nan), {}, "parameters.top_p", ["nan"]),
    ("top_k above vocab", req(top_k=259), {}, "parameters.top_k", ["258", "259", "0 = the model's default, else off"]),
    ("min_p above 1", req(min_p=1.5), {}, "parameters.min_p", ["[0, 1]", "1.5"]),
    ("min_p negative", req(min_p=-0.1), {}, "parameters.min_p", ["[0, 1]"]),
    ("min_p nan", req(min_p=math.nan), {}, "parameters.min_p", ["nan"]),
    ("bias id = vocab", req(logit_bias={5: 1.0, 258: 1.0}), {}, "parameters.logit_bias[258]", ["[0, 258)"]),
    ("bias above 100", req(logit_bias={123: 100.5}), {}, "parameters.logit_bias[123]", ["[-100, 100]", "100.5"]),
    ("bias below -100", req(logit_bias={7: -101.0}), {}, "parameters.logit_bias[7]", ["-101"]),
    ("bias nan", req(logit_bias={7: math.nan}), {}, "parameters.logit_bias[7]", ["nan"]),
    ("bias inf", req(logit_bias={7: math.inf}), {}, "parameters.logit_bias[7]", ["inf"]),
    (
        "too many biases",
        req(logit_bias={i: 1.0 for i in range(301)}, ids=[1]),
        {"limits": ModelLimits(1000, 64, 1000, (), False)},
        "parameters.logit_bias",
        ["300", "301"],
    ),
    ("max_new_tokens above cap", req(max_new_tokens=101), {}, "parameters.max_new_tokens", ["100", "101"]),
    ("max_new_tokens 2^32-1", req(max_new_tokens=2**32 - 1), {}, "parameters.max_new_tokens", ["4294967295"]),
    (
        "prompt + max_new over context",
        req(ids=[1] * 60, max_new_tokens=5),
        {},
        "parameters.max_new_tokens",
        ["max_sequence_length", "64", "60", "5"],
    ),
    (
        "prompt + max_new over KV",
        req(ids=[1] * 10, max_new_tokens=30),
        {"limits": ModelLimits(258, 64, 32, (256,), True)},
        "parameters.max_new_tokens",
        ["KV capacity", "32"],
    ),
    ("prompt fills context", req(ids=[1] * 64), {}, "prompt", ["64", "no room"]),
    ("min > max", req(max_new_tokens=5, min_new_tokens=6), {}, "parameters.min_new_tokens", ["5", "6"]),
    ("too many stops", req(stop_sequences=["a", "b", "c"]), {}, "parameters.stop_sequences", ["2", "3"]),
    ("empty stop", req(stop_sequences=["a", ""]), {}, "parameters.stop_sequences[1]", ["empty"]),
    ("long stop", req(stop_sequences=["x" * 9]), {}, "parameters.stop_sequences[0]", ["8", "9"]),
    (
        "stops without tokenizer",
        req(stop_sequences=["x"]),
        {"limits": ModelLimits(258, 64, 1000, (), False)},
        "parameters.stop_sequences",
        ["tokenizer"],
    ),
    ("request_id too long", req(request_id="r" * 17), {}, "request_id", ["16", "17"]),
    ("request_id control chars", req(request_id="a\nb"), {}, "request_id", ["printable"]),
]


@pytest.mark.parametrize("name,request_,override,field,words", CASES, ids=[c[0] for c in CASES])
def test_invalid(name, request_, override, field, words, tokenizer):
    tok = override.get("tokenizer", tokenizer)
    with pytest.raises(InvalidRequestError) as err:
        validate_request(request_, CONFIG, override.get("limits", LIMITS), tok)
    assert err.value.field == field
    message = str(err.value)
    assert message.startswith(field + ":")
    for word in words:
        assert word in message, (word, message)


def test_defaults_applied(tokenizer):
    v = validate_request(req(text="hi"), CONFIG, LIMITS, tokenizer)
    assert v.prompt_ids == tuple(byte_ids("hi"))
    assert v.max_new_tokens == 20 and v.top_p == 1.0 and v.top_k == 0 and v.temperature == 0.0
    assert 0 <= v.seed < 2**64
    assert validate_request(req(seed=0), CONFIG, LIMITS, None).seed == 0


def test_default_max_new_tokens_shrinks_to_fit_context():
    v = validate_request(req(ids=[1] * 60), CONFIG, LIMITS, None)
    assert v.max_new_tokens == 4


def test_valid_edges_pass(tokenizer):
    v = validate_request(
        req(
            ids=[0, 257],
            top_p=1.0,
            top_k=258,
            temperature=2.0,
            max_new_tokens=62,
            min_new_tokens=62,
            stop_sequences=["12345678", "b"],
            stop_token_ids=[0, 1, 257],
            request_id="r" * 16,
        ),
        CONFIG,
        LIMITS,
        tokenizer,
    )
    assert v.max_new_tokens == 62 and v.stop_token_ids == (0, 1, 257) and v.request_id == "r" * 16


def test_min_p_and_logit_bias_edges_pass():
    bias = {i: -100.0 if i % 2 else 100.0 for i in range(258 - 300, 258) if i >= 0} | {0: 0.5}
    v = validate_request(req(min_p=1.0, logit_bias=bias), CONFIG, LIMITS, None)
    assert v.min_p == 1.0 and v.logit_bias == tuple(sorted(bias.items()))
    assert validate_request(req(), CONFIG, LIMITS, None).logit_bias == ()


@pytest.mark.parametrize("bad", [0, 17, 47])
@pytest.mark.parametrize("value", [LIMITS.vocab_size, 2**32 - 1])
def test_out_of_range_id_is_named_at_its_index_in_a_long_prompt(bad, value):
    """The id check runs as one vectorised pass; the first bad id of a prompt is still the one named, at its index
    (just above the vocabulary, and the field's uint32 top), and the same prompt with valid ids passes whole."""
    ids = np.random.default_rng(bad).integers(0, LIMITS.vocab_size, 48).tolist()
    assert validate_request(req(ids=ids, max_new_tokens=1), CONFIG, LIMITS).prompt_ids == tuple(ids)
    wrong = list(ids)
    wrong[bad] = wrong[-1] = value  # a later bad id too: the first is reported
    with pytest.raises(InvalidRequestError, match=re.escape(f"token_ids.ids[{bad}]: ") + f".*got {value}$"):
        validate_request(req(ids=wrong, max_new_tokens=1), CONFIG, LIMITS)


@pytest.mark.parametrize("truncate", [0, 5, 100])
def test_prompt_bytes_are_the_prompt_ids_as_uint32_little_endian(truncate, tokenizer):
    """What the prefix cache hashes in place of prompt_ids: the same ids, truncated alike, for a token-id prompt
    and for a tokenized text."""
    ids = np.random.default_rng(truncate).integers(0, LIMITS.vocab_size, 40).tolist()
    kept = ids[-truncate:] if truncate else ids
    for request in (req(ids=ids, max_new_tokens=1), req(text="hello, world", max_new_tokens=1)):
        request.parameters.truncate_input_tokens = truncate
        v = validate_request(request, CONFIG, LIMITS, tokenizer)
        assert v.prompt_bytes == np.asarray(v.prompt_ids, "<u4").tobytes()
    assert validate_request(
        req(ids=ids, max_new_tokens=1, truncate_input_tokens=truncate), CONFIG, LIMITS
    ).prompt_ids == tuple(kept)


@pytest.mark.parametrize("truncate", [0, 3, 4, 5])
def test_prompt_truncated_says_whether_truncate_input_tokens_cut(truncate, tokenizer):
    """Set only when tokens were dropped (a prompt of exactly truncate_input_tokens tokens keeps them all), and kept
    by revalidate, whose text prompt's ids are the ones already kept."""
    for request in (req(ids=(1, 2, 3, 4), max_new_tokens=1), req(text="abcd", max_new_tokens=1)):
        request.parameters.truncate_input_tokens = truncate
        v = validate_request(request, CONFIG, LIMITS, tokenizer)
        assert len(v.prompt_ids) == min(truncate or 4, 4) and v.prompt_truncated == (truncate == 3), request
        assert validation.revalidate(request, CONFIG, LIMITS, tokenizer, v).prompt_truncated == v.prompt_truncated


@pytest.mark.parametrize("value", [-1, 2**32, 2**64, LIMITS.vocab_size])
def test_a_list_of_ids_that_does_not_fit_uint32_is_checked_as_before(value):
    """A tokenizer's list of ids goes through array("I"); one that cannot (negative, too large)
    through the element-wise check, which names the first bad id at its index."""
    ids = [3, 4, 5, value, 6, value]
    with pytest.raises(InvalidRequestError, match=re.escape("text (tokenized)[3]: ") + f".*got {value}$"):
        validation.check_ids("text (tokenized)", ids, LIMITS.vocab_size)
    assert validation.check_ids("text (tokenized)", [3, 4, 257], LIMITS.vocab_size).tolist() == [3, 4, 257]
    assert validation.check_ids("text (tokenized)", [], LIMITS.vocab_size) is None


@pytest.mark.parametrize(
    "field,value,shown",
    [
        ("top_p", 1.0000001, "1.0000001"),
        ("temperature", 100.0001, "100.0001"),
        ("min_p", 1.0000001, "1.0000001"),
        ("presence_penalty", 2.0000002, "2.0000002"),
        ("repetition_penalty", -0.0, "-0"),
        ("temperature", 1e30, "1e+30"),
        ("top_p", 1.5, "1.5"),
    ],
)
def test_an_out_of_range_number_is_shown_as_it_differs_from_the_bound(field, value, shown, tokenizer):
    """Shown with six significant digits, a float32 just past a bound read as the bound itself (top_p 1.0000001:
    "must be in (0, 1] ..., got 1")."""
    with pytest.raises(InvalidRequestError) as err:
        validate_request(req(**{field: value}), CONFIG, LIMITS, tokenizer)
    assert err.value.field == f"parameters.{field}" and str(err.value).endswith(f"got {shown}"), str(err.value)
