"""A model's chat template rendered the way transformers renders it, without transformers.

A chat template is Jinja source that came with the model, so it is
untrusted code: it runs in an immutable sandbox (no attribute that starts
with an underscore, no mutation of the inputs), and every failure it can
produce — a syntax error, ``raise_exception``, a message missing a key, a
type error — becomes one :class:`ChatTemplateError`, which is an
:class:`~tserve.nursery.InvalidRequest` naming ``messages``.

What a template sees (the contract of transformers' ``apply_chat_template``,
which model authors write their templates against):

* the environment: ``trim_blocks`` and ``lstrip_blocks`` on, the loop
  controls ``{% break %}``/``{% continue %}``, a ``{% generation %}`` block
  tag that renders its body as is, a ``tojson`` filter that is
  ``json.dumps`` (no HTML escaping, non-ASCII kept; ``indent``,
  ``separators``, ``sort_keys``), and the globals ``raise_exception``,
  ``strftime_now``, a ``dict`` that only builds dicts, and a ``namespace``
  that refuses underscore names;
* the variables: ``messages``, ``tools``, ``documents``,
  ``add_generation_prompt``, the tokenizer's named special tokens
  (``bos_token``, ``eos_token``, ...), and the request's own
  ``template_kwargs`` (``enable_thinking``, ...), as plain JSON data; a
  template kwarg never replaces one of the variables before it;
* the messages as plain JSON data: keys whose value is None are dropped,
  values that are not JSON types become ``"<TypeName>"`` placeholders, and a
  message's reasoning (``reasoning_content``, ``thinking`` or
  ``reasoning``) is readable under ``thinking`` and ``reasoning_content``.

Rendering is pure CPU work: blocking, never a checkpoint, safe to run in
several threads at once (a compiled template holds no per-render state).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypedDict, TypeVar, Unpack

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tserve.nursery._errors import InvalidRequest

__all__ = ["ChatOptions", "ChatTemplate", "ChatTemplateError", "select_template"]

_T = TypeVar("_T")

# Message keys a reasoning text may come under; templates read the first.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatOptions(TypedDict, total=False):
    """What a chat request may pass to the template besides its messages.

    ``add_generation_prompt`` (default True) asks the template to open the
    assistant's turn; ``tools`` and ``documents`` are lists of JSON objects
    (None, the default, is what a template sees without them);
    ``template_kwargs`` are more variables (such as ``enable_thinking``).
    """

    add_generation_prompt: bool
    tools: Sequence[Mapping[str, Any]] | None
    documents: Sequence[Mapping[str, Any]] | None
    template_kwargs: Mapping[str, Any] | None


class ChatTemplateError(InvalidRequest):
    """A chat the model's template cannot render (or a model without one).

    ``param`` is always "messages"; ``reason`` is the template's own words
    (for ``raise_exception``, its message exactly).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"messages: {reason}", param="messages")
        self.reason = reason


def select_template(templates: Mapping[str, _T], *, tools: bool) -> _T:
    """The template to use from a model's named templates.

    The one named "tool_use" when the request has tools and the model has
    one, else the one named "default". Raises ChatTemplateError when there
    is none to use (a model without a template, or with only other names).
    """
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if not templates:
        raise ChatTemplateError("this model has no chat template")
    names = ", ".join(sorted(templates))
    raise ChatTemplateError(f"this model has several chat templates and no default: {names}")


class ChatTemplate:
    """One compiled chat template and the special tokens it may read.

    ``special_tokens`` maps names such as ``bos_token`` to their text; a
    template that does not compile raises ChatTemplateError at each
    :meth:`render` (the model still serves plain completions).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template: jinja2.Template | None = None
        self._compile_error: str | None = None
        # The variables the template reads (empty when it does not compile).
        self.variables: frozenset[str] = frozenset()
        try:
            env = _sandbox()
            self._template = env.from_string(source)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.TemplateError as exc:
            self._compile_error = f"the model's chat template does not compile: {exc}"

    @property
    def reads_tools(self) -> bool:
        """Whether the template reads the ``tools`` variable (else it ignores tools)."""
        return "tools" in self.variables

    def render(self, messages: object, **options: Unpack[ChatOptions]) -> str:
        """The prompt text for ``messages``. Blocking (template work).

        Raises ChatTemplateError when ``messages`` is not a non-empty list of
        mappings, a tool or document is not a mapping, or the template fails.
        """
        if self._template is None:
            assert self._compile_error is not None  # invariant: one of the two is set
            raise ChatTemplateError(self._compile_error)
        tools = options.get("tools")
        documents = options.get("documents")
        extra = options.get("template_kwargs") or {}
        variables: dict[str, Any] = {str(key): _plain(value) for key, value in extra.items()}
        variables.update(self.special_tokens)
        variables.update(
            messages=_chat_messages(messages),
            tools=None if tools is None else _plain(_mappings(tools, "tools")),
            documents=None if documents is None else _plain(_mappings(documents, "documents")),
            add_generation_prompt=options.get("add_generation_prompt", True),
        )
        try:
            return self._template.render(variables)
        except Exception as exc:  # the template's own failure, whatever its type
            raise ChatTemplateError(str(exc)) from exc


def _chat_messages(messages: object) -> list[Any]:
    """The messages as the template sees them (see the module docstring)."""
    if not isinstance(messages, list | tuple):
        raise ChatTemplateError("messages must be a list of objects")
    if not messages:
        raise ChatTemplateError("a chat needs at least one message")
    chat = []
    for message in _mappings(messages, "messages"):
        plain = _plain({key: value for key, value in message.items() if value is not None})
        chat.append(_with_reasoning_aliases(plain))
    return chat


def _mappings(items: Iterable[object], what: str) -> list[Mapping[str, Any]]:
    checked = []
    for item in items:
        if not isinstance(item, Mapping):
            raise ChatTemplateError(f"each of {what} must be an object, not {item!r}")
        checked.append(item)
    return checked


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its reasoning under ``thinking`` and ``reasoning_content`` too."""
    reasoning = next(
        (message[key] for key in _REASONING_KEYS if message.get(key) is not None), None
    )
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of JSON types only; anything else is ``"<TypeName>"``.

    Subclasses of str, int and float lose their extra methods (the sandbox
    cannot know which of them are dangerous); tuples stay tuples.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


# -- the environment ---------------------------------------------------------------------


def _sandbox() -> ImmutableSandboxedEnvironment:
    """A fresh environment with the filters, globals and tags templates expect."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _Namespace
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``json.dumps`` with its own defaults: unlike Jinja's filter, no HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    """The local time now, formatted (templates print today's date with it)."""
    return datetime.now().strftime(format)


class _DictBuilder:
    """``dict(...)`` and ``dict.fromkeys(...)``, and nothing else of the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Iterable[Any], value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` minus underscore names (a path to interpreter internals)."""

    # No named self, as in Jinja's own: namespace(self=...) must still work.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template cannot store {name!r} on a namespace (underscore names are refused)"
        )


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's part; renders as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())
