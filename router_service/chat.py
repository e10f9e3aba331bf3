"""Chat templates: the model's Jinja2 template renders a conversation into the prompt text, as `transformers`'
`apply_chat_template` does.

The template comes from the model directory (`chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`: a string, or a list of named templates of which "default" is used) or from the router's
`--chat-template FILE`. It runs in Jinja2's ImmutableSandboxedEnvironment (templates from a model hub are
untrusted code) with the globals and filters transformers gives templates: `raise_exception`, `strftime_now`,
a limited `dict`, a `namespace` refusing `_`-prefixed names, `tojson` without HTML escaping, and the special
tokens (`bos_token`, `eos_token`, ...) as variables. The rendered text already holds the template's BOS, so
it is tokenized without adding special tokens. A template error is an InvalidRequestError naming the first
message whose conversation prefix fails to render (`messages[2]: Conversation roles must alternate ...`).
The router renders in child processes within a time budget (router_service.chat_render): the sandbox bounds
what a template can reach, not how long it runs.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path

from common.errors import ConfigError, InvalidRequestError
from common.files import read_regular

log = logging.getLogger("colibri.router.chat")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Reserved: what the renderer itself passes.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks the end of the message to continue (transformers' way)
MAX_BISECT_MESSAGES = 256  # conversations up to this long get the failing message named


def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    class TemplateDict:
        """`dict(...)` for templates, without the type's attributes."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 -- Jinja's Namespace signature, so namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot store underscore-prefixed attributes ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(), namespace=TemplateNamespace
    )
    return env


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _names_literal(syntax, value: str) -> bool:
    """Whether the parsed template holds the string literal `value` (`role == 'developer'`, `in ['system',
    "developer"]`): the word in its text or comments ("for developers") is no code that handles the role."""
    from jinja2 import nodes

    return any(node.value == value for node in syntax.find_all(nodes.Const))


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(read_regular(path).decode("utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"chat template: cannot read {path}: {e}") from None
    return value if isinstance(value, dict) else {}


def _read_template(path: Path, what: str) -> str:
    try:
        return read_regular(path).decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:  # a traceback before: a template is text
        raise ConfigError(f"{what}: {path} is not UTF-8 text (byte {e.start})") from None


class ChatTemplate:
    """A compiled chat template and the special tokens its variables hold."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = ""):
        import jinja2

        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        environment = _environment()
        try:
            syntax = environment.parse(source)
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat template {origin or ''}: line {e.lineno}: {e.message}") from None
        # a template that names the role (written for OpenAI's roles) gets developer messages as they are
        self.knows_developer = _names_literal(syntax, "developer")

    @classmethod
    def load(cls, model_dir: str | Path | None, override_file: str | Path | None = None) -> ChatTemplate | None:
        """The template of `override_file` or else of `model_dir`; None when neither has one. The special tokens
        always come from the model directory (tokenizer_config.json, then special_tokens_map.json)."""
        config = {}
        if model_dir:
            path = Path(model_dir) / "tokenizer_config.json"
            config = _read_json(path) if path.is_file() else {}
            legacy = Path(model_dir) / "special_tokens_map.json"
            legacy_map = _read_json(legacy) if legacy.is_file() else {}
        else:
            legacy_map = {}
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name)) or _token_text(legacy_map.get(name))
            if text is not None:
                special[name] = text
        if override_file:
            path = Path(override_file)
            return cls(_read_template(path, "--chat-template"), special, str(path))
        if not model_dir:
            return None
        jinja_file = Path(model_dir) / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(_read_template(jinja_file, "chat template"), special, str(jinja_file))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
            if source is None:
                log.warning(
                    'tokenizer_config.json has chat templates %s but no "default": chat is off '
                    "(choose one with --chat-template FILE)",
                    sorted(str(n) for n in named),
                )
        if not isinstance(source, str) or not source:
            return None
        return cls(source, special, str(Path(model_dir) / "tokenizer_config.json"))

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text for `messages` (dicts with role and content, and a tool conversation's fields) and
        `tools` (what transformers passes as `tools`: {"type": "function", "function": {...}} dicts).
        Raises InvalidRequestError."""
        if not messages:
            raise InvalidRequestError("messages", "must not be empty")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message", "cannot be combined with add_generation_prompt")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_VARIABLES & set(kwargs))
        if reserved:
            raise InvalidRequestError("chat_template_kwargs", f"must not set {', '.join(reserved)}")
        variables = {**self.special_tokens, **kwargs, "tools": tools or None}
        chat = [dict(m) for m in messages]
        if not self.knows_developer:  # OpenAI's newer name for `system`, which most templates refuse or drop
            for m in chat:
                if m.get("role") == "developer":
                    m["role"] = "system"
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise InvalidRequestError(f"messages[{len(chat) - 1}].content", "the message to continue has no text")
            chat[-1]["content"] = final + CONTINUE_TAG
        try:
            text = self._render(chat, add_generation_prompt, variables)
        except Exception as e:  # the template's own errors (raise_exception, TypeError, ...) are the caller's
            raise self._blame(chat, add_generation_prompt, variables, e) from None
        if final is not None:
            tag = CONTINUE_TAG.strip()
            if tag not in text:
                raise InvalidRequestError(
                    f"messages[{len(chat) - 1}]",
                    "the chat template drops the message to continue (continue_final_message)",
                )
            at = text.rindex(tag)
            text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text

    def _render(self, chat, add_generation_prompt, variables) -> str:
        return self._template.render(
            **{
                "tools": None,
                **variables,
                "messages": chat,
                "documents": None,
                "add_generation_prompt": add_generation_prompt,
            }
        )

    def _blame(self, chat, add_generation_prompt, variables, error: Exception) -> InvalidRequestError:
        """The error naming the first message whose conversation prefix fails (the whole list if none does)."""
        # An exception without text (MemoryError in a renderer past its memory cap) still says what failed.
        message = f"chat template: {getattr(error, 'message', None) or str(error) or 'the render failed'}"
        if len(chat) <= MAX_BISECT_MESSAGES:
            for i in range(len(chat) - 1):
                try:
                    self._render(chat[: i + 1], add_generation_prompt, variables)
                except Exception:
                    return InvalidRequestError(f"messages[{i}]", message)
            return InvalidRequestError(f"messages[{len(chat) - 1}]", message)
        return InvalidRequestError("messages", message)


def message_dicts(messages, field: str = "messages") -> list[dict]:
    """Plain role/content dicts from ChatMessage protos or OpenAI message dicts (content a string, null, or a
    list of parts whose text parts are joined), with their tool fields (router_service.tool_request); checks
    each has a role."""
    from router_service.tool_request import message_tool_fields

    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            role, content = m.get("role"), m.get("content")
        else:
            role, content = m.role, m.content
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{field}[{i}].role", "must be a non-empty string")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"{field}[{i}].content[{j}]", 'only text parts ({"type": "text", "text": ...}) are supported'
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise InvalidRequestError(f"{field}[{i}].content", "must be a string, a list of text parts or null")
        message = {"role": role}
        tool_fields = message_tool_fields(m, f"{field}[{i}]")
        # An assistant's calls without text: content stays out, as OpenAI's null (a proto's "" means unset).
        if content is not None and not (content == "" and "tool_calls" in tool_fields):
            message["content"] = content
        message.update(tool_fields)
        out.append(message)
    return out
