"""Structured-output constraints as llguidance grammars; a leaf both processes import.

:func:`grammar_text` turns a :data:`~tserve.sampling.Constraint` into the text
llguidance compiles (a JSON document naming a JSON Schema, a Lark grammar or a
regex). :func:`constraint_problem` checks a constraint without the model (the
API process, before a request reaches the engine), and with the model's
tokenizer also that it can write something (:func:`start_problem`, which the
engine's compile applies too); :func:`llg_tokenizer`
builds llguidance's view of a model's vocabulary straight from its
``tokenizer.json`` text, so neither process needs torch or transformers for
it. Imports only the standard library, llguidance and :mod:`tserve.sampling`.

Defaults that keep a small model from looping inside a valid grammar, for
every JSON Schema (:class:`~tserve.sampling.JsonSchema`, and
:func:`lark_json` for a schema embedded in a Lark grammar with ``%json``):

* **No whitespace between JSON tokens.** The separators are exactly ``,`` and
  ``:`` and nothing may surround them or the brackets (llguidance's
  ``whitespace_flexible`` off), so a model cannot emit blanks forever. A
  schema's own ``"x-guidance"`` options take precedence.
* **Numbers no longer than a 64-bit value.** Every ``integer`` or ``number``
  subschema without a bound on a side gets :data:`NUMBER_BOUND` there
  (``minimum`` -10^18, ``maximum`` 10^18): an integer has at most 19 digits
  and fits in an int64, and a number has at most 19 digits before its point
  and no exponent. Digits after a number's point are not bounded by the
  grammar (llguidance has no option for it; ``max_tokens`` bounds them).
* ``JsonSchema(None)`` (any JSON object) is :data:`ANY_JSON_OBJECT`: an
  object whose values are any JSON values under the same bounds.

Bounds in a schema are honoured as written where they are given. Blocking:
every function here is CPU work (grammar checks take milliseconds for
ordinary schemas, longer for very large ones; llguidance releases the GIL
while it works), so callers run them off their event loop or step loop.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from tserve.sampling import Choice, Constraint, JsonSchema, LarkGrammar, Regex
from tserve.validity import Problem

if TYPE_CHECKING:  # imported where used: an engine that constrains nothing never needs it
    import llguidance

__all__ = [
    "ANY_JSON_OBJECT",
    "FORCED_WALK",
    "JSON_OPTIONS",
    "LEXER_FUEL",
    "NUMBER_BOUND",
    "RunHeld",
    "bounded_schema",
    "checked_text",
    "constraint_problem",
    "first_line",
    "grammar_text",
    "lark_json",
    "llg_tokenizer",
    "matcher",
    "start_problem",
    "text_problem",
]

NUMBER_BOUND: Final = 10**18
"""The magnitude every JSON ``integer``/``number`` without its own bound is held to."""

JSON_OPTIONS: Final[dict[str, Any]] = {"whitespace_flexible": False}
"""llguidance's JSON options: compact separators, no whitespace between tokens."""

LEXER_FUEL: Final = 200_000
"""llguidance's ``initial_lexer_fuel`` for every grammar tserve compiles (its own
default is 1,000,000): the work building a grammar's lexer may take before the
grammar is refused as too complex ("too many expressions constructed"). A
regex blow-up such as ``((a{100}){100}){100}`` then costs a check 0.1 s of CPU
instead of 0.9 s (SmolLM2's vocabulary, one core); a 512-tool schema, a
2,000-value enum or ``((a{40}){40}){40}`` still compile, ``((a{50}){50}){50}``
no longer does."""

_VALUE_REF: Final = {"$ref": "#/$defs/value"}
ANY_JSON_OBJECT: Final[dict[str, Any]] = {
    "$defs": {
        "value": {
            "anyOf": [
                {"type": "null"},
                {"type": "boolean"},
                {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND},
                {"type": "string"},
                {"type": "array", "items": _VALUE_REF},
                {"type": "object", "additionalProperties": _VALUE_REF},
            ]
        }
    },
    "type": "object",
    "additionalProperties": _VALUE_REF,
}
"""``JsonSchema(None)``: a JSON object of any JSON values, numbers bounded."""

# Keys whose values are data, not subschemas: the bounds never touch them.
_DATA_KEYS: Final = frozenset({"const", "enum", "default", "examples"})
_NUMERIC: Final = frozenset({"integer", "number"})


