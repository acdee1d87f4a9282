"""Render Hugging Face chat templates the way transformers' `apply_chat_template` does.

Chat templates are untrusted Jinja code from a model repository, so they run in
jinja2's immutable sandbox with the same environment transformers 5.24 builds
(`transformers/utils/chat_template_utils.py`): trim_blocks and lstrip_blocks,
the loopcontrols extension, a `tojson` filter that keeps non-ASCII text and takes
`indent`, and the `raise_exception` and `strftime_now` globals. Matching it
exactly matters: the prompt a model was trained on is the one transformers renders.
"""

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning arrives under; templates read the first (Qwen3,
# DeepSeek) or `thinking` (gpt-oss). transformers copies it to both.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatRenderer(Protocol):
    """What the Recipe renders chats with: a Jinja template (ChatTemplate), or a format a
    model ships as code (deepseek_v4_chat.DeepseekV4Chat). `source` is the template's text."""

    source: str

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> str: ...


def require_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Every ChatRenderer refuses an empty conversation the same way (transformers' words)."""
    if not messages:
        raise ValueError("Cannot apply a chat template to an empty conversation: give at least one message.")


class ChatTemplateError(ValueError):
    """A chat template rejected the conversation (its `raise_exception`) or failed to render."""


class ChatTemplate:
    """One compiled chat template; `render` is safe to call from many threads."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"The chat template does not compile (line {error.lineno}): {error}") from error

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation; kwargs become template variables and override special tokens."""
        require_messages(messages)
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise ValueError("Each tool must be a JSON schema dict ({'type': 'function', 'function': {...}}).")
        variables = {**(special_tokens or {}), **kwargs}
        try:
            return self._template.render(
                messages=_prepare_messages(messages),
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **_plain(variables),
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"The chat template rejected the conversation: {error}") from error


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain-data copies of the messages, with None values dropped and reasoning fields aliased."""
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"Each chat message must be a dict with 'role' and 'content', got {message!r}.")
        # APIs send `content=None` or `tool_calls=None`; templates handle a missing key
        # but print "None" for a None value.
        plain = {key: value for key, value in _plain(message).items() if value is not None}
        reasoning = next((plain[key] for key in _REASONING_FIELDS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        prepared.append(plain)
    return prepared


def _plain(value: Any) -> Any:
    """Rebuild a value from JSON types only, so the sandbox never sees objects with methods.

    Subclasses of str/int/float (enums, numpy scalars) lose their extra methods;
    anything else becomes a placeholder naming its type, as in transformers.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models, e.g. parsed OpenAI requests
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML and takes no ensure_ascii;
    # templates expect plain json.dumps output.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, which lead to CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's signature trick: `self` taken from args so `namespace(self=...)` works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"Chat templates cannot set underscore attribute {name!r}.")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders its body unchanged.

    Training templates mark assistant spans with it for transformers' assistant
    mask; without the tag such templates would not even parse. Serving needs no mask.
    """

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    # A fresh environment per template: nothing shared between Recipes.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment
