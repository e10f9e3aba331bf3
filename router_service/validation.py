"""Validation of GenerateRequest and GenerateStreamRequest: every field is checked before anything reaches the
worker.

Each failure is an InvalidRequestError whose field is the proto path (`parameters.top_p`,
`token_ids.ids[3]`) and whose message names the limit and the value given, as TGI's validation does.
"""

from __future__ import annotations

import array
import dataclasses
import math
import secrets
from dataclasses import dataclass

import numpy as np
from google.protobuf import unknown_fields
from google.protobuf.message import Message

from common.errors import InvalidRequestError
from common.pb import router_pb2
from router_service import constraints
from router_service.config import RouterConfig
from router_service.constraints import Constraint
from router_service.generation_defaults import MAX_TEMPERATURE, MIN_TEMPERATURE, GenerationDefaults
from router_service.protocol import is_metadata_safe

# GenerateStream's request carries GenerateRequest's fields (each RPC has a request type of its own).
PromptRequest = router_pb2.GenerateRequest | router_pb2.GenerateStreamRequest

MAX_SEED = (1 << 64) - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs; prompt_logprobs has the same
MAX_PRESENCE_FREQUENCY = 2.0  # vLLM's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limits on logit_bias: 300 tokens, each bias in [-100, 100]
MAX_LOGIT_BIAS = 100.0
MAX_CACHE_SALT_BYTES = 256
# With max_prompt_bytes 0, a text prompt may have this many UTF-8 bytes per token of context: far above any
# real tokenizer's average, and still a bound on what one request can make the router tokenize.
BYTES_PER_TOKEN = 32


