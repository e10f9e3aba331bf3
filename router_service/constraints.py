"""Constrained decoding on the router: what a request's output must match, compiled against the model's own
tokenizer by llguidance, and one matcher per request that gives each step's token mask.

The router owns the tokenizer, so masks are computed here and travel with the step to the worker, which sets the
disallowed logits to -inf before sampling (docs/architecture.md). A constrained request needs its last token before
its next mask, so it runs one step at a time while unconstrained requests keep the pipeline full.

Fronts build a `Constraint` (kind + spec); `ConstraintCompiler.matcher` compiles it (an LRU of compiled grammars:
the same schema sent again costs a copy) and raises InvalidRequestError naming `parameters.constraint` with
llguidance's one-line reason when it cannot. Another feature (tool calls) builds its constraint with
`Constraint.json_schema(schema)` or `Constraint("grammar", lark)` and submits it like any other.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import InvalidRequestError
from common.pb import router_pb2
from router_service.json_text import strict_json

KINDS = ("json_schema", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 64 << 10  # a schema, regex or grammar; each choice too
MAX_CHOICES = 1024
CACHE_SIZE = 256  # compiled grammars kept (LRU)
FIELD = "parameters.constraint"
# JSON without free whitespace: a model that may emit whitespace between tokens can emit it forever.
_JSON_OPTIONS = {"whitespace_flexible": False}


# llguidance's work bounds, below its defaults: a hostile regex or schema otherwise builds a lexer for a second or
# more (`(a{1000}){1000}`: 1.1 s for its first mask). ~50k fuel/ms to build, ~14k/ms per step, 1-2 kB per state.
LIMITS: dict[str, Any] = {
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 50_000,
    "max_lexer_states": 20_000,
    "max_grammar_size": 200_000,
    "verbose_errors": False,  # errors are one line for the client; they would otherwise quote the grammar
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match. kind: json_schema (spec: JSON Schema text), regex (the whole output), choice
    (spec: the allowed outputs), grammar (Lark, or GBNF)."""

    kind: str
    spec: str | tuple[str, ...]

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(FIELD, f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        parts = self.spec if isinstance(self.spec, tuple) else (self.spec,)
        if (self.kind == "choice") != isinstance(self.spec, tuple):
            raise InvalidRequestError(FIELD, "a choice constraint takes a list of strings, the others one string")
        if self.kind == "choice" and not 1 <= len(parts) <= MAX_CHOICES:
            raise InvalidRequestError(f"{FIELD}.choice", f"needs 1 to {MAX_CHOICES} choices, got {len(parts)}")
        if not all(isinstance(part, str) for part in parts):
            raise InvalidRequestError(f"{FIELD}.{self.kind}", "must be text")
        for i, part in enumerate(parts):
            size = len(part.encode())
            if size > MAX_SPEC_BYTES:
                # no "string": a schema may have come as a JSON object, measured as its JSON text
                what = {"json_schema": " as JSON text", "choice": f" (choice {i})"}.get(self.kind, "")
                raise InvalidRequestError(
                    f"{FIELD}.{self.kind}", f"must be at most {MAX_SPEC_BYTES} bytes{what}, got {size}"
                )
        if self.kind != "choice" and not self.spec:
            raise InvalidRequestError(f"{FIELD}.{self.kind}", "must not be empty")
        if self.kind == "choice" and not all(parts):
            raise InvalidRequestError(f"{FIELD}.choice", "a choice must not be empty")

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        """From a schema as a dict (or JSON text); {"type": "object"} for any JSON object."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def grammar(self) -> str:
        """llguidance's grammar definition (not yet checked: `ConstraintCompiler` validates it)."""
        import llguidance  # only a router serving constrained requests loads it

        if self.kind == "json_schema":
            try:
                schema = strict_json(str(self.spec))
            except ValueError as e:
                raise InvalidRequestError(f"{FIELD}.json_schema", f"is not valid JSON: {e}") from None
            except RecursionError:  # 64 KiB of `[` is valid-looking JSON deeper than Python's parser goes
                raise InvalidRequestError(f"{FIELD}.json_schema", "is nested too deeply") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(f"{FIELD}.json_schema", "must be a JSON object (or true/false)")
            # llguidance applies its options to an object schema only: `true` is {} (any value), `false` no value
            if schema is False:
                raise InvalidRequestError(f"{FIELD}.json_schema", "is false, which matches nothing")
            if schema is True:
                schema = {}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(prepared_schema(schema)),
                    defaults=_JSON_OPTIONS,  # type: ignore[arg-type]  # a plain dict is what the library reads
                )
            except (ValueError, TypeError) as e:
                raise InvalidRequestError(f"{FIELD}.json_schema", _one_line(str(e))) from None
            except RecursionError:
                raise InvalidRequestError(f"{FIELD}.json_schema", "is nested too deeply") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(self.spec))
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.spec))
        try:
            return llguidance.grammar_from("grammar", str(self.spec))  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise InvalidRequestError(f"{FIELD}.grammar", _one_line(str(e))) from None


