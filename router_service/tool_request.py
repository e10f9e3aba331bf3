"""A chat request's tools, as the router's domain: checked from OpenAI's JSON or the gRPC messages into one
ToolRequest, plus the message fields a tool conversation adds (an assistant's `tool_calls`, a tool result's
`tool_call_id`, a `name`), turned into what chat templates expect (transformers' conventions: arguments as a
dict, tools as {"type": "function", "function": {...}}). Errors name the field, as the caller wrote it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from common.errors import InvalidRequestError
from router_service.errors import clipped
from router_service.json_text import strict_json

MAX_TOOLS = 128  # OpenAI's own limit
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
MODES = ("none", "auto", "required")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
# What the openai package adds to a call it returns (its stream helper's position, its parse of the arguments):
# echoed back with the message, they repeat what the call holds.
CALL_IGNORED, FUNCTION_IGNORED = frozenset({"index"}), frozenset({"parsed_arguments"})


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat offers and how the model may use them."""

    tools: tuple[dict, ...]  # function dicts: {"name", "description"?, "parameters"?}, as the caller sent them
    choice: str = "auto"  # "none", "auto", "required", or the name of the one function to call
    parallel: bool = True  # more than one call per reply
    strict: frozenset[str] = frozenset()  # tools whose calls must match their parameters schema (strict: true)
    strict_field: str = ""  # where the first strict flag was written, for errors ("tools[1].function.strict")
    parameters_key: str = "function.parameters"  # where a tool's schema was written: tools[i].<this>

    def parameters_field(self, index: int) -> str:
        """The field of tool `index`'s parameters schema, as the caller wrote it (for errors)."""
        return f"tools[{index}].{self.parameters_key}"

    @property
    def names(self) -> list[str]:
        return [t["name"] for t in self.tools]

    @property
    def is_forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def is_constrained(self) -> bool:
        """The reply is constrained: a forced call, or "auto" with a strict tool (text, or calls that match)."""
        return self.is_forced or (self.choice == "auto" and bool(self.strict))

    def template_tools(self) -> list[dict] | None:
        """The `tools` variable of the chat template; None (no tools) with tool_choice "none"."""
        if self.choice == "none" or not self.tools:
            return None
        return [{"type": "function", "function": dict(t)} for t in self.tools]


def check_tool_count(count: int) -> None:
    if count > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {count}")