@dataclass(frozen=True)
class ModelLimits:
    """What the served model and the worker's memory allow (from the worker's Info)."""

    vocab_size: int
    max_sequence_length: int  # max_position_embeddings: prompt + generated tokens
    kv_capacity_tokens: int  # kv_block_size * num_kv_blocks: the most tokens one sequence can hold
    eos_token_ids: tuple[int, ...] = ()  # the model's, with generation_config.json's
    has_tokenizer: bool = False
    generation: GenerationDefaults = GenerationDefaults()  # what requests that leave a field unset inherit

    @property
    def room(self) -> int:
        """Both the context (position embeddings) and the KV pool bound prompt + completion."""
        return min(self.max_sequence_length, self.kv_capacity_tokens)


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed validation, with defaults applied; no client protobuf below this point."""

    request_id: str  # the caller's, or "" (the batching loop assigns one)
    prompt_ids: tuple[int, ...]  # after truncate_input_tokens
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_k: int  # 0 = off
    top_p: float  # 1.0 = off
    seed: int  # always set: the caller's or a fresh random one
    stop_sequences: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # None = the prompt is not scored
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    constraint: Constraint | None = None  # constrained decoding (compiled by the batching loop at submit)
    cache_salt: str = ""  # prefix caching: only requests with equal salts share cached blocks
    # prompt_ids as uint32 little-endian, made as validation checked them (the prefix cache hashes these bytes);
    # b"" in a request built without validation, whose ids are converted where they are hashed
    prompt_bytes: bytes = dataclasses.field(default=b"", repr=False)
    # truncate_input_tokens dropped some of the prompt's tokens: completions' echo then shows the ids kept, decoded
    prompt_truncated: bool = False

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check_ids(field: str, ids, vocab_size: int) -> np.ndarray | None:
    """Raises unless every id is in [0, vocab_size); returns them as an integer array when they all are (None
    for an empty or non-integer sequence, checked element by element)."""
    # One numpy pass over integer ids (a repeated proto field converts without a copy loop): a Python loop took
    # ~0.1 ms for a 2,000-token prompt, on the event loop, for every request of a burst.
    values = _id_array(ids)
    if values.dtype.kind not in "iu":  # empty, or a list holding something else: the exact element-wise check
        values = ids
    elif values.size == 0 or (values.min() >= 0 and values.max() < vocab_size):
        return values if values.size else None
    for i, token_id in enumerate(values):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"{field}[{i}]", f"token id must be in [0, {vocab_size}), got {token_id}")
    return None


_UINT_IS_32_BITS = array.array("I").itemsize == 4  # C's unsigned int: 4 bytes wherever this runs, but not by law


def _id_array(ids) -> np.ndarray:
    """`ids` as a numpy array. A list (a tokenizer's ids) goes through array("I"), 4x faster than numpy from a
    list (2,112 ids: 18 vs 73 us); one that does not fit uint32 (negative, too large, not an integer) through
    numpy, as anything else (a repeated proto field converts without a copy loop)."""
    if isinstance(ids, list) and _UINT_IS_32_BITS:
        try:
            return np.frombuffer(array.array("I", ids), np.uint32)
        except (OverflowError, TypeError):
            pass
    return np.asarray(ids)


check_ids = _check_ids  # Detokenize checks its ids the same way


def _cuts(num_ids: int, p: router_pb2.SamplingParameters) -> bool:
    return 0 < p.truncate_input_tokens < num_ids


def _truncated(ids, p: router_pb2.SamplingParameters):
    """The last truncate_input_tokens ids (all of them when it is 0 or larger)."""
    return ids[len(ids) - p.truncate_input_tokens :] if _cuts(len(ids), p) else ids


def validate_request(req: PromptRequest, config: RouterConfig, limits: ModelLimits, tokenizer=None) -> ValidatedRequest:
    """Checks every field of `req`; raises InvalidRequestError naming the first bad one. Tokenizes inline."""
    text = _check_before_tokenizing(req, config, limits, tokenizer)
    return _complete(req, config, limits, tokenizer.encode(text) if text is not None else None)


async def validate_request_async(
    req: PromptRequest, config: RouterConfig, limits: ModelLimits, tokenizer=None, chat: bool = False
) -> ValidatedRequest:
    """validate_request for the event loop: every cheap check first, then a long text is tokenized on a thread.
    `chat`: the text is a chat template's output (Tokenizer.encode_chat_async: no special tokens added, and only
    the template's own are special)."""
    text = _check_before_tokenizing(req, config, limits, tokenizer)
    if text is None:
        ids = None
    else:
        ids = await (tokenizer.encode_chat_async(text) if chat else tokenizer.encode_async(text))
    return _complete(req, config, limits, ids)


def revalidate(
    req: PromptRequest, config: RouterConfig, limits: ModelLimits, tokenizer, validated: ValidatedRequest
) -> ValidatedRequest:
    """`validated` judged by other limits, as validate_request would judge `req`, without tokenizing again: the
    worker reconnected while it was tokenized, and a restart may bring a smaller KV pool or another vocabulary."""
    text = _check_before_tokenizing(req, config, limits, tokenizer)
    again = _complete(req, config, limits, list(validated.prompt_ids) if text is not None else None)
    # a text prompt's ids are the kept ones: cutting them again cuts nothing, yet the prompt was cut
    return dataclasses.replace(again, seed=validated.seed, prompt_truncated=validated.prompt_truncated)


def prompt_byte_limit(config: RouterConfig, limits: ModelLimits | None) -> int:
    """The most UTF-8 bytes a text prompt (or Tokenize text) may have: max_prompt_bytes, or a generous
    BYTES_PER_TOKEN per token of the context when it is 0; never above max_message_bytes."""
    if config.max_prompt_bytes:
        return min(config.max_prompt_bytes, config.max_message_bytes)
    if limits is None:
        return min(config.max_message_bytes, 1 << 20)
    return min(config.max_message_bytes, limits.room * BYTES_PER_TOKEN)


def check_text_size(field: str, text: str, limit: int) -> None:
    """Raises InvalidRequestError when `text` is over `limit` UTF-8 bytes (without encoding it when the character
    count decides: a character is 1 to 4 bytes)."""
    if len(text) * 4 <= limit:
        return
    size = len(text) if len(text) > limit else len(text.encode())
    if size > limit:
        raise InvalidRequestError(
            field,
            f"must be at most {limit} bytes (max_prompt_bytes), got {'more than ' if size == len(text) else ''}{size}",
        )


def check_known_fields(message, path: str = "") -> None:
    """Protobuf keeps a field this router.proto lacks (a client built from a newer one) and the router would never
    read it: a dropped decoding constraint, say, changes the output silently. Refused instead, naming where."""
    numbers = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(message)})
    if numbers:
        raise InvalidRequestError(
            path or "request",
            f"field number {', '.join(map(str, numbers))} is not in this server's router.proto (a client built "
            "from a newer one?); refused rather than ignored",
        )
    for descriptor, value in message.ListFields():
        name = f"{path}.{descriptor.name}" if path else descriptor.name
        if isinstance(value, Message):
            check_known_fields(value, name)
        elif descriptor.message_type is not None and not descriptor.message_type.GetOptions().map_entry:
            for i, item in enumerate(value):  # a repeated message field (a chat's messages)
                check_known_fields(item, f"{name}[{i}]")