# llguidance's `date` and `date-time` know each month's length but not leap years (2023-02-29 passes): a pattern
# beside such a format, on the date it starts with, rules out February 29th outside them.
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
_CALENDAR = rf"^(?:[0-9]{{4}}-(?:0[13-9]|1[0-2])|[0-9]{{4}}-02-(?:[01][0-9]|2[0-8])|{_LEAP_YEAR}-02-29)"
_SUBSCHEMA = (
    *("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties"),
    *("not", "if", "then", "else", "contains", "propertyNames"),
)
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_EXACT = 2**53


def _each_subschema(schema, change):
    """`schema` with `change` applied to it and to every subschema, innermost first (not to data: const, enum)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _each_subschema(out[key], change)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_each_subschema(s, change) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _each_subschema(s, change) for name, s in out[key].items()}
    return change(out)


def prepared_schema(schema):
    """A JSON schema as llguidance should get it, wherever it is compiled (a json_schema constraint, a tool call's
    %json body): dates that keep to the calendar, numbers it would round refused."""
    return _each_subschema(schema, lambda s: _with_calendar(_exact_bounds(s)))


def _with_calendar(schema: dict) -> dict:
    """`_CALENDAR` beside a date format."""
    if schema.get("format") in ("date", "date-time") and isinstance(schema.get("allOf", []), list):
        schema["allOf"] = [*schema.get("allOf", []), {"pattern": _CALENDAR}]
    return schema


def _exact_bounds(schema: dict) -> dict:
    """Refuses numbers the grammar compiler would round: it holds them as doubles, exact to 2^53, so
    `"minimum": 9007199254740993` admitted 9007199254740992, `"maximum": 1e30` refused 1e29 and `"const":
    9007199254740993` produced 9007199254740992. Bounds are refused past 2^53, integers in const / enum too."""
    for key in _BOUNDS:
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and abs(value) > _EXACT:
            raise InvalidRequestError(
                f"{FIELD}.json_schema", f"{key} {value} is beyond ±2^53 ({_EXACT}), where numbers stay exact"
            )
    for key in ("const", "enum"):
        if key in schema and (value := _inexact_integer(schema[key])) is not None:
            raise InvalidRequestError(
                f"{FIELD}.json_schema", f"{key} holds {value}, beyond ±2^53 ({_EXACT}), where numbers stay exact"
            )
    return schema


def _inexact_integer(data):
    """The first integer in JSON data (a const, an enum) that a double cannot hold exactly, else None."""
    if isinstance(data, int) and not isinstance(data, bool):
        return data if abs(data) > _EXACT else None
    items = data.values() if isinstance(data, dict) else data if isinstance(data, list) else ()
    return next((found for item in items if (found := _inexact_integer(item)) is not None), None)


def from_pb(message: router_pb2.Constraint) -> Constraint | None:
    """The request's constraint (None when the oneof is unset)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint("choice", tuple(message.choice.choices))
    return Constraint(kind, getattr(message, kind))


