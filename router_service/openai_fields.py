"""Every request field of /v1/completions and /v1/chat/completions, in one of three sets: implemented, refused
(a 400 naming it unless its value asks for nothing) or ignored (accepted because it cannot change the output).
A field in none of them is refused as unknown, so nothing that changes what the caller gets is silently dropped.
docs/api.md has the same table with the reasons; tests/router_service/test_openai_strict.py holds the two equal.
"""

from __future__ import annotations

import json

from router_service.errors import clipped

# Read by router_service.openai_request.parse_request.
IMPLEMENTED_BOTH = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_k",
        "min_p",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
        "repetition_penalty",
        "prompt_logprobs",
        "truncate_prompt_tokens",
        # constrained decoding (router_service/openai_constraints.py): at most one of these per request
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "n",
        "cache_salt",
    }
)
IMPLEMENTED = {
    "completion": IMPLEMENTED_BOTH | {"prompt", "best_of", "echo"},
    "chat": IMPLEMENTED_BOTH
    | {
        "messages",
        "top_logprobs",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
}

# Accepted and not read: none of them changes the tokens or the text of the answer.
IGNORED_BOTH = frozenset(
    {
        "user",  # an end-user id for the provider's abuse monitoring
        "guided_decoding_backend",  # which engine computes the masks: the output's language is the same (llguidance)
    }
)
IGNORED = {
    "completion": IGNORED_BOTH,
    "chat": IGNORED_BOTH
    | {
        "safety_identifier",  # user's successor in OpenAI's API
        "metadata",  # tags for OpenAI's stored completions
        "store",  # OpenAI keeps the completion for its dashboard; nothing is stored here
        "service_tier",  # a latency / price tier: how fast, not what
        "prompt_cache_key",  # cache-routing hints: speed only
        "prompt_cache_retention",
        "prompt_cache_options",
        "prediction",  # predicted outputs only speed decoding up; the text is the model's either way
    },
}

# The values that ask for nothing (the fields' defaults): accepted, so clients that send defaults keep working;
# null is always accepted. Any other value is a 400 naming the field.
SAMPLING_REFUSED: dict[str, tuple[object, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1,),  # beam search's
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),  # generated text always leaves special tokens out
    "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "logits_processors": ([],),
    "priority": (0,),  # as vLLM without its priority scheduler: the router serves in arrival order
    "request_id": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "kv_transfer_params": (),
    "vllm_xargs": (),
}
REFUSED: dict[str, dict[str, tuple[object, ...]]] = {
    "completion": SAMPLING_REFUSED
    | {
        "suffix": ("",),
        "add_special_tokens": (True,),  # a text prompt gets the tokenizer's special tokens
        "prompt_embeds": (),
    },
    "chat": SAMPLING_REFUSED
    | {
        "best_of": (1,),  # completions only, as in OpenAI's API
        "echo": (False,),
        "add_special_tokens": (False,),  # the template places them
        "functions": ([],),  # OpenAI's deprecated form of tools (its answers carry function_call)
        "function_call": ("none", "auto"),
        "audio": (),
        "modalities": (["text"],),
        "moderation": (),
        "reasoning_effort": (),
        "verbosity": (),
        "web_search_options": (),
        "documents": ([],),
        "chat_template": (),
        "mm_processor_kwargs": ({},),
        "include_reasoning": (True,),  # nothing is split out as reasoning: all of it is in the content
    },
}
TOOLS_HINT = '; send tools=[{"type": "function", "function": {...}}] and tool_choice instead'
HINTS = {"request_id": "; set the X-Request-Id header instead", "functions": TOOLS_HINT, "function_call": TOOLS_HINT}

