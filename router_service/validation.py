"""Validation of GenerateRequest: every field is checked before anything reaches the worker.

Each failure is an InvalidRequestError whose field is the proto path (`parameters.top_p`,
`token_ids.ids[3]`) and whose message names the limit and the value given, as TGI's validation does.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from common.errors import InvalidRequestError
from common.pb import router_pb2, worker_pb2
from router_service.config import RouterConfig

MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True)
class ModelLimits:
    """What the served model and the worker's memory allow (from the worker's Info)."""
    vocab_size: int
    max_sequence_length: int  # max_position_embeddings: prompt + generated tokens
    kv_capacity_tokens: int  # kv_block_size * num_kv_blocks: the most tokens one sequence can hold
    eos_token_ids: tuple[int, ...] = ()
    has_tokenizer: bool = False


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed validation, with defaults applied; no client protobuf below this point."""
    request_id: str  # the caller's, or "" (the batching loop assigns one)
    prompt_ids: tuple[int, ...]
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

    def to_sampling_pb(self, eos_token_ids) -> worker_pb2.SamplingParams:
        """The worker's sampling settings; it suppresses the stop ids (EOS unless ignored, then stop_token_ids)
        before min_new_tokens."""
        stop_ids = list(dict.fromkeys([*([] if self.ignore_eos else eos_token_ids), *self.stop_token_ids]))
        return worker_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                         seed=self.seed, stop_token_ids=stop_ids, min_new_tokens=self.min_new_tokens,
                                         logprobs=self.logprobs)


def _check_ids(field: str, ids, vocab_size: int) -> None:
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"{field}[{i}]", f"token id must be in [0, {vocab_size}), got {token_id}")


def validate_request(req: router_pb2.GenerateRequest, config: RouterConfig, limits: ModelLimits,
                     tokenizer=None) -> ValidatedRequest:
    """Checks every field of `req`; raises InvalidRequestError naming the first bad one."""
    if len(req.request_id) > config.max_request_id_length:
        raise InvalidRequestError("request_id", f"must be at most {config.max_request_id_length} characters, "
                                                f"got {len(req.request_id)}")
    if not req.request_id.isprintable():
        raise InvalidRequestError("request_id", "must be printable text")
    p = req.parameters
    _check_sampling(p, limits)
    stop_sequences = _check_stops(p, config, limits)
    prompt_ids = _prompt_ids(req, limits, tokenizer)
    max_new_tokens = _max_new_tokens(p, config, limits, len(prompt_ids))
    if p.min_new_tokens > max_new_tokens:
        raise InvalidRequestError("parameters.min_new_tokens",
                                  f"must be <= max_new_tokens ({max_new_tokens}), got {p.min_new_tokens}")
    seed = p.seed if p.HasField("seed") else secrets.randbelow(MAX_SEED + 1)
    return ValidatedRequest(
        request_id=req.request_id, prompt_ids=tuple(prompt_ids), max_new_tokens=max_new_tokens,
        min_new_tokens=p.min_new_tokens, temperature=float(p.temperature), top_k=p.top_k,
        top_p=float(p.top_p) if p.top_p > 0 else 1.0, seed=seed, stop_sequences=stop_sequences,
        stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs)


def _check_sampling(p: router_pb2.SamplingParameters, limits: ModelLimits) -> None:
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequestError("parameters.temperature",
                                  f"must be a finite number >= 0 (0 = greedy), got {p.temperature}")
    if not math.isfinite(p.top_p) or not 0 <= p.top_p <= 1:
        raise InvalidRequestError("parameters.top_p", f"must be in (0, 1] (0 = off), got {p.top_p}")
    if p.top_k > limits.vocab_size:
        raise InvalidRequestError("parameters.top_k",
                                  f"must be <= vocab_size ({limits.vocab_size}) (0 = off), got {p.top_k}")


def _check_stops(p: router_pb2.SamplingParameters, config: RouterConfig, limits: ModelLimits) -> tuple[str, ...]:
    if len(p.stop_sequences) > config.max_stop_sequences:
        raise InvalidRequestError("parameters.stop_sequences", f"at most {config.max_stop_sequences} allowed, "
                                                               f"got {len(p.stop_sequences)}")
    for i, s in enumerate(p.stop_sequences):
        field = f"parameters.stop_sequences[{i}]"
        if not s:
            raise InvalidRequestError(field, "must not be empty")
        if len(s) > config.max_stop_sequence_length:
            raise InvalidRequestError(field, f"must be at most {config.max_stop_sequence_length} characters, "
                                             f"got {len(s)}")
    if p.stop_sequences and not limits.has_tokenizer:
        raise InvalidRequestError("parameters.stop_sequences",
                                  "need the model's tokenizer (start the router with --model DIR)")
    if len(p.stop_token_ids) > config.max_stop_token_ids:
        raise InvalidRequestError("parameters.stop_token_ids", f"at most {config.max_stop_token_ids} allowed, "
                                                               f"got {len(p.stop_token_ids)}")
    _check_ids("parameters.stop_token_ids", p.stop_token_ids, limits.vocab_size)
    return tuple(p.stop_sequences)


def _prompt_ids(req: router_pb2.GenerateRequest, limits: ModelLimits, tokenizer) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "set either text or token_ids")
    if kind == "text":
        if not req.text:
            raise InvalidRequestError("text", "must not be empty")
        if tokenizer is None:
            raise InvalidRequestError("text", "this model has no tokenizer; send token_ids "
                                              "(or start the router with --model DIR)")
        ids = tokenizer.encode(req.text)
        if not ids:
            raise InvalidRequestError("text", "tokenizes to no tokens")
        _check_ids("text (tokenized)", ids, limits.vocab_size)
        return ids
    ids = list(req.token_ids.ids)
    if not ids:
        raise InvalidRequestError("token_ids.ids", "must not be empty")
    _check_ids("token_ids.ids", ids, limits.vocab_size)
    return ids


def _max_new_tokens(p: router_pb2.SamplingParameters, config: RouterConfig, limits: ModelLimits,
                    num_prompt: int) -> int:
    # Both the context (position embeddings) and the KV pool bound prompt + completion.
    room = min(limits.max_sequence_length, limits.kv_capacity_tokens)
    bound = "max_sequence_length" if limits.max_sequence_length <= limits.kv_capacity_tokens else "KV capacity"
    if num_prompt >= room:
        raise InvalidRequestError("prompt", f"{num_prompt} tokens leave no room to generate: prompt + "
                                            f"max_new_tokens must be <= {bound} ({room})")
    if p.max_new_tokens == 0:  # the default, shortened to fit rather than refused
        return min(config.default_max_new_tokens, room - num_prompt)
    if p.max_new_tokens > config.max_new_tokens:
        raise InvalidRequestError("parameters.max_new_tokens",
                                  f"must be <= {config.max_new_tokens}, got {p.max_new_tokens}")
    if num_prompt + p.max_new_tokens > room:
        raise InvalidRequestError("parameters.max_new_tokens",
                                  f"prompt ({num_prompt} tokens) + max_new_tokens ({p.max_new_tokens}) "
                                  f"must be <= {bound} ({room})")
    return p.max_new_tokens
