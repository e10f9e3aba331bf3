"""OpenAI request bodies -> the router's SamplingParameters and GenerateRequests, every malformed field a 400
naming it (router_service/openai_errors.py). No I/O here (router_service/http_api.py).

Accepted: OpenAI's fields (n, completions' best_of and prompt lists, logprobs and top_logprobs, presence and
frequency penalties, logit_bias included; router_service/openai_choices.py serves more than one choice) and vLLM's
usual extensions (top_k, min_p, min_tokens, stop_token_ids, ignore_eos, repetition_penalty, prompt_logprobs,
add_generation_prompt, continue_final_message, chat_template_kwargs). Every other field is refused with 400 naming
it, unless it asks for nothing or cannot change the output (router_service/openai_fields.py has the table). A
sampling field left out takes the model's generation_config.json default when it has one (OpenAI's default
otherwise), as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.pb import router_pb2
from router_service import constraints, errors, openai_fields, tool_request
from router_service.errors import clipped
from router_service.frontend import ChatOptions
from router_service.generation_defaults import MIN_TEMPERATURE, GenerationDefaults
from router_service.openai_constraints import ConstraintFieldError, request_constraint
from router_service.openai_errors import ApiError

MAX_UINT32 = (1 << 32) - 1
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
MAX_LOGPROBS = 20  # top_logprobs (chat), logprobs (completions) and prompt_logprobs
MAX_CHOICES = 128  # samples one HTTP request may ask for: best_of (or n) times the prompts
FLOAT32_TINIEST = 2.0**-149  # the smallest positive float32 (a subnormal)


@dataclass
class ParsedRequest:
    """A request body, checked and converted: the router's parameters and what answering it over HTTP needs."""

    kind: str  # "completion" or "chat"
    parameters: router_pb2.SamplingParameters
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    prompt: str | list[int] | None = None  # completion: the first (usually only) prompt
    prompts: list = field(default_factory=list)  # completion: every prompt of a prompt list
    prompt_list: bool = False  # completion: the prompt came as a list of prompts (a 400 names prompt[i])
    n: int = 1  # choices per prompt
    best_of: int = 1  # samples per prompt, the n most likely returned (completions, not streamed)
    echo: bool = False  # completions: each choice starts with its prompt (router_service/openai_echo.py)
    cache_salt: str = ""
    messages: list = field(default_factory=list)  # chat
    chat_options: ChatOptions = ChatOptions()
    max_tokens_name: str = "max_tokens"
    constraint_name: str = "constraint"  # the request field a constraint came from (its 400s name it)


def _get(body: dict, name: str, types, default=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"{name}: must be {what}, got {value!r}", param=name)
    if not isinstance(value, types):
        raise ApiError(400, f"{name}: must be {what}, got {type(value).__name__}", param=name)
    return value


def _int(body, name, default=None, low=0, high=MAX_UINT32):
    value = _get(body, name, int, default, "an integer")
    if value is not None and not low <= value <= high:
        shown = value if abs(value) < 10**errors.MAX_ECHO else f"an integer of {len(str(abs(value)))} digits"
        raise ApiError(400, f"{name}: must be in [{low}, {high}], got {shown}", param=name)
    return value


def _float(body, name, default):
    value = _get(body, name, (int, float), default, "a number")
    try:
        value = float(value)
    except OverflowError:  # JSON integers have any number of digits; float() refuses past ~1.8e308
        raise ApiError(
            400, f"{name}: must be a number in float range, got an integer of {len(str(abs(value)))} digits", param=name
        ) from None
    # The fields are float32: a nonzero value below its range would become 0, which means "off" or "the model's
    # default" (top_p 1e-50 would sample the whole vocabulary); the smallest float32 keeps the sign and intent.
    return math.copysign(FLOAT32_TINIEST, value) if 0 < abs(value) < FLOAT32_TINIEST else value


def _logit_bias(body) -> dict[int, float]:
    """OpenAI's {"token id": bias} (the keys are strings, JSON's only kind); the router checks ids and ranges."""
    raw = _get(body, "logit_bias", dict, {}, "an object of token id -> bias")
    bias: dict[int, float] = {}
    keys: dict[int, str] = {}  # token id -> the key that gave it a bias
    for key, value in raw.items():
        param = f"logit_bias[{key}]"
        # int() refuses a string of more than 4,300 digits (a ValueError): a token id has at most 10
        if not (key.isascii() and key.isdigit() and len(key.lstrip("0")) <= 10 and int(key) <= MAX_UINT32):
            raise ApiError(400, f"{param}: the key must be a token id (a non-negative integer)", param=param)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"{param}: the bias must be a number, got {type(value).__name__}", param=param)
        token = int(key)
        if token in keys:  # "5" and "05": one of the two biases would be dropped
            raise ApiError(400, f"{param}: token {token} already has a bias (logit_bias[{keys[token]}])", param=param)
        keys[token] = key
        bias[token] = _float({param: value}, param, 0.0)
    return bias