def _function(value, where: str, parameters_key: str = "parameters") -> dict:
    """One function, checked; `parameters_key`: the parameters' field as the caller wrote it (gRPC's
    parameters_json)."""
    if not isinstance(value, dict):
        raise InvalidRequestError(where, "must be an object")
    unknown = sorted(set(value) - FUNCTION_KEYS)
    if unknown:
        raise InvalidRequestError(f"{where}.{unknown[0]}", "unknown field")
    name = value.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequestError(f"{where}.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    out: dict = {"name": name}
    description = value.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise InvalidRequestError(f"{where}.description", "must be a string")
        out["description"] = description
    parameters = value.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{where}.{parameters_key}", "must be a JSON Schema object")
        kind = parameters.get("type")
        if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
            # a call's arguments are an object: the parser takes nothing else, so the tool could never be called
            raise InvalidRequestError(
                f"{where}.{parameters_key}",
                f'must be a JSON Schema of type "object" (the arguments), got {json.dumps(kind)}',
            )
        out["parameters"] = parameters
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.strict", "must be a boolean")
    if strict:
        out["strict"] = True
    return out


def _check(
    functions: list[dict], choice: str, parallel: bool, field: str, strict_key: str, parameters_key: str
) -> ToolRequest:
    names = [f["name"] for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequestError(f"{field}[{i}].function.name", f"duplicate function name {name!r}")
    if choice not in MODES and choice not in names:
        raise InvalidRequestError("tool_choice", f"names function {choice!r}, which is not among the tools")
    if choice == "required" and not functions:
        raise InvalidRequestError("tool_choice", '"required" needs tools')
    strict = [i for i, f in enumerate(functions) if f.get("strict")]
    # The template sees what the model needs; strict is the API's flag.
    tools = tuple({k: v for k, v in f.items() if k != "strict"} for f in functions)
    return ToolRequest(
        tools,
        choice,
        parallel,
        frozenset(names[i] for i in strict),
        f"{field}[{strict[0]}].{strict_key}" if strict else "",
        parameters_key,
    )


def from_openai(body: dict) -> ToolRequest | None:
    """The request's tools, tool_choice and parallel_tool_calls; None when it offers no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", "must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be a list of {type: function, function: {...}} objects")
    check_tool_count(len(tools))
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(f"tools[{i}].type", 'must be "function" (the only kind of tool)')
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise InvalidRequestError(f"tools[{i}].{unknown[0]}", "unknown field")
        functions.append(_function(tool.get("function"), f"tools[{i}].function"))
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or set(choice) != {"type", "function"}:
            raise InvalidRequestError("tool_choice", 'must be {"type": "function", "function": {"name": ...}}')
        if set(function) != {"name"} or not isinstance(function["name"], str):
            raise InvalidRequestError("tool_choice.function", 'must be {"name": ...}')
        choice = function["name"]
        if choice in MODES:  # a function named like a mode would be ambiguous inside the router
            raise InvalidRequestError("tool_choice.function.name", f"{choice!r} is reserved; rename the function")
    elif choice not in MODES:
        raise InvalidRequestError("tool_choice", '"none", "auto", "required" or {"type": "function", ...}')
    return _check(
        functions, choice, True if parallel is None else parallel, "tools", "function.strict", "function.parameters"
    )


def from_pb(request) -> ToolRequest | None:
    """The tools of a ChatRequest / ChatStreamRequest (fields tools, tool_choice, parallel_tool_calls)."""
    mode = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    choice = "auto"
    if mode == "mode":
        modes = {0: "auto", 1: "none", 2: "auto", 3: "required"}
        if request.tool_choice.mode not in modes:
            raise InvalidRequestError("tool_choice.mode", f"unknown value {request.tool_choice.mode}")
        choice = modes[request.tool_choice.mode]
    elif mode == "function_name":
        choice = request.tool_choice.function_name
    if not request.tools:
        if choice not in ("none", "auto"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    check_tool_count(len(request.tools))
    functions = []
    for i, tool in enumerate(request.tools):
        value: dict = {"name": tool.name}
        if tool.description:
            value["description"] = tool.description
        if tool.parameters_json:
            try:
                value["parameters"] = strict_json(tool.parameters_json)
            except ValueError as e:
                raise InvalidRequestError(f"tools[{i}].parameters_json", f"not JSON: {e}") from None
            except RecursionError:  # JSON text nested deeper than Python's parser goes
                raise InvalidRequestError(f"tools[{i}].parameters_json", "is nested too deeply") from None
        if tool.strict:
            value["strict"] = True
        functions.append(_function(value, f"tools[{i}]", "parameters_json"))
    if mode == "function_name" and choice in MODES:
        raise InvalidRequestError("tool_choice.function_name", f"{choice!r} is reserved; rename the function")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return _check(functions, choice, parallel, "tools", "strict", "parameters_json")


# ---- messages ----
def message_tool_fields(message, where: str) -> dict:
    """The tool fields of one message (an OpenAI dict or a ChatMessage proto) as the template sees them:
    tool_calls [{"id", "type": "function", "function": {"name", "arguments": dict}}], tool_call_id, name."""
    out: dict = {}
    if isinstance(message, dict):
        calls, call_id, name = message.get("tool_calls"), message.get("tool_call_id"), message.get("name")
        if calls is not None and not isinstance(calls, list):
            raise InvalidRequestError(f"{where}.tool_calls", "must be a list")
        parsed = [_openai_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls or ())]
    else:
        call_id, name = message.tool_call_id or None, message.name or None
        parsed = [
            _call_dict(c.id, c.name, c.arguments, f"{where}.tool_calls[{j}]") for j, c in enumerate(message.tool_calls)
        ]
    for key, value in (("tool_call_id", call_id), ("name", name)):
        if value is not None:
            if not isinstance(value, str):
                raise InvalidRequestError(f"{where}.{key}", "must be a string")
            out[key] = value
    if parsed:
        out["tool_calls"] = parsed
    return out


def _openai_call(call, where: str) -> dict:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise InvalidRequestError(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    unknown = sorted(set(call) - {"id", "type", "function"} - CALL_IGNORED)
    if unknown:
        raise InvalidRequestError(f"{where}.{unknown[0]}", "unknown field")
    function = call.get("function")
    if not isinstance(function, dict) or not set(function) <= {"name", "arguments"} | FUNCTION_IGNORED:
        raise InvalidRequestError(f"{where}.function", 'must be {"name", "arguments"}')
    return _call_dict(call.get("id", ""), function.get("name"), function.get("arguments", "{}"), where)


def _call_dict(call_id, name, arguments, where: str) -> dict:
    if not isinstance(call_id, str):
        raise InvalidRequestError(f"{where}.id", "must be a string")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.function.name", "must be a non-empty string")
    if isinstance(arguments, str):
        try:
            arguments = strict_json(arguments or "{}")
        except ValueError as e:  # the parser's reason: a position, a lone surrogate, NaN, ...
            raise InvalidRequestError(
                f"{where}.function.arguments", f"must be the JSON text of an object: {clipped(str(e))}"
            ) from None
        except RecursionError:  # JSON text nested deeper than Python's parser goes
            raise InvalidRequestError(f"{where}.function.arguments", "is nested too deeply") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.function.arguments", "must be the JSON text of an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def mistral_ids(messages: list[dict]) -> list[dict]:
    """Mistral's templates refuse call ids that are not 9 letters and digits: each other id becomes one
    derived from it (the same in an assistant's call and in the tool result answering it)."""

    def short(call_id: str) -> str:
        if MISTRAL_ID.fullmatch(call_id):
            return call_id
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        return "".join(alphabet[(digest // 62**k) % 62] for k in range(9))

    out = []
    for m in messages:
        m = dict(m)
        if "tool_call_id" in m:
            m["tool_call_id"] = short(m["tool_call_id"])
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "id": short(c["id"])} for c in m["tool_calls"]]
        out.append(m)
    return out