def to_pb(constraint: Constraint) -> router_pb2.Constraint:
    if constraint.kind == "choice":
        return router_pb2.Constraint(choice=router_pb2.ChoiceList(choices=list(constraint.spec)))
    message = router_pb2.Constraint()
    setattr(message, constraint.kind, str(constraint.spec))
    return message


def schema_check(constraint: Constraint) -> None:
    """Raises InvalidRequestError for a constraint whose grammar llguidance refuses, checked without the tokenizer:
    no lexer is built, so it costs well under a millisecond for a schema, where compiling may take far longer."""
    import llguidance

    limits = llguidance.LLParserLimits(**LIMITS)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(constraint.grammar(), None, limits=limits)
    if failed:
        raise InvalidRequestError(f"{FIELD}.{constraint.kind}", _one_line(messages[0]))


def _one_line(message: str) -> str:
    """llguidance's errors span lines (a caret under the grammar): the first line says what is wrong."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "rejected by the grammar compiler"
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {detail}".strip()[:300]


class GrammarMatcher:
    """One request's parser state: the mask of the next token, then the sampled token consumed."""

    def __init__(self, matcher, words: int, eos_ids: tuple[int, ...], allow_eos: bool):
        self._matcher, self._words = matcher, words
        self._eos = np.asarray(eos_ids, np.int64)
        self._eos_set = frozenset(eos_ids)
        self._allow_eos = allow_eos
        self._last: np.ndarray | None = None  # the last mask given out

    def mask(self) -> bytes:
        """The next token's mask: `words` uint32 little-endian, EOS allowed only where the grammar accepts (and
        never with ignore_eos)."""
        words = np.frombuffer(self._matcher.compute_bitmask(), "<u4")[: self._words].copy()
        if self._eos.size:
            bits = np.uint32(1) << (self._eos % 32).astype(np.uint32)
            if self._allow_eos and self._matcher.is_accepting():
                np.bitwise_or.at(words, self._eos // 32, bits)
            else:
                np.bitwise_and.at(words, self._eos // 32, ~bits)
        if self._matcher.is_error():
            raise GrammarError(_one_line(self._matcher.get_error()))
        if not words.any():
            raise GrammarError("the grammar allows no next token")
        self._last = words
        return words.tobytes()

    def consume(self, token_id: int) -> None:
        """Raises GrammarError: `outside_mask` when the token was not allowed (the sampler's fault, not the
        grammar's), else the grammar outgrew the parser's limits."""
        last = self._last
        if last is not None and not (0 <= token_id < 32 * last.size and last[token_id // 32] >> (token_id % 32) & 1):
            raise GrammarError(f"token {token_id} was not allowed by the mask", outside_mask=True)
        if token_id in self._eos_set:  # llguidance knows one EOS id (the first); any EOS ends the output alike
            token_id = int(self._eos[0])
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} broke the grammar: {_one_line(self._matcher.get_error())}")

    @property
    def is_stopped(self) -> bool:
        """The output is complete and nothing may follow it (the request ends here)."""
        return self._matcher.is_stopped()


class GrammarError(Exception):
    """The matcher failed mid-request: a grammar past llguidance's limits (the client's), or a sampled token the
    mask did not allow (`outside_mask`: a bug): the request fails."""

    def __init__(self, message: str, outside_mask: bool = False):
        super().__init__(message)
        self.outside_mask = outside_mask


class ConstraintCompiler:
    """Constraints compiled against the model's tokenizer (tokenizer.json text) for a vocabulary of vocab_size
    logits (the masks' width; may exceed the tokenizer's), EOS = eos_token_ids."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids, cache_size: int = CACHE_SIZE):
        import llguidance

        self._llg = llguidance
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)  # what it was built for
        # One EOS id for llguidance (releases before 1.9 take no list); GrammarMatcher.mask sets or clears every
        # EOS id's bit itself.
        first_eos = self.eos_token_ids[0] if self.eos_token_ids else None
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=first_eos)
        self.words = -(-vocab_size // 32)
        self._cache: collections.OrderedDict[Constraint, Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def matcher(
        self, constraint: Constraint, ignore_eos: bool = False, wanted: Callable[[], bool] = lambda: True
    ) -> GrammarMatcher:
        """A fresh matcher; raises InvalidRequestError (one line) for a constraint llguidance cannot compile.
        A new constraint's lexer is built here (up to a fraction of a second within LIMITS): call it off the event
        loop (`grammar_compiles.compile_matcher` does; llguidance releases the GIL). A compile stops with
        CompileAbandoned where `wanted()` turns false (its caller gone), before each costly part."""
        with self._lock:
            template = self._cache.get(constraint)
            if template is not None:
                self._cache.move_to_end(constraint)
                self.hits += 1
        if template is None:
            template = self._compile(constraint, wanted)
            with self._lock:
                self.misses += 1
                self._cache[constraint] = template
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), self.words, self.eos_token_ids, not ignore_eos)

    def _compile(self, constraint: Constraint, wanted: Callable[[], bool]):
        field = f"{FIELD}.{constraint.kind}"
        _go_on(wanted)
        grammar = constraint.grammar()
        limits = self._llg.LLParserLimits(**LIMITS)
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=limits)
        if is_error:
            raise InvalidRequestError(field, _one_line(messages[0]))
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        # The first mask builds the lexer (the costly part, kept by every copy) and fails for a grammar that can
        # match nothing (a schema that is only a $ref to itself): both belong to the compile, not to a step.
        if matcher.is_error():
            raise InvalidRequestError(field, _one_line(matcher.get_error()))
        _go_on(wanted)
        matcher.compute_bitmask()
        if matcher.is_error():
            raise InvalidRequestError(field, f"no output can start: {_one_line(matcher.get_error())}")
        return matcher


class CompileAbandoned(Exception):
    """A compile stopped part-way: its caller had gone (cancelled, or past its deadline)."""


def _go_on(wanted: Callable[[], bool]) -> None:
    if not wanted():
        raise CompileAbandoned


def any_token_mask(vocab_size: int) -> bytes:
    """A mask allowing every token: packed little-endian bits, ceil(vocab_size / 32) words."""
    bits = np.zeros(-(-vocab_size // 32) * 32, np.uint8)
    bits[:vocab_size] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def may_mask_late(req) -> bool:
    """Whether a constrained request's masks may come late (a ValidatedRequest): the worker takes the device's
    argmax as its token (greedy, no logprobs, no penalties, no logit bias, nothing suppressed before
    min_new_tokens), as a late mask needs."""
    return (
        req.temperature == 0
        and not req.logprobs
        and not req.penalized
        and not req.logit_bias
        and not req.min_new_tokens
    )


def late_mask_ids(step, requests: Mapping[int, Any]) -> tuple[int, ...]:
    """The constrained decodes of `step` (a ScheduledStep) whose input token is still pending: their masks go
    with the next message, once that token is back."""
    return tuple(
        seq_id
        for seq_id, token in zip(step.decode_ids, step.decode_token_ids)
        if token < 0 and (state := requests.get(seq_id)) is not None and state.matcher is not None
    )


def step_masks(step, requests: Mapping[int, Any], vocab_size: int, skip=frozenset()) -> dict[int, bytes]:
    """The grammar mask of each constrained request sampling in `step` (a ScheduledStep: its prompt ends, or it
    decodes) but those in `skip` (late); `requests`: id -> the batching loop's request state (its `matcher`, None
    when unconstrained). A matcher that fails still gets a mask (any token) and records `grammar_error`: the
    answer fails the request."""
    sampling = [c.request_id for c in step.prefill_chunks if c.is_last] + list(step.decode_ids)
    return masks_of([s for s in sampling if s not in skip], requests, vocab_size)


def masks_of(seq_ids, requests: Mapping[int, Any], vocab_size: int) -> dict[int, bytes]:
    """The current grammar mask of each of `seq_ids` that is a live constrained request."""
    masks = {}
    for seq_id in seq_ids:
        state = requests.get(seq_id)
        if state is None or state.matcher is None:
            continue
        try:
            masks[seq_id] = state.matcher.mask()
        except GrammarError as e:
            state.grammar_error = str(e)
            masks[seq_id] = any_token_mask(vocab_size)
    return masks