def parse_request(
    body, kind: str, model_name: str, defaults: GenerationDefaults = GenerationDefaults(), vocab_size: int = 0
) -> ParsedRequest:
    """Checks the OpenAI fields and converts them; the router's own validation checks the values later. A field
    left out that the model has a default for (`defaults`) is left unset for the router to fill."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model: must be a string", param="model")
    if model is not None and model != model_name:
        raise ApiError(
            404,
            f"The model `{clipped(model)}` does not exist (this server serves `{model_name}`).",
            param="model",
            code="model_not_found",
        )
    refused = openai_fields.refused_field(body, kind)
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
    stream = _get(body, "stream", bool, False, "a boolean")
    options = _get(body, "stream_options", dict, None, "an object")
    if options is not None and not stream:
        raise ApiError(400, "stream_options: only allowed with stream = true", param="stream_options")
    usage_field = {"stream_options.include_usage": (options or {}).get("include_usage")}  # its 400 names the path
    include_usage = _get(usage_field, "stream_options.include_usage", bool, False, "a boolean")

    max_tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens_name != "max_tokens" and body.get("max_tokens") is not None:  # the other wins; still a valid count
        _int(body, "max_tokens", low=1)
    max_tokens = _int(
        body,
        max_tokens_name,
        COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else 0,
        low=1 if body.get(max_tokens_name) is not None else 0,
    )
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop: must be a string or a list of strings", param="stop")
    stop_ids = _get(body, "stop_token_ids", list, [], "a list of integers")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_UINT32 for i in stop_ids):
        raise ApiError(400, "stop_token_ids: must be a list of non-negative integers", param="stop_token_ids")
    top_k = _int(body, "top_k", None, low=-1)
    seed = _int(body, "seed", None, low=-(1 << 63), high=(1 << 64) - 1)
    top_p = _float(body, "top_p", 0.0)
    if top_p == 0 and body.get("top_p") is not None:  # OpenAI's 0 keeps the top token alone; the router's is "unset"
        top_p = FLOAT32_TINIEST
    params = router_pb2.SamplingParameters(
        top_p=top_p,
        max_new_tokens=max_tokens,
        min_new_tokens=_int(body, "min_tokens", 0),
        stop_sequences=stop or [],
        stop_token_ids=stop_ids,
        ignore_eos=_get(body, "ignore_eos", bool, False, "a boolean"),
        # the router's 0 is "off": sent, it would keep the whole prompt rather than none of it (null is off)
        truncate_input_tokens=_int(body, "truncate_prompt_tokens", None, low=1) or 0,
        presence_penalty=_float(body, "presence_penalty", 0.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0),
        logit_bias=_logit_bias(body),
    )
    if body.get("temperature") is not None or defaults.temperature is None:
        temperature = _float(body, "temperature", 1.0)  # OpenAI's default
        # vLLM raises a positive temperature below the least a float32 softmax survives to it; gRPC refuses it
        params.temperature = MIN_TEMPERATURE if 0 < temperature < MIN_TEMPERATURE else temperature
    if top_k is not None and top_k > 0:
        params.top_k = top_k
    elif top_k is not None and defaults.top_k and vocab_size:  # -1 / 0 turn a model default off
        params.top_k = vocab_size
    if body.get("repetition_penalty") is not None:
        params.repetition_penalty = _float(body, "repetition_penalty", 1.0)
    if body.get("min_p") is not None:  # sent (0 included): it wins over the model's generation_config.json
        params.min_p = _float(body, "min_p", 0.0)
    prompt_logprobs = _int(body, "prompt_logprobs", None, high=MAX_LOGPROBS)
    if prompt_logprobs is not None:
        params.prompt_logprobs = prompt_logprobs
    if seed is not None:
        params.seed = seed % (1 << 64)
    try:
        requested = request_constraint(body)
    except ConstraintFieldError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if requested is not None:
        params.constraint.CopyFrom(constraints.to_pb(requested[1]))
    parsed = ParsedRequest(
        kind,
        params,
        stream,
        include_usage,
        max_tokens_name=max_tokens_name,
        prompt_logprobs=prompt_logprobs is not None,
        # a tool grammar built by the router: its compile errors are the tools' ones
        constraint_name=requested[0] if requested else "tools",
    )
    parsed.cache_salt = _get(body, "cache_salt", str, "", "a string")
    parsed.n = parsed.best_of = _int(body, "n", 1, low=1, high=MAX_CHOICES)
    if kind == "completion":
        logprobs = _int(body, "logprobs", None, high=MAX_LOGPROBS)
        parsed.logprobs, parsed.top_logprobs = logprobs is not None, logprobs or 0
        parsed.prompts, parsed.prompt_list = _prompts(body)
        parsed.prompt = parsed.prompts[0]
        parsed.echo = _get(body, "echo", bool, False, "a boolean")
        if parsed.echo and parsed.logprobs:  # the prompt's tokens come first in the logprobs: they are scored
            if prompt_logprobs not in (None, parsed.top_logprobs):
                raise ApiError(
                    400,
                    "prompt_logprobs: must equal logprobs with echo (one count scores the prompt)",
                    param="prompt_logprobs",
                )
            params.prompt_logprobs = parsed.top_logprobs
        parsed.best_of = _int(body, "best_of", parsed.n, low=1, high=MAX_CHOICES)
        if parsed.best_of < parsed.n:
            raise ApiError(400, f"best_of: must be >= n ({parsed.n}), got {parsed.best_of}", param="best_of")
        if parsed.best_of > parsed.n and stream:
            raise ApiError(
                400, "best_of: cannot be streamed (the best samples are known only at the end)", param="best_of"
            )
        if parsed.best_of * len(parsed.prompts) > MAX_CHOICES:
            raise ApiError(
                400,
                f"best_of: {parsed.best_of} samples of {len(parsed.prompts)} prompts exceed {MAX_CHOICES}",
                param="best_of" if parsed.best_of > parsed.n else "n",
            )
    else:
        parsed.logprobs = _get(body, "logprobs", bool, False, "a boolean")
        parsed.top_logprobs = _int(body, "top_logprobs", 0, high=MAX_LOGPROBS)
        if parsed.top_logprobs and not parsed.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs = true", param="top_logprobs")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages: required, a non-empty list of {role, content} objects", param="messages")
        if not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages: each message must be an object", param="messages")
        for i, message in enumerate(messages):
            if problem := openai_fields.message_problem(message, f"messages[{i}]"):
                raise ApiError(400, problem[1], param=problem[0])
        parsed.messages = messages
        cont = _get(body, "continue_final_message", bool, False, "a boolean")
        add = _get(body, "add_generation_prompt", bool, not cont, "a boolean")
        kwargs = _get(body, "chat_template_kwargs", dict, None, "an object")
        parsed.chat_options = ChatOptions(
            continue_final_message=cont,
            add_generation_prompt=add,
            template_kwargs=kwargs,
            tools=tool_request.from_openai(body),
        )
    params.logprobs, params.top_logprobs = parsed.logprobs, parsed.top_logprobs
    return parsed


def _prompts(body) -> tuple[list[str | list[int]], bool]:
    """The prompts: a string, a list of token ids, or a list of either (a batch, told by its first element); and
    whether it was a list."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "prompt: required, a string or a list of token ids", param="prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_CHOICES:
            raise ApiError(400, f"prompt: at most {MAX_CHOICES} prompts, got {len(prompt)}", param="prompt")
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)], True
    return [_one_prompt(prompt, "prompt")], False