def bounded_schema(schema: Any) -> Any:
    """``schema`` with :data:`NUMBER_BOUND` added to every unbounded numeric subschema.

    A new object (``schema`` is not changed). Anything that is not a dict or
    list is returned as is. O(size of the schema).
    """
    if isinstance(schema, list):
        return [bounded_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYS else bounded_schema(v)) for k, v in schema.items()}
    kinds = schema.get("type")
    listed = kinds if isinstance(kinds, list) else [kinds]
    numeric = any(isinstance(k, str) and k in _NUMERIC for k in listed)
    if numeric:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -NUMBER_BOUND
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = NUMBER_BOUND
    return out


def _schema_with_options(schema: dict[str, Any] | None) -> dict[str, Any]:
    bounded: dict[str, Any] = ANY_JSON_OBJECT if schema is None else bounded_schema(schema)
    own = bounded.get("x-guidance")
    options = {**JSON_OPTIONS, **own} if isinstance(own, dict) else JSON_OPTIONS
    return {**bounded, "x-guidance": options}


def lark_json(schema: dict[str, Any] | None) -> str:
    """The text to put after ``%json`` in a Lark grammar for ``schema``, with the
    module's defaults (bounded numbers, no whitespace); None = any JSON object."""
    return json.dumps(_schema_with_options(schema), separators=(",", ":"))


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for ``constraint``: what ``LLMatcher`` compiles.

    Never raises for a bad constraint (the text then fails to compile, see
    :func:`constraint_problem`), except ValueError for a JsonSchema whose
    schema is not a JSON object. Equal constraints give equal texts.
    """
    import llguidance

    if isinstance(constraint, JsonSchema):
        schema = _schema_with_options(constraint.schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if isinstance(constraint, Regex):
        return llguidance.LLMatcher.grammar_from_regex(constraint.pattern)
    if isinstance(constraint, Choice):
        lark = "start: " + " | ".join(json.dumps(c) for c in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if isinstance(constraint, LarkGrammar):
        return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
    raise TypeError(f"not a constraint: {constraint!r}")


def constraint_problem(
    constraint: Constraint, tokenizer: llguidance.LLTokenizer | None = None
) -> Problem | None:
    """Why ``constraint`` cannot be honoured (param "constraint", llguidance's
    message), or None. With ``tokenizer`` the check also covers what needs the
    vocabulary (special tokens named in a Lark grammar). Blocking: it compiles
    the grammar's lexer, and with ``tokenizer`` the whole grammar and its first
    mask (:func:`start_problem`): milliseconds, longer for very large grammars.
    It is :func:`checked_text`, then :func:`text_problem` on its text."""
    text = checked_text(constraint)
    return text if isinstance(text, Problem) else text_problem(constraint, text, tokenizer)


def checked_text(constraint: Constraint) -> str | Problem:
    """``constraint``'s grammar text (:func:`grammar_text`), or why it cannot have
    one. Blocking: Python over the whole constraint, holding the GIL
    (milliseconds for a 128-tool schema)."""
    if isinstance(constraint, Choice):
        if not constraint.choices:
            return Problem("constraint", "choice: at least one choice is required")
        if "" in constraint.choices:
            return Problem("constraint", "choice: a choice must not be empty")
    try:
        return grammar_text(constraint)
    except (ValueError, RecursionError) as exc:
        return Problem("constraint", f"{_kind(constraint)}: {exc}")


RunHeld: TypeAlias = Callable[[Callable[[], bool]], bool]
"""Runs one of llguidance's calls that hold the GIL and returns its result
(:func:`start_problem`'s ``run_held``)."""


def _run_here(call: Callable[[], bool]) -> bool:
    return call()


def text_problem(
    constraint: Constraint, text: str, tokenizer: llguidance.LLTokenizer | None = None
) -> Problem | None:
    """:func:`constraint_problem` for ``constraint`` whose grammar text is ``text``
    (:func:`checked_text`'s). Blocking: llguidance's work, which releases the
    GIL but while it feeds forced tokens to the matcher (:func:`start_problem`)."""
    import llguidance

    if tokenizer is None:
        message = llguidance.LLMatcher.validate_grammar(text)
        return Problem("constraint", f"{_kind(constraint)}: {message.strip()}") if message else None
    compiled = matcher(tokenizer, text)  # one compile: it validates too
    if compiled.is_error():
        return Problem("constraint", f"{_kind(constraint)}: {compiled.get_error().strip()}")
    problem = start_problem(compiled, tokenizer)
    return None if problem is None else Problem("constraint", f"{_kind(constraint)}: {problem}")


def matcher(tokenizer: llguidance.LLTokenizer, text: str) -> llguidance.LLMatcher:
    """llguidance's matcher of grammar ``text`` (:func:`grammar_text`'s) under
    :data:`LEXER_FUEL`; a grammar it cannot build is a matcher in its error
    state. Blocking: llguidance's compile, which releases the GIL."""
    import llguidance

    limits = llguidance.LLParserLimits(initial_lexer_fuel=LEXER_FUEL)
    return llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)


