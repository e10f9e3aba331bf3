"""Tool calls in generated text: the formats the served families write them in, and a parser that turns a reply
(whole or streamed) into content and OpenAI-style calls.

Formats (router_service.tool_calls.FORMATS; docs/api.md shows each):
- `hermes` (Qwen2.5/Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  the JSON usually on its own line; text outside the tags is content.
- `mistral`: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects; text before it is content.
- `generic` (any template, the default model's): the whole reply is `{"tool_calls": [{"name": ..., "arguments":
  {...}}, ...]}`; any other reply is content.

A call is sent only once it is complete and valid (its closing tag, its array element or the whole reply parsed,
its name one of the request's tools, its arguments a JSON object): a malformed call is never half-sent, and text
that looks like a call but does not parse stays content. The streamed events, concatenated, are exactly the
unary answer, since both come from this one parser. Whitespace next to a call is layout, not content: the
content is the text outside calls with the whitespace around each call left out (text on both sides of a call
stays joined by the whitespace before it); with no call it is the reply's text unchanged.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from router_service.json_text import strict_json

FORMATS = ("hermes", "mistral", "generic")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
CALL_KEYS = frozenset({"name", "arguments", "id"})  # Mistral models may write an id: the router assigns its own


_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect_format(template_source: str | None) -> str:
    """The tool-call format a chat template teaches its model (hermes / mistral, else generic)."""
    source = template_source or ""
    if HERMES_OPEN in source:
        return "hermes"
    if MISTRAL_MARKER in source:
        return "mistral"
    return "generic"


@dataclass(frozen=True)
class ToolCall:
    """One complete call: `arguments` is the JSON text of an object (OpenAI's wire form)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call `index`: the first carries id and name (arguments ""), the next the arguments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


Event = str | ToolCallDelta  # content text, or a piece of a call


def _call(obj, names: frozenset[str] | None) -> tuple[str, str] | None:
    """(name, arguments JSON) when `obj` is a valid call to one of `names` (any name when None)."""
    if not isinstance(obj, dict) or not set(obj) <= CALL_KEYS or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        # a number past float range (1e999) was read as infinity, which JSON cannot write back; a lone surrogate
        # escape ("\ud800") is no character, which UTF-8 cannot encode (UnicodeEncodeError is a ValueError)
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode()
    except ValueError:
        return None
    return obj["name"], text


def _loads(text: str):
    """The JSON value of `text` as the standard reads it (no NaN or Infinity); None when it is not JSON.
    RecursionError: nested deeper than Python's parser goes (a model can write brackets without end)."""
    try:
        return strict_json(text)
    except (ValueError, RecursionError):
        return None


def _hermes_end(body: str) -> int | None:
    """Where the closing tag that ends a hermes call starts in `body` (the text after its opening tag); None: not
    yet known. The call's JSON is read first, so a closing tag inside one of its strings (a call that writes
    markup) does not end it; a body that is not JSON ends at the first tag, as does text after the JSON."""
    first = body.find(HERMES_CLOSE)
    if first < 0:
        return None
    try:
        _, end = _DECODER.raw_decode(body, _skip_space(body, 0))
    except json.JSONDecodeError as e:  # cut short (a string still open, the text ends mid-value): wait
        return None if e.msg.startswith("Unterminated string") or e.pos >= len(body) else first
    except (ValueError, RecursionError):
        return first
    after = _skip_space(body, end)
    if body.startswith(HERMES_CLOSE, after):
        return after
    return None if HERMES_CLOSE.startswith(body[after:]) else first


def _held_prefix(text: str, tag: str) -> int:
    """Where the longest suffix of `text` that starts `tag` begins (len(text) if none)."""
    for i in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[i:]):
            return i
    return len(text)