def _check_before_tokenizing(req: PromptRequest, config: RouterConfig, limits: ModelLimits, tokenizer) -> str | None:
    """Every check that needs no tokens; returns the text to tokenize (None for a token-id prompt)."""
    check_known_fields(req)
    if len(req.request_id) > config.max_request_id_length:
        raise InvalidRequestError(
            "request_id", f"must be at most {config.max_request_id_length} characters, got {len(req.request_id)}"
        )
    if not is_metadata_safe(req.request_id):
        raise InvalidRequestError(
            "request_id", "must be printable ASCII (0x20-0x7e) without a space at either end: it is echoed in metadata"
        )
    if len(req.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(
            "cache_salt", f"must be at most {MAX_CACHE_SALT_BYTES} bytes, got {len(req.cache_salt.encode())}"
        )
    p = req.parameters
    _check_sampling(p, limits)
    _check_stops(p, config, limits)
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "set either text or token_ids")
    if kind == "token_ids":
        ids = req.token_ids.ids
        if not ids:
            raise InvalidRequestError("token_ids.ids", "must not be empty")
        _check_prompt_length(len(_truncated(ids, p)), limits)
        _check_ids("token_ids.ids", ids, limits.vocab_size)
        return None
    if not req.text:
        raise InvalidRequestError("text", "must not be empty")
    if tokenizer is None:
        raise InvalidRequestError(
            "text", "this model has no tokenizer; send token_ids (or start the router with --model DIR)"
        )
    check_text_size("text", req.text, prompt_byte_limit(config, limits))
    return req.text


def _complete(
    req: PromptRequest, config: RouterConfig, limits: ModelLimits, text_ids: list[int] | None
) -> ValidatedRequest:
    p = req.parameters
    truncated = _cuts(len(text_ids) if text_ids is not None else len(req.token_ids.ids), p)
    if text_ids is not None:
        if not text_ids:
            raise InvalidRequestError("text", "tokenizes to no tokens")
        text_ids = _truncated(text_ids, p)
        _check_prompt_length(len(text_ids), limits)
        words = _check_ids("text (tokenized)", text_ids, limits.vocab_size)
        prompt_ids = text_ids
    else:  # a repeated field converts through numpy about 4x faster than list() (2,112 ids: 10 vs 40 us)
        words = _truncated(np.asarray(req.token_ids.ids), p)
        prompt_ids = words.tolist()
    # The ids are in [0, vocab_size) (checked), so uint32 holds them exactly: the prefix cache hashes these bytes
    # rather than converting the list once more (0.4 us from the array, 15-20 us from a 2,112-id list).
    prompt_bytes = words.astype("<u4").tobytes() if words is not None else b""
    max_new_tokens = _max_new_tokens(p, config, limits, len(prompt_ids))
    if p.min_new_tokens > max_new_tokens:
        raise InvalidRequestError(
            "parameters.min_new_tokens", f"must be <= max_new_tokens ({max_new_tokens}), got {p.min_new_tokens}"
        )
    seed = p.seed if p.HasField("seed") else secrets.randbelow(MAX_SEED + 1)
    constraint = constraints.from_pb(p.constraint) if p.HasField("constraint") else None
    if constraint is not None and p.min_new_tokens:
        # the grammar alone decides where the output may end; suppressing EOS as well could leave no token
        raise InvalidRequestError("parameters.min_new_tokens", "cannot be combined with a constraint")
    d = limits.generation
    return ValidatedRequest(
        request_id=req.request_id,
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        temperature=float(p.temperature) if p.HasField("temperature") else float(d.temperature or 0.0),
        top_k=p.top_k or min(d.top_k or 0, limits.vocab_size),
        top_p=float(p.top_p or d.top_p or 1.0),
        seed=seed,
        stop_sequences=tuple(p.stop_sequences),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        repetition_penalty=float(p.repetition_penalty)
        if p.HasField("repetition_penalty")
        else float(d.repetition_penalty or 1.0),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        min_p=float(p.min_p) if p.HasField("min_p") else float(d.min_p or 0.0),
        logit_bias=tuple(sorted(p.logit_bias.items())),
        constraint=constraint,
        cache_salt=req.cache_salt,
        prompt_bytes=prompt_bytes,
        prompt_truncated=truncated,
    )


