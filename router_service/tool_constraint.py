"""What `tool_choice: required` or a named function forces the reply to be, in the served template's format
(router_service.tool_calls): a JSON schema (generic) or a Lark grammar for llguidance (hermes, mistral, whose
calls sit between tags or after a marker token). `none`, and `auto` without a strict tool, force nothing.

Each call must be {"name": <an allowed tool>, "arguments": <that tool's parameters schema>}; `parallel` allows
more than one. The reply then always parses as calls (tool_calls.ToolCallParser), whatever the model prefers.

`auto` with a strict tool: the reply is free text, or text then calls, where a strict tool's arguments match its
schema (any other tool's: any object). Text is whatever does not contain the call marker, so it can never start
a call that escapes the grammar. The generic format cannot be constrained so: its call is a reply that is one
JSON object, and text may be JSON too, so that case is refused.
"""

from __future__ import annotations

import json

from common.errors import InvalidRequestError
from router_service import constraints

JSON_SCHEMA, LARK = "json_schema", "lark"  # constraint kinds (the constraint engine's json_schema / grammar)


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_schema(tools: list[dict], choice: str, strict: frozenset[str] | None = None) -> dict:
    """The schema of one call: to the named tool, or to any of `tools` when `choice` is "required" or "auto".
    With `strict` (auto), only those tools' arguments are held to their schema; the others' are any object."""
    allowed = [t for t in tools if choice in ("required", "auto") or t["name"] == choice]

    def arguments(t: dict) -> dict:
        if strict is not None and t["name"] not in strict:
            return {"type": "object"}
        # a tool without parameters takes {} (OpenAI's reading), not any object
        return _own_document(t["name"], t["parameters"]) if t.get("parameters") else NO_PARAMETERS

    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, "arguments": arguments(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in allowed
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def _own_document(name: str, parameters: dict) -> dict:
    """A tool's parameters schema as a resource of its own (an `$id`), so its `$ref`s ("#/$defs/...", "#") resolve
    in it rather than in the call schema around it; held to an object, which is all the call parser takes."""
    own = parameters if "$id" in parameters else {"$id": f"urn:colibri:tool:{name}", **parameters}
    return own if own.get("type") == "object" else {"type": "object", "allOf": [own]}


def tool_call_constraint(
    tools: list[dict],
    choice: str,
    parallel: bool,
    fmt: str,
    marker_token_id: int | None = None,
    strict: frozenset[str] = frozenset(),
    strict_field: str = "tools",
) -> tuple[str, str] | None:
    """(kind, spec) the reply must match for `choice` ("required", a tool's name, or "auto" with `strict` tool
    names), None for "none" and for "auto" without strict tools. `tools`: OpenAI function dicts ({"name",
    "parameters", ...}); `marker_token_id`: the id of Mistral's [TOOL_CALLS] special token (a grammar can only
    name a special token by id: its text is not its bytes); `strict_field`: where a refused strict flag was."""
    if choice == "none" or (choice == "auto" and not strict):
        return None
    if choice == "auto":
        return _text_or_calls(tools, strict, parallel, fmt, marker_token_id, strict_field)
    call = call_schema(tools, choice)
    parallel = parallel and choice == "required"  # a named function is called exactly once, as OpenAI's is
    if fmt == "generic":
        calls = {"type": "array", "items": call, "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        schema = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        return JSON_SCHEMA, json.dumps(schema)
    body = f"body: %json {json.dumps(constraints.prepared_schema(call))}"
    if fmt == "hermes":
        one = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return LARK, "\n".join([start, one, body])
    if fmt == "mistral":
        more = ' ("," " "? body)*' if parallel else ""  # Mistral's templates write ", " between calls
        return LARK, "\n".join([f'start: {_marker(marker_token_id)} "[" body{more} "]"', body])
    raise ValueError(f"unknown tool call format {fmt!r}")


def _marker(marker_token_id: int | None) -> str:
    if marker_token_id is None:
        raise InvalidRequestError(
            "tool_choice", "the model's tokenizer has no [TOOL_CALLS] token, which its chat template uses"
        )
    return f"<[{marker_token_id}]>"


def _text_or_calls(
    tools: list[dict], strict: frozenset[str], parallel: bool, fmt: str, marker_token_id: int | None, field: str
) -> tuple[str, str]:
    """tool_choice "auto" with strict tools: free text (none, or any not holding the call marker), or such text
    then calls that match."""
    if fmt == "generic":
        raise InvalidRequestError(
            field,
            'true with tool_choice "auto" needs a hermes or mistral chat template: in the generic format a call '
            "is a reply that is one JSON object, which text can be too; force the call or drop strict",
        )
    body = f"body: %json {json.dumps(constraints.prepared_schema(call_schema(tools, 'auto', strict)))}"
    if fmt == "hermes":
        # `open` is lazy: it ends at the first "<tool_call>\n", so the text before a call never holds the tag,
        # and TEXT (greedy) may hold anything but the tag: a reply without a call.
        more = ' ("\\n" call)*' if parallel else ""
        return LARK, "\n".join(
            [
                f'start: TEXT? | open body "\\n</tool_call>"{more}',
                'call: "<tool_call>\\n" body "\\n</tool_call>"',
                "open[lazy]: /(.|\\n)*<tool_call>\\n/",
                "TEXT: /(.|\\n)+/ & ~/(.|\\n)*<tool_call>(.|\\n)*/",
                body,
            ]
        )
    if fmt == "mistral":
        # The marker is a special token, named by id; text must not spell it out in bytes either, since the
        # parser reads the decoded text, where the two look alike.
        more = ' ("," " "? body)*' if parallel else ""
        return LARK, "\n".join(
            [
                f'start: TEXT? | TEXT? {_marker(marker_token_id)} "[" body{more} "]"',
                "TEXT: /(.|\\n)+/ & ~/(.|\\n)*\\[TOOL_CALLS\\](.|\\n)*/",
                body,
            ]
        )
    raise ValueError(f"unknown tool call format {fmt!r}")


def schema_error(tools, error: InvalidRequestError) -> InvalidRequestError:
    """The error of a call grammar that did not build or compile (`error`, naming parameters.constraint), naming the
    first tool (a ToolRequest's) whose own call schema fails alone: the grammar is the router's, built from every
    tool, so its error named no tool and, in a Lark grammar, a line and column of the router's text. Else `tools`.
    Each schema is checked alone without the vocabulary (constraints.schema_check), well under a millisecond."""
    for index, tool in enumerate(tools.tools):
        held = tools.choice in ("required", tool["name"]) or (tools.choice == "auto" and tool["name"] in tools.strict)
        if not held or not tool.get("parameters"):
            continue
        try:
            constraints.schema_check(constraints.Constraint.json_schema(call_schema([tool], tool["name"])))
        except InvalidRequestError as e:
            return InvalidRequestError(tools.parameters_field(index), e.detail)
    return InvalidRequestError("tools", error.detail)


def attach_tool_constraint(parameters, constraint: tuple[str, str], field: str = "tool_choice") -> None:
    """Puts `constraint` on the request's SamplingParameters, so the worker masks every token the constraint
    engine rules out and a forced call always parses. A request that already carries its own constraint
    (response_format, guided_*) is refused, naming `field`: tool_choice for a forced call, else the first strict
    flag (tool_choice "auto" with strict tools, where the client may never have sent tool_choice)."""
    if parameters.HasField("constraint"):
        what = "a forced tool call" if field == "tool_choice" else 'a strict tool under tool_choice "auto"'
        raise InvalidRequestError(
            field,
            f"{what} cannot be combined with a constraint of the request's own (response_format, guided_* or "
            "structured_outputs; on gRPC parameters.constraint): the reply cannot match both",
        )
    kind, spec = constraint
    size = len(spec.encode())
    if size > constraints.MAX_SPEC_BYTES:  # the grammar is the router's, built from the tools the client sent
        raise InvalidRequestError(
            "tools",
            f"the call grammar built from their schemas must be at most {constraints.MAX_SPEC_BYTES} bytes, got "
            f"{size}: offer fewer or smaller tools",
        )
    parameters.constraint.CopyFrom(
        constraints.to_pb(constraints.Constraint("grammar" if kind == "lark" else kind, spec))
    )