def _one_prompt(prompt, name: str) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        what = "null" if prompt is None else type(prompt).__name__
        raise ApiError(400, f"{name}: must be a string or a list of token ids, got {what}", param=name)
    if not prompt:
        raise ApiError(400, f"{name}: must not be empty", param=name)
    for j, token in enumerate(prompt):
        if isinstance(token, bool) or not isinstance(token, int):
            param = f"{name}[{j}]"
            what = "null" if token is None else type(token).__name__
            raise ApiError(400, f"{param}: a token id must be an integer, got {what}", param=param)
        if not 0 <= token <= MAX_UINT32:
            param = f"{name}[{j}]"
            bound = "non-negative" if token < 0 else f"at most {MAX_UINT32}"
            raise ApiError(400, f"{param}: a token id must be {bound}", param=param)
    return prompt


def generate_request(
    parsed: ParsedRequest, request_id: str, prompt=None, parameters: router_pb2.SamplingParameters | None = None
) -> router_pb2.GenerateRequest:
    """The router request of one prompt (the first unless given) with the parsed parameters (unless given)."""
    prompt = parsed.prompt if prompt is None else prompt
    request = router_pb2.GenerateRequest(
        parameters=parameters or parsed.parameters, request_id=request_id, cache_salt=parsed.cache_salt
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request
