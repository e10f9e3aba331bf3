"""What `tool_choice: required` or a named function forces the reply to be, in the served template's format
(router_service.tool_calls): a JSON schema (generic) or a Lark grammar for llguidance (hermes, mistral, whose
calls sit between tags or after a marker token). `auto` and `none` force nothing.

Each call must be {"name": <an allowed tool>, "arguments": <that tool's parameters schema>}; `parallel` allows
more than one. The reply then always parses as calls (tool_calls.ToolCallParser), whatever the model prefers.
"""

from __future__ import annotations

import json

from common.errors import InvalidRequestError
from router_service import constraints

JSON_SCHEMA, LARK = "json_schema", "lark"  # constraint kinds (the constraint engine's json_schema / grammar)


def call_schema(tools: list[dict], choice: str) -> dict:
    """The schema of one call: to the named tool, or to any of `tools` when `choice` is "required"."""
    allowed = [t for t in tools if choice == "required" or t["name"] == choice]
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                # a tool without parameters takes {} (OpenAI's reading), not any object
                "arguments": t.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in allowed
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def tool_call_constraint(
    tools: list[dict], choice: str, parallel: bool, fmt: str, marker_token_id: int | None = None
) -> tuple[str, str] | None:
    """(kind, spec) the reply must match for `choice` ("required" or a tool's name), None for "auto"/"none".
    `tools`: OpenAI function dicts ({"name", "parameters", ...}); `marker_token_id`: the id of Mistral's
    [TOOL_CALLS] special token (a grammar can only name a special token by id: its text is not its bytes)."""
    if choice in ("auto", "none"):
        return None
    call = call_schema(tools, choice)
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
    body = f"body: %json {json.dumps(call)}"
    if fmt == "hermes":
        one = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return LARK, "\n".join([start, one, body])
    if fmt == "mistral":
        if marker_token_id is None:
            raise InvalidRequestError(
                "tool_choice", "the model's tokenizer has no [TOOL_CALLS] token, which its chat template uses"
            )
        more = ' ("," " "? body)*' if parallel else ""  # Mistral's templates write ", " between calls
        return LARK, "\n".join([f'start: <[{marker_token_id}]> "[" body{more} "]"', body])
    raise ValueError(f"unknown tool call format {fmt!r}")


def attach_tool_constraint(parameters, constraint: tuple[str, str]) -> None:
    """Puts `constraint` on the request's SamplingParameters, so the worker masks every token the constraint
    engine rules out and a forced call always parses. A request that already carries its own constraint
    (response_format, guided_*) is refused: the reply cannot match both."""
    if parameters.HasField("constraint"):
        raise InvalidRequestError(
            "tool_choice", "a forced tool call cannot be combined with response_format or guided_*"
        )
    kind, spec = constraint
    parameters.constraint.CopyFrom(
        constraints.to_pb(constraints.Constraint("grammar" if kind == "lark" else kind, spec))
    )
