"""A thinking model's reasoning, split from its answer. Sans-IO.

Thinking models write their reasoning between ``<think>`` and ``</think>``,
then the answer. A :class:`ReasoningSyntax` says where the output starts;
its :meth:`~ReasoningSyntax.parser` splits one output, delta by delta:

* ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the
  output starts inside the reasoning (a ``<think>`` the model writes again
  first is dropped). Everything up to ``</think>`` is reasoning; an output
  that never closes it is all reasoning.
* ``qwen3``: the output starts with ``<think>`` when the model thinks
  (whitespace before it is allowed); an output that does not start so is all
  answer (thinking off, ``enable_thinking=false``, or a model that skipped it).

The parser's rules, for text arriving in pieces split anywhere (a tag may be
cut between two deltas, or one delta may hold both tags):

1. ``BEFORE`` (qwen3, and deepseek_r1 until it knows): leading whitespace and
   a partial ``<think>`` are held back. ``<think>`` complete: ``THINKING``.
   Anything else: ``THINKING`` for deepseek_r1 (what was held is reasoning),
   ``ANSWER`` for qwen3 (what was held is answer).
2. ``THINKING``: text is reasoning, but a tail that may begin ``</think>`` is
   held back until the next piece decides. ``</think>``: ``SEPARATOR``.
3. ``SEPARATOR``: the whitespace after ``</think>`` is dropped; the first
   other character starts ``ANSWER``.
4. ``ANSWER``: text is answer, tags included, as is.
5. :meth:`ReasoningParser.finish` releases what is held (a partial tag is
   text) and ends the parser: a later push raises.

So at most ``len("</think>") - 1`` characters (plus leading whitespace
before a first tag) are ever held back, and the concatenation of all
reasoning and answer pieces is the output minus the tags and the separator.

:meth:`ReasoningSyntax.grammar` puts a structured output after the thinking:
the grammar admits the reasoning first, then the constrained answer, so a
JSON schema or a tool grammar never forces JSON while the model thinks.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Final

import llguidance

from tserve.grammar import lark_json
from tserve.nursery import LLM, InvalidRequest
from tserve.sampling import Choice, Constraint, JsonSchema, LarkGrammar, Regex

__all__ = [
    "PARSER_NAMES",
    "ModelReasoning",
    "ReasoningParser",
    "ReasoningSyntax",
    "Split",
    "detect_syntax",
    "model_reasoning",
    "syntax_named",
    "thinking_off",
]

OPEN: Final = "<think>"
CLOSE: Final = "</think>"
PARSER_NAMES: Final = ("auto", "none", "deepseek_r1", "qwen3")
"""The values of ``--reasoning-parser``."""

# What a request's chat_template_kwargs set to False to turn thinking off
# (Qwen3's and DeepSeek V3.1's templates read one of them).
_THINKING_SWITCHES: Final = ("enable_thinking", "thinking")


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """What one piece of output holds of each: either may be empty."""

    reasoning: str = ""
    content: str = ""


class _State(enum.Enum):
    BEFORE = "before"
    THINKING = "thinking"
    SEPARATOR = "separator"
    ANSWER = "answer"
    DONE = "done"


class ReasoningParser:
    """Splits one output into reasoning and answer (the rules are the module's).

    Synchronous and incremental: :meth:`push` each detokenized delta, then
    :meth:`finish` once (or push the last delta with ``final=True``). Pushing
    after the end raises RuntimeError.
    """

    def __init__(self, *, starts_inside: bool) -> None:
        self._starts_inside = starts_inside
        self._state = _State.BEFORE
        # Invariant: _held is text not yet classified: in BEFORE, whitespace and
        # a proper prefix of OPEN; in THINKING, a proper prefix of CLOSE.
        self._held = ""

    @property
    def reasoning_ended(self) -> bool:
        """Whether no more reasoning can come (the answer has begun, or the output ended)."""
        return self._state in (_State.SEPARATOR, _State.ANSWER, _State.DONE)

    def push(self, text: str, *, final: bool = False) -> Split:
        """Take the next piece of output; return what of it (and of what was held)
        is now known to be reasoning and answer. ``final``: it is the last piece
        (:meth:`finish` is included)."""
        if self._state is _State.DONE:
            raise RuntimeError("push() after finish()")
        reasoning: list[str] = []
        content: list[str] = []
        text = self._held + text
        self._held = ""
        while text:
            text = self._step(text, reasoning, content)
        if final:
            rest = self.finish()
            reasoning.append(rest.reasoning)
            content.append(rest.content)
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """The end of the output: what was held back, as text of its state."""
        held, state = self._held, self._state
        self._held, self._state = "", _State.DONE
        if state is _State.THINKING or (state is _State.BEFORE and self._starts_inside):
            return Split(reasoning=held)
        return Split(content="" if state is _State.SEPARATOR else held)

    def _step(self, text: str, reasoning: list[str], content: list[str]) -> str:
        """Consume a prefix of ``text`` in the current state; return the rest."""
        state = self._state
        if state is _State.BEFORE:
            start = text.lstrip()
            if start.startswith(OPEN):
                self._state = _State.THINKING
                return start[len(OPEN) :]
            if OPEN.startswith(start):  # whitespace, and maybe part of the tag
                self._held = text
                return ""
            self._state = _State.THINKING if self._starts_inside else _State.ANSWER
            return text
        if state is _State.THINKING:
            end = text.find(CLOSE)
            if end >= 0:
                reasoning.append(text[:end])
                self._state = _State.SEPARATOR
                return text[end + len(CLOSE) :]
            keep = _partial_suffix(text, CLOSE)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            return ""
        if state is _State.SEPARATOR:
            text = text.lstrip()
            if text:
                self._state = _State.ANSWER
            return text
        content.append(text)
        return ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningSyntax:
    """How one model marks its reasoning: ``<think>`` tags, and whether its output
    starts inside them (the prompt opened ``<think>``)."""

    name: str
    starts_inside: bool
    tags_are_tokens: bool = False  # the vocabulary has <think> and </think> as tokens

    def with_tags_as_tokens(self, tags_are_tokens: bool) -> ReasoningSyntax:
        """This syntax for a vocabulary that has (or lacks) the tags as tokens."""
        return dataclasses.replace(self, tags_are_tokens=tags_are_tokens)

    def parser(self) -> ReasoningParser:
        """A parser for one output."""
        return ReasoningParser(starts_inside=self.starts_inside)

    def answer_only(self) -> ReasoningSyntax:
        """This syntax for a prompt whose template turned thinking off: an output
        that does not open ``<think>`` is all answer."""
        return dataclasses.replace(self, starts_inside=False)

    def grammar(self, constraint: Constraint) -> LarkGrammar:
        """``constraint`` for the answer, after reasoning the model writes freely.

        The reasoning ends at the first ``</think>``; up to 8 whitespace
        characters may follow it; then the answer matches ``constraint``.
        For a syntax that does not start inside, the reasoning is optional
        and opens with ``<think>``. With ``tags_are_tokens`` the tags are the
        vocabulary's own tokens (llguidance's ``<think>`` syntax: the model
        must write each as its one token), else text.
        """
        if self.tags_are_tokens:
            opening, think = "<think>", "think: /(?s:.*)/ </think> sep?"
        else:
            opening, think = (
                '"<think>"',
                ("think: think_text sep?\nthink_text[lazy]: /(?s:.*)<\\/think>/"),
            )
        first = f"{opening}? think" if self.starts_inside else f"({opening} think)?"
        return LarkGrammar(
            f"start: {first} answer\n{think}\n"
            "sep: /[ \\t\\r\\n]{1,8}/\n"
            f"answer: %lark {{\n{_lark(constraint)}\n}}\n"
        )


def _lark(constraint: Constraint) -> str:
    """``constraint`` as a Lark grammar of its own (its rule ``start``)."""
    if isinstance(constraint, LarkGrammar):
        return constraint.grammar
    if isinstance(constraint, JsonSchema):
        return f"start: %json {lark_json(constraint.schema)}"
    if isinstance(constraint, Choice):
        return "start: " + " | ".join(json.dumps(c) for c in constraint.choices)
    if isinstance(constraint, Regex):
        top = json.loads(llguidance.LLMatcher.grammar_from_regex(constraint.pattern))
        return str(top["grammars"][0]["lark_grammar"])
    raise TypeError(f"not a constraint: {constraint!r}")


DEEPSEEK_R1: Final = ReasoningSyntax("deepseek_r1", starts_inside=True)
QWEN3: Final = ReasoningSyntax("qwen3", starts_inside=False)


def syntax_named(name: str) -> ReasoningSyntax | None:
    """The syntax ``--reasoning-parser`` names ("none": None). Raises ValueError
    for a name that is not one (``auto`` is :func:`detect_syntax`'s)."""
    syntaxes = {"deepseek_r1": DEEPSEEK_R1, "qwen3": QWEN3, "none": None}
    if name not in syntaxes:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(PARSER_NAMES)}")
    return syntaxes[name]


