"""The OpenAI front's constraint fields as one `Constraint`: OpenAI's `response_format` (json_object, json_schema),
vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and its newer `structured_outputs`
object. A request names at most one; every malformed value is a 400 naming the field."""

from __future__ import annotations

import re

from common.errors import InvalidRequestError
from router_service.constraints import Constraint

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANY_OBJECT = {"type": "object"}


class ConstraintFieldError(ValueError):
    """A constraint field's value is malformed: (param, message) for the 400."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def request_constraint(body: dict) -> tuple[str, Constraint] | None:
    """The one constraint `body` asks for and the request field that holds it (the `param` of a 400 when the
    grammar engine refuses it later); None: plain text."""
    found: list[tuple[str, Constraint]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        requested = _response_format(response_format)
        if requested is not None:
            found.append(requested)
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _of_kind(name, kind, body[name])))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.append(_structured(structured))
    if len(found) > 1:
        names = ", ".join(name.split(".")[0] for name, _ in found)
        raise ConstraintFieldError(found[1][0].split(".")[0], f"one constraint per request, got {names}")
    return found[0] if found else None


def _checked(param: str, make) -> Constraint:
    try:
        return make()
    except InvalidRequestError as e:
        raise ConstraintFieldError(param, str(e).split(": ", 1)[-1]) from None


def _of_kind(param: str, kind: str, value) -> Constraint:
    if kind == "json":
        if not isinstance(value, dict | str | bool):
            raise ConstraintFieldError(param, "must be a JSON Schema (an object, or its JSON text)")
        return _checked(param, lambda: Constraint.json_schema(value))
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ConstraintFieldError(param, "must be a list of strings")
        return _checked(param, lambda: Constraint("choice", tuple(value)))
    if not isinstance(value, str):
        raise ConstraintFieldError(param, "must be a string")
    return _checked(param, lambda: Constraint(kind, value))


def _response_format(value) -> tuple[str, Constraint] | None:
    """The field holding the constraint and the constraint (None: type text)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConstraintFieldError("response_format", 'must be an object with a "type"')
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise ConstraintFieldError(f"response_format.{extra[0]}", "unknown field")
    if kind in ("text", "json_object") and value.get("json_schema") is not None:  # not dropped silently
        raise ConstraintFieldError(
            "response_format.json_schema", f'only with type "json_schema" (it would be ignored), got type {kind!r}'
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", Constraint.json_schema(ANY_OBJECT)
    if kind != "json_schema":
        raise ConstraintFieldError(
            "response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}'
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ConstraintFieldError("response_format.json_schema", "required with type json_schema: an object")
    extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if extra:
        raise ConstraintFieldError(f"response_format.json_schema.{extra[0]}", "unknown field")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise ConstraintFieldError("response_format.json_schema.name", "required: 1-64 of a-z, A-Z, 0-9, _ and -")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ConstraintFieldError("response_format.json_schema.strict", "must be a boolean")
    schema = spec.get("schema", {})  # OpenAI: no schema = any JSON value
    if not isinstance(schema, dict):
        raise ConstraintFieldError("response_format.json_schema.schema", "must be a JSON Schema object")
    param = "response_format.json_schema.schema"
    return param, _checked(param, lambda: Constraint.json_schema(schema))


def _structured(value) -> tuple[str, Constraint]:
    """The field holding the constraint (structured_outputs.<key>) and the constraint."""
    if not isinstance(value, dict):
        raise ConstraintFieldError("structured_outputs", "must be an object")
    unknown = sorted(set(value) - set(STRUCTURED_KEYS))
    if unknown:
        raise ConstraintFieldError(f"structured_outputs.{unknown[0]}", "not supported by this server")
    given = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise ConstraintFieldError("structured_outputs", f"set exactly one of {', '.join(STRUCTURED_KEYS)}")
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json_object":
        if value[key] is not True:
            raise ConstraintFieldError(param, "must be true")
        return param, Constraint.json_schema(ANY_OBJECT)
    return param, _of_kind(param, key, value[key])