class ToolCallParser:
    """Streams one reply: `feed` each new piece of text, then `finish`; each returns events in order.
    `names`: the request's tool names (a call to another name is content); `parallel`: False keeps only the
    first call (any later one is content)."""

    def __init__(self, fmt: str, names=None, parallel: bool = True):
        if fmt not in FORMATS:
            raise ValueError(f"tool call format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fmt, self.parallel = fmt, parallel
        self.names = frozenset(names) if names is not None else None
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self._buffer = ""
        self._inside = False  # hermes: after an opening tag; mistral: after the marker
        self._elements: int | None = None  # mistral: array elements taken (None: before its "[")
        self._generic: str | None = None  # generic: "json" (the reply starts with "{") or "text", once known
        self._space = ""  # trailing whitespace of the content: dropped if a call follows
        self._after_call = False  # leading whitespace after a call is dropped too
        self._done = False
        # The reply ended inside a call (a stop string or max_tokens cut it): its markup went to the content, and
        # the calls before it do not make the reply one that ended after its calls.
        self.ended_in_call = False

    @property
    def text(self) -> str:
        """The content so far."""
        return "".join(self.content)

    def feed(self, text: str) -> list[Event]:
        if self._done:
            raise RuntimeError("feed after finish")
        self._buffer += text
        out: list[Event] = []
        if self.fmt == "generic":
            self._feed_generic(out)
        elif self.fmt == "hermes":
            self._feed_hermes(out)
        else:
            self._feed_mistral(out)
        return out

    def finish(self) -> list[Event]:
        """The rest: a call still open is accepted if it parses whole (a reply cut at max_tokens is not)."""
        if self._done:
            return []
        self._done = True
        out: list[Event] = []
        rest, self._buffer = self._buffer, ""
        if self.fmt == "generic" and self._generic == "json":
            value = _loads(rest)
            calls = value.get("tool_calls") if isinstance(value, dict) and set(value) == {"tool_calls"} else None
            parsed = [_call(c, self.names) for c in calls] if isinstance(calls, list) and calls else []
            if parsed and all(parsed) and (self.parallel or len(parsed) == 1):
                for call in parsed:
                    self._emit_call(out, *call)  # type: ignore[misc]
            else:
                self._content(out, rest)
        elif self.fmt == "hermes" and self._inside:
            call = _call(_loads(rest), self.names)
            if call is not None and self._may_call():
                self._emit_call(out, *call)
            else:
                self.ended_in_call = call is None
                self._content(out, HERMES_OPEN + rest)
        elif self.fmt == "mistral" and self._inside:
            self.ended_in_call = bool(rest.strip()) or self._elements is None
            self._content(out, (MISTRAL_MARKER if self._elements is None else "") + rest)
        else:
            self._content(out, rest)
        if self._space and not self.calls:
            self._append(out, self._space)
        self._space = ""
        return out

    # ---- formats ----
    def _feed_generic(self, out: list[Event]) -> None:
        if self._generic is None:
            stripped = self._buffer.lstrip()
            if not stripped:
                return
            self._generic = "json" if stripped.startswith("{") else "text"
        if self._generic == "text":
            self._content(out, self._buffer)
            self._buffer = ""
        # "json": the reply is one JSON value, held until finish

    def _feed_hermes(self, out: list[Event]) -> None:
        while True:
            if not self._inside:
                at = self._buffer.find(HERMES_OPEN)
                if at < 0:
                    cut = _held_prefix(self._buffer, HERMES_OPEN)
                    self._content(out, self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return
                self._content(out, self._buffer[:at])
                self._buffer, self._inside = self._buffer[at + len(HERMES_OPEN) :], True
            end = _hermes_end(self._buffer)
            if end is None:
                return
            body, self._buffer, self._inside = self._buffer[:end], self._buffer[end + len(HERMES_CLOSE) :], False
            call = _call(_loads(body), self.names)
            if call is not None and self._may_call():
                self._emit_call(out, *call)
            else:
                self._content(out, HERMES_OPEN + body + HERMES_CLOSE)

    def _feed_mistral(self, out: list[Event]) -> None:
        # The buffer keeps the text after the marker until a call is taken from it, so that an array that
        # yields no call goes out as content whole, marker included.
        while True:
            if not self._inside:
                at = self._buffer.find(MISTRAL_MARKER)
                if at < 0:
                    cut = _held_prefix(self._buffer, MISTRAL_MARKER)
                    self._content(out, self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return
                self._content(out, self._buffer[:at])
                self._buffer, self._inside, self._elements = self._buffer[at + len(MISTRAL_MARKER) :], True, None
            text = self._buffer
            i = _skip_space(text, 0)
            if i == len(text):
                return
            if self._elements is None:  # the array's first element, after its "["
                if text[i] != "[":
                    return  # not the array the marker promised: content at finish
                i = _skip_space(text, i + 1)
            elif text[i] == "]":
                self._buffer, self._inside = text[i + 1 :], False
                continue
            elif text[i] == ",":
                i = _skip_space(text, i + 1)
            else:
                return
            try:
                obj, end = json.JSONDecoder().raw_decode(text, i)
            except (ValueError, RecursionError):
                return  # incomplete, malformed or nested too deeply (then content at finish)
            call = _call(obj, self.names)
            if call is None or not self._may_call():
                return
            self._emit_call(out, *call)
            self._elements = (self._elements or 0) + 1
            self._buffer = text[end:]

    # ---- output ----
    def _may_call(self) -> bool:
        return self.parallel or not self.calls

    def _emit_call(self, out: list[Event], name: str, arguments: str) -> None:
        self._after_call = True
        call = ToolCall(new_call_id(), name, arguments)
        index = len(self.calls)
        self.calls.append(call)
        out.append(ToolCallDelta(index, id=call.id, name=name))
        out.append(ToolCallDelta(index, arguments=arguments))

    def _content(self, out: list[Event], text: str) -> None:
        # Whitespace next to a call is layout: trailing whitespace is held until more content follows, and
        # after a call the content resumes at its first non-space character, joined by the held whitespace.
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._space += text
            return
        self._append(out, (self._space if self.content or not self.calls else "") + body)
        self._space = text[len(body) :]

    def _append(self, out: list[Event], text: str) -> None:
        self.content.append(text)
        out.append(text)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def parse_tool_calls(text: str, fmt: str, names=None, parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and calls (what feeding it to a ToolCallParser in any pieces gives)."""
    parser = ToolCallParser(fmt, names, parallel)
    parser.feed(text)
    parser.finish()
    return parser.text, parser.calls