FORCED_WALK: Final = 8
"""Forced tokens :func:`start_problem` follows from a grammar's start, at most."""


def start_problem(
    matcher: llguidance.LLMatcher,
    tokenizer: llguidance.LLTokenizer,
    run_held: RunHeld = _run_here,
) -> str | None:
    """Why a freshly compiled ``matcher`` can write no useful output, or None.

    It follows the tokens the grammar forces from its start (a mask that
    allows one token and no EOS: ``{"k":`` for an object with one required
    key), up to :data:`FORCED_WALK` of them. The grammar accepts no string
    when it fails on the way, or allows no token there but an EOS without
    being complete (``{"$ref": "#"}``, a ``$defs`` cycle without a base case,
    an empty character class); it accepts only the empty string when EOS is
    all its start allows. ``matcher`` is consumed (use a copy). Blocking: a
    mask per forced token (llguidance releases the GIL while it computes one;
    bounded by its own limits). Feeding a forced token to the matcher holds
    the GIL (its lexer's new states: 5 ms for a token of many bytes through
    ``((a{100}){100}){100}``), so that call goes through ``run_held``: a
    low-priority caller passes a thread at its process's own priority, since
    a low-priority thread that holds the GIL while a busy machine keeps it off
    the CPU keeps its process's other threads waiting as long. Between those
    calls it holds the GIL only for calls into C, never a loop over the
    vocabulary in Python.
    """
    eos = set(tokenizer.eos_tokens)
    forced: list[int] = []
    for _ in range(FORCED_WALK + 1):
        where = repr(tokenizer.decode_str(forced)[:80]) if forced else "its start"
        allowed = matcher.compute_logit_bias()  # a dead end puts the matcher in its error state
        eos_allowed = sum(1 for t in eos if t < len(allowed) and allowed[t])
        others = len(allowed) - allowed.count(0) - eos_allowed
        if matcher.is_error() and not others and not matcher.is_accepting():
            return f"the grammar accepts no string: no token can follow {where}"
        if matcher.is_error():
            return f"the grammar fails at {where}: {first_line(matcher.get_error())}"
        if not others:  # EOS alone: the end, or a special token the grammar names
            if forced or not matcher.is_accepting():
                return None
            return "the grammar accepts only the empty string"
        if others > 1 or eos_allowed or len(forced) == FORCED_WALK:
            return None
        # The one allowed token (no EOS is): the first non-zero byte, found in C,
        # so a compile thread holds the GIL for microseconds, not a Python scan.
        token = len(allowed) - len(allowed.lstrip(b"\x00"))
        if not run_held(functools.partial(matcher.consume_token, token)):
            return f"the grammar fails at {where}: {first_line(matcher.get_error())}"
        forced.append(token)
    return None


def first_line(message: str) -> str:
    """The first line of one of llguidance's messages (they can hold a state dump)."""
    return message.strip().splitlines()[0] if message.strip() else "no reason given"


def _kind(constraint: Constraint) -> str:
    return {JsonSchema: "json schema", Regex: "regex", Choice: "choice"}.get(
        type(constraint), "grammar"
    )


def llg_tokenizer(
    tokenizer_json: str, *, vocab_size: int | None = None, eos_token_ids: Sequence[int] = ()
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from the text of a ``tokenizer.json`` (added tokens
    included, as ``tokenizers.Tokenizer.to_str()`` writes them).

    ``vocab_size``: the model's (its logits' width), when it is larger than
    the tokenizer's (padding rows, never allowed by a grammar).
    ``eos_token_ids``: the model's EOS ids (default: llguidance's guess).
    Blocking, and holding the GIL throughout: a fraction of a second for a
    50k vocabulary; built once where the model's ``vocab_size`` is at least
    the tokenizer's (three times otherwise). Raises ValueError for a tokenizer
    llguidance cannot read.
    """
    import llguidance

    if vocab_size is not None:
        eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        # Too small for the tokenizer (or unreadable): the general path below.
        with contextlib.suppress(ValueError, RuntimeError):
            return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
    try:
        base = llguidance.LLTokenizer(tokenizer_json)
        n_vocab = vocab_size if vocab_size is not None and vocab_size > base.vocab_size else None
        eos = [t for t in eos_token_ids if 0 <= t < (n_vocab or base.vocab_size)]
        if n_vocab is None and not eos:
            return base
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos or None)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"llguidance cannot read this tokenizer: {exc}") from exc