def detect_syntax(source: str, generation_prompt: str | None) -> ReasoningSyntax | None:
    """The syntax of a chat template that mentions ``<think>``, else None.

    ``generation_prompt`` is the template's rendering of a one-message chat
    with the assistant's turn opened (None when it would not render): one
    that ends inside an open ``<think>`` is deepseek_r1's, any other qwen3's.
    """
    if OPEN not in source:
        return None
    if generation_prompt is not None and generation_prompt.rfind(OPEN) > generation_prompt.rfind(
        CLOSE
    ):
        return DEEPSEEK_R1
    return QWEN3


def thinking_off(template_kwargs: Mapping[str, object] | None) -> bool:
    """Whether a request's ``chat_template_kwargs`` turn thinking off."""
    return template_kwargs is not None and any(
        template_kwargs.get(key) is False for key in _THINKING_SWITCHES
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ModelReasoning:
    """The served model's reasoning syntax, and whether its template can turn
    thinking off (it reads ``enable_thinking`` or ``thinking``)."""

    syntax: ReasoningSyntax
    switchable: bool

    def for_request(self, template_kwargs: Mapping[str, object] | None) -> ReasoningSyntax:
        """The syntax of one request's output: answer first when its kwargs turned
        thinking off in a template that honours that."""
        if self.switchable and thinking_off(template_kwargs):
            return self.syntax.answer_only()
        return self.syntax


def model_reasoning(name: str, llm: LLM) -> ModelReasoning | None:
    """What ``--reasoning-parser NAME`` means for ``llm``'s model (None: no parsing).

    "auto" is :func:`detect_syntax` on the model's chat template, for a model
    whose vocabulary has ``<think>`` and ``</think>`` as tokens of their own
    (every thinking model's does; a template that mentions the tags for a
    model without them is no sign it thinks). Blocking (renders the template
    once); raises ValueError for an unknown name.
    """
    try:
        template = llm.tokenizer.chat_template(tools=False)
    except InvalidRequest:  # no template: chats fail anyway
        template = None
    added = {token.content for token in llm.tokenizer.tokenizer.get_added_tokens_decoder().values()}
    tags_are_tokens = {OPEN, CLOSE} <= added
    if name != "auto":
        syntax = syntax_named(name)
    elif template is None or not tags_are_tokens:
        syntax = None
    else:
        try:
            prompt: str | None = template.render([{"role": "user", "content": "Hi"}])
        except InvalidRequest:
            prompt = None
        syntax = detect_syntax(template.source, prompt)
    if syntax is None:
        return None
    switches = template is not None and bool(template.variables & set(_THINKING_SWITCHES))
    return ModelReasoning(syntax.with_tags_as_tokens(tags_are_tokens), switches)
