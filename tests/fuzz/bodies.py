"""Hypothesis strategies for hostile OpenAI request bodies, as the bytes a client sends.

A body is a JSON object over the fields of every endpoint (``prompt``,
``messages``, ``tokens``, ``input`` and the sampling fields), each present or
not, each either plausible or hostile: a wrong type, an extreme number
(huge ints, 1e400, -0.0, NaN and Infinity literals), a lone surrogate,
nested values. Some bodies are then spoiled as bytes: nested thousands of
levels deep, cut short, or holding bytes that are not UTF-8.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

__all__ = ["bodies"]

_SURROGATES = ["\ud800", "\udfff", "a\udc80b", "\ud83d"]
_INTS = [0, 1, -1, 2, 64, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**40]
_FLOATS = [0.0, -0.0, 1e-300, 1e-5, 0.5, 1.0, 2.0, 1e308, float("inf"), float("nan")]

_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(_SURROGATES),
    st.text(st.characters(codec=None, categories=["Cs", "Cc", "Lo"]), max_size=10),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(_INTS),
    st.integers(),
    st.sampled_from(_FLOATS),
    st.floats(),
    _text,
)
_nested = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=12,
)
_small = st.integers(min_value=1, max_value=4)
_ids = st.lists(st.one_of(st.integers(0, 600), st.sampled_from(_INTS)), max_size=6)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"])},
    optional={
        "content": st.one_of(
            _text,
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=2),
            _nested,
        ),
        "name": _text,
        "tool_calls": _nested,
    },
)


def _field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible, often hostile."""
    return st.one_of(plausible, plausible, _nested)


_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": _field(st.sampled_from(["tiny", "other"])),
    "prompt": _field(
        st.one_of(_text, st.lists(_text, max_size=3), _ids, st.lists(_ids, max_size=2))
    ),
    "messages": _field(st.lists(_message, max_size=4)),
    "tokens": _field(_ids),
    "input": _field(st.one_of(_text, st.lists(_text, max_size=3), _ids)),
    "max_tokens": _field(_small),
    "max_completion_tokens": _field(_small),
    "temperature": _field(st.sampled_from(_FLOATS)),
    "top_p": _field(st.sampled_from(_FLOATS)),
    "top_k": _field(st.sampled_from(_INTS)),
    "seed": _field(st.sampled_from(_INTS)),
    "n": _field(st.integers(1, 4)),
    "stop": _field(st.one_of(_text, st.lists(_text, max_size=3))),
    "stop_token_ids": _field(_ids),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logprobs": _field(st.one_of(st.booleans(), st.integers(0, 21))),
    "top_logprobs": _field(st.integers(0, 21)),
    "echo": _field(st.booleans()),
    "presence_penalty": _field(st.sampled_from(_FLOATS)),
    "frequency_penalty": _field(st.sampled_from(_FLOATS)),
    "logit_bias": _field(st.dictionaries(_text, st.floats(), max_size=2)),
    "ignore_eos": _field(st.booleans()),
    "encoding_format": _field(st.sampled_from(["float", "base64", "int8"])),
    "response_format": _field(st.fixed_dictionaries({"type": _text})),
}


def _encode(body: dict[str, Any]) -> bytes:
    """JSON with NaN/Infinity literals and ``\\ud800`` escapes, as a hostile client writes."""
    return json.dumps(body, allow_nan=True, ensure_ascii=True).encode()


@st.composite
def _spoiled(draw: st.DrawFn, raw: bytes) -> bytes:
    how = draw(st.sampled_from(["deep", "cut", "not utf-8", "deep object"]))
    if how == "deep":
        depth = draw(st.sampled_from([100, 1_000, 50_000]))
        return raw[:-1] + b', "foo": ' + b"[" * depth + b"]" * depth + b"}"
    if how == "deep object":
        depth = draw(st.sampled_from([100, 5_000]))
        return b'{"prompt": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
    if how == "cut":
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    at = draw(st.integers(0, len(raw)))
    return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + raw[at:]


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """One hostile body (see the module docstring)."""
    names = draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=8, unique=True))
    raw = _encode({name: draw(_FIELDS[name]) for name in names})
    if draw(st.integers(0, 9)) == 0:
        return draw(_spoiled(raw))
    return raw
