"""OpenAI request bodies -> the router's parameters (router_service/openai_request.py): what is refused, and how
the 400 names it."""

import pytest

from router_service.openai_errors import ApiError
from router_service.openai_request import parse_request


def refusal(body: dict, kind: str = "completion") -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(body, kind, "m")
    assert e.value.status == 400 and "\n" not in e.value.message
    return e.value


@pytest.mark.parametrize("keys", [("5", "05"), ("007", "7"), ("12", "0012")])
def test_logit_bias_keys_naming_one_token_twice_are_refused(keys):
    """Both keys became one token id and the later bias silently replaced the earlier."""
    error = refusal({"prompt": "x", "logit_bias": {keys[0]: 5, keys[1]: -5}})
    assert error.param == f"logit_bias[{keys[1]}]" and f"logit_bias[{keys[0]}]" in error.message


def test_logit_bias_with_distinct_tokens_is_kept_whole():
    bias = parse_request({"prompt": "x", "logit_bias": {"5": 1, "50": -2, "0": 3}}, "completion", "m")
    assert dict(bias.parameters.logit_bias) == {5: 1.0, 50: -2.0, 0: 3.0}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_truncate_prompt_tokens_zero_is_refused(kind):
    """0 reached the router as its "off" and the prompt went whole: a request to keep no token served as one that
    cuts nothing. vLLM refuses it too (at least 1)."""
    body = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "x"}]}
    error = refusal({**body, "truncate_prompt_tokens": 0}, kind)
    assert error.param == "truncate_prompt_tokens" and "got 0" in error.message
    assert parse_request({**body, "truncate_prompt_tokens": None}, kind, "m").parameters.truncate_input_tokens == 0
    assert parse_request({**body, "truncate_prompt_tokens": 1}, kind, "m").parameters.truncate_input_tokens == 1


@pytest.mark.parametrize(
    "prompt,param,says",
    [
        ([1, 2.5], "prompt[1]", "a token id must be an integer, got float"),
        ([1, True], "prompt[1]", "a token id must be an integer, got bool"),
        ([7, "a"], "prompt[1]", "a token id must be an integer, got str"),
        (["a", [1, 2.0]], "prompt[1][1]", "a token id must be an integer, got float"),
        (["a", 3], "prompt[1]", "must be a string or a list of token ids, got int"),
        ([[1], {"x": 1}], "prompt[1]", "must be a string or a list of token ids, got dict"),
        ({"x": 1}, "prompt", "must be a string or a list of token ids, got dict"),
        ([[]], "prompt[0]", "must not be empty"),
        ([], "prompt", "must not be empty"),
    ],
)
def test_a_malformed_prompt_names_the_element_and_what_is_wrong(prompt, param, says):
    """A token-id list holding one float, or a prompt list holding one number, was "prompt: required, a string or a
    list of token ids": the whole prompt named, as if it were missing."""
    error = refusal({"prompt": prompt})
    assert (error.param, error.message) == (param, f"{param}: {says}")


def test_a_missing_prompt_is_required():
    for body in ({}, {"prompt": None}):
        assert refusal(body).message == "prompt: required, a string or a list of token ids"


ROLES = "system, developer, user, assistant, tool, function"


@pytest.mark.parametrize(
    "message, got",
    [
        ({"role": "bogus", "content": "x"}, '"bogus"'),
        ({"role": "User", "content": "x"}, '"User"'),  # OpenAI's roles are lower case
        ({"role": "", "content": "x"}, '""'),
        ({"role": 3, "content": "x"}, "3"),
        ({"role": ["user"], "content": "x"}, '["user"]'),
        ({"role": None, "content": "x"}, "null"),
        ({"content": "x"}, None),
    ],
)
def test_a_role_not_openais_is_refused_naming_the_roles(message, got):
    """A role OpenAI does not have was rendered as sent (or failed in the template, as a chat template error):
    OpenAI answers 400 naming messages[i].role and its roles."""
    error = refusal({"messages": [{"role": "user", "content": "x"}, message]}, "chat")
    assert error.param == "messages[1].role" and error.type == "invalid_request_error"
    assert error.message.startswith("messages[1].role: ") and ROLES in error.message, error.message
    assert (got is None and "required" in error.message) or f"got {got}" in error.message, error.message


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "function"])
def test_openais_roles_are_taken(role):
    parsed = parse_request({"messages": [{"role": role, "content": "x", "name": "n"}]}, "chat", "m")
    assert parsed.messages[0]["role"] == role


def test_a_tool_message_without_tool_call_id_is_refused():
    """OpenAI requires a tool result to name the call it answers; one naming a call no earlier message made is the
    template's to judge (docs/api.md), and is taken."""
    for tool in ({"role": "tool", "content": "1"}, {"role": "tool", "content": "1", "tool_call_id": None}):
        error = refusal({"messages": [{"role": "user", "content": "x"}, tool]}, "chat")
        assert error.param == "messages[1].tool_call_id" and "required for role tool" in error.message, error.message
    unknown = {"role": "tool", "content": "1", "tool_call_id": "call_nobody_made"}
    assert parse_request({"messages": [{"role": "user", "content": "x"}, unknown]}, "chat", "m").messages[1] == unknown