def _shown(value: float) -> str:
    """A float32 field's value, with the digits that tell it from a bound: with six significant digits top_p
    1.0000001 read "got 1", a value in range."""
    short = f"{value:g}"
    return short if np.float32(short) == np.float32(value) else str(np.float32(value))


def _check_sampling(p: router_pb2.SamplingParameters, limits: ModelLimits) -> None:
    # Below MIN_TEMPERATURE, logits / temperature overflows float32 (1e-45 made every token inf and always
    # sampled the last id); use 0 for greedy.
    t = p.temperature  # a float32: 0.01 arrives as 0.0099999998, hence the float32-sized tolerance
    if not math.isfinite(t) or not (t == 0 or MIN_TEMPERATURE * (1 - 1e-6) <= t <= MAX_TEMPERATURE):
        raise InvalidRequestError(
            "parameters.temperature",
            f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {_shown(t)}",
        )
    _check_logprobs_and_penalties(p)
    if not math.isfinite(p.top_p) or not 0 <= p.top_p <= 1:
        raise InvalidRequestError(
            "parameters.top_p", f"must be in (0, 1] (0 = the model's default, else 1), got {_shown(p.top_p)}"
        )
    if p.top_k > limits.vocab_size:
        raise InvalidRequestError(
            "parameters.top_k",
            f"must be <= vocab_size ({limits.vocab_size}) (0 = the model's default, else off), got {p.top_k}",
        )
    if not math.isfinite(p.min_p) or not 0 <= p.min_p <= 1:
        raise InvalidRequestError("parameters.min_p", f"must be in [0, 1] (0 = off), got {_shown(p.min_p)}")
    _check_logit_bias(p, limits.vocab_size)


def _check_logit_bias(p: router_pb2.SamplingParameters, vocab_size: int) -> None:
    if len(p.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            "parameters.logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(p.logit_bias)}"
        )
    for token_id, bias in sorted(p.logit_bias.items()):  # sorted: the first bad id is the same on every call
        field = f"parameters.logit_bias[{token_id}]"
        if token_id >= vocab_size:
            raise InvalidRequestError(field, f"token id must be in [0, {vocab_size})")
        if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
            raise InvalidRequestError(
                field, f"bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {_shown(bias)}"
            )