STREAM_OPTIONS_IMPLEMENTED = frozenset({"include_usage"})
STREAM_OPTIONS_REFUSED: dict[str, tuple[object, ...]] = {
    "continuous_usage_stats": (False,),
    "include_obfuscation": (False,),
}
# The chat template gets these (router_service.tool_request turns the tool fields into what templates expect).
MESSAGE_IMPLEMENTED = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
MESSAGE_REFUSED: dict[str, tuple[object, ...]] = {
    "function_call": (),  # the deprecated form of tool_calls
    "refusal": (),
    "audio": (),
    "annotations": ([],),  # an answer's citations, echoed back with its message
}
# OpenAI's message roles (function: the deprecated form of tool); any other is a 400 naming them, as OpenAI's. The
# gRPC front takes any role its template knows.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# The openai package's own parse of the content (`chat.completions.parse`, its stream helper): echoed back with the
# message it came in, it repeats the content the template sees.
MESSAGE_IGNORED = frozenset({"parsed"})
# A text part's keys (router_service/chat.py refuses parts of other types); any other key is refused, as a message's.
TEXT_PART_IMPLEMENTED = frozenset({"type", "text"})
ENDPOINTS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _same(value: object, neutral: object) -> bool:
    """JSON equality: 1 and 1.0 are equal, true and 1 are not."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def _refusal(param: str, value: object, neutral: tuple[object, ...], hint: str = "") -> str | None:
    if value is None or any(_same(value, n) for n in neutral):
        return None
    accepted = " or ".join(json.dumps(n) for n in neutral)
    return f"{param}: not supported by this server" + (f" (accepted only as {accepted})" if accepted else "") + hint


def refused_field(body: dict, kind: str) -> tuple[str, str] | None:
    """The first field of `body` the router would not honour, as (param, message); None when there is none."""
    implemented, ignored, refused = IMPLEMENTED[kind], IGNORED[kind], REFUSED[kind]
    for name, value in body.items():
        if name in implemented or name in ignored:
            continue
        if name in refused:
            message = _refusal(name, value, refused[name], HINTS.get(name, ""))
            if message:
                return name, message
            continue
        return name, f"{name}: not a field of {ENDPOINTS[kind]} (in neither OpenAI's nor vLLM's API)"
    if body.get("cache_salt") == "":  # a tenant id left unset would share the unsalted cache; vLLM refuses it too
        return "cache_salt", "cache_salt: must not be empty (leave it out or null for no salt)"
    options = body.get("stream_options")
    if isinstance(options, dict):
        found = _refused_keys("stream_options", options, STREAM_OPTIONS_IMPLEMENTED, STREAM_OPTIONS_REFUSED)
        if found:
            return found
    messages = body.get("messages") if kind == "chat" else None
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(message, dict):
            found = _refused_keys(f"messages[{i}]", message, MESSAGE_IMPLEMENTED | MESSAGE_IGNORED, MESSAGE_REFUSED)
            found = found or _refused_part_keys(f"messages[{i}].content", message.get("content"))
            if found:
                return found
    return None


def _refused_part_keys(where: str, content) -> tuple[str, str] | None:
    """The first unknown key of a text part of a message's `content` list, as (param, message)."""
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if isinstance(part, dict) and part.get("type") == "text":
            found = _refused_keys(f"{where}[{j}]", part, TEXT_PART_IMPLEMENTED, {})
            if found:
                return found
    return None


def _refused_keys(
    where: str, obj: dict, implemented: frozenset[str], refused: dict[str, tuple[object, ...]]
) -> tuple[str, str] | None:
    for name, value in obj.items():
        param = f"{where}.{name}"
        if name in implemented:
            continue
        if name not in refused:
            return param, f"{param}: unknown field"
        message = _refusal(param, value, refused[name])
        if message:
            return param, message
    return None


def message_problem(message: dict, where: str) -> tuple[str, str] | None:
    """(param, message) for a chat message OpenAI refuses from its role alone: a role not one of CHAT_ROLES (or not
    a string), a tool result without the tool_call_id of the call it answers. None when it is taken."""
    role, roles = message.get("role"), ", ".join(CHAT_ROLES)
    if "role" not in message:
        return f"{where}.role", f"{where}.role: required, one of {roles}"
    if role not in CHAT_ROLES:  # a list or an object too: never in the tuple
        got = clipped(json.dumps(role, ensure_ascii=False))
        return f"{where}.role", f"{where}.role: must be one of {roles}, got {got}"
    if role == "tool" and message.get("tool_call_id") is None:
        return f"{where}.tool_call_id", f"{where}.tool_call_id: required for role tool (the id of the call answered)"
    return None