def _check_logprobs_and_penalties(p: router_pb2.SamplingParameters) -> None:
    if p.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            "parameters.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}"
        )
    if p.top_logprobs and not p.logprobs:
        raise InvalidRequestError("parameters.top_logprobs", "needs logprobs = true")
    if p.HasField("prompt_logprobs") and p.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            "parameters.prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}] (unset = off), got {p.prompt_logprobs}"
        )
    r = p.repetition_penalty
    if p.HasField("repetition_penalty") and not (math.isfinite(r) and r > 0):
        raise InvalidRequestError(
            "parameters.repetition_penalty", f"must be a finite number > 0 (1 = off), got {_shown(r)}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (math.isfinite(value) and abs(value) <= MAX_PRESENCE_FREQUENCY):
            raise InvalidRequestError(
                f"parameters.{name}",
                f"must be in [-{MAX_PRESENCE_FREQUENCY:g}, {MAX_PRESENCE_FREQUENCY:g}] (0 = off), got {_shown(value)}",
            )


def _check_stops(p: router_pb2.SamplingParameters, config: RouterConfig, limits: ModelLimits) -> tuple[str, ...]:
    if len(p.stop_sequences) > config.max_stop_sequences:
        raise InvalidRequestError(
            "parameters.stop_sequences", f"at most {config.max_stop_sequences} allowed, got {len(p.stop_sequences)}"
        )
    for i, s in enumerate(p.stop_sequences):
        field = f"parameters.stop_sequences[{i}]"
        if not s:
            raise InvalidRequestError(field, "must not be empty")
        if len(s) > config.max_stop_sequence_length:
            raise InvalidRequestError(
                field, f"must be at most {config.max_stop_sequence_length} characters, got {len(s)}"
            )
    if p.stop_sequences and not limits.has_tokenizer:
        raise InvalidRequestError(
            "parameters.stop_sequences", "need the model's tokenizer (start the router with --model DIR)"
        )
    if len(p.stop_token_ids) > config.max_stop_token_ids:
        raise InvalidRequestError(
            "parameters.stop_token_ids", f"at most {config.max_stop_token_ids} allowed, got {len(p.stop_token_ids)}"
        )
    _check_ids("parameters.stop_token_ids", p.stop_token_ids, limits.vocab_size)
    return tuple(p.stop_sequences)


def check_fits_context(field: str, what: str, count: int, limits: ModelLimits) -> None:
    """Each of a chat's `count` messages (or tool calls) takes a token of the context at least: bounded before the
    template sees them (the rendered text is checked again)."""
    if count > limits.room:
        raise InvalidRequestError(field, f"at most {limits.room} {what} fit the context, got {count}")


def _check_prompt_length(num_prompt: int, limits: ModelLimits) -> None:
    room = limits.room
    if num_prompt >= room:
        bound = "max_sequence_length" if limits.max_sequence_length <= limits.kv_capacity_tokens else "KV capacity"
        raise InvalidRequestError(
            "prompt",
            f"{num_prompt} tokens leave no room to generate: prompt + max_new_tokens must be <= {bound} ({room})",
        )


def default_max_new_tokens(config: RouterConfig, limits: ModelLimits) -> int:
    """What a request that leaves max_new_tokens unset may generate (before fitting its context): the model's
    generation_config.json max_new_tokens, else the router's default_max_new_tokens, within its max_new_tokens."""
    return min(limits.generation.max_new_tokens or config.default_max_new_tokens, config.max_new_tokens)


def _max_new_tokens(
    p: router_pb2.SamplingParameters, config: RouterConfig, limits: ModelLimits, num_prompt: int
) -> int:
    room = limits.room
    bound = "max_sequence_length" if limits.max_sequence_length <= limits.kv_capacity_tokens else "KV capacity"
    _check_prompt_length(num_prompt, limits)
    if p.max_new_tokens == 0:  # the default, shortened to fit rather than refused
        return min(default_max_new_tokens(config, limits), room - num_prompt)
    if p.max_new_tokens > config.max_new_tokens:
        raise InvalidRequestError(
            "parameters.max_new_tokens", f"must be <= {config.max_new_tokens}, got {p.max_new_tokens}"
        )
    if num_prompt + p.max_new_tokens > room:
        raise InvalidRequestError(
            "parameters.max_new_tokens",
            f"prompt ({num_prompt} tokens) + max_new_tokens ({p.max_new_tokens}) must be <= {bound} ({room})",
        )
    return p.max_new_tokens
