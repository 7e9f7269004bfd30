"""tserve.grammar: constraints to llguidance grammars, checks, and the loop-proof defaults.

Against llguidance itself with the tiny model's tokenizer; no engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import pytest

from tserve.grammar import (
    ANY_JSON_OBJECT,
    NUMBER_BOUND,
    bounded_schema,
    constraint_problem,
    grammar_text,
    lark_json,
    llg_tokenizer,
    matcher,
    start_problem,
)
from tserve.protocol import Choice, Constraint, JsonSchema, LarkGrammar, Regex

EOS = 2  # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> llguidance.LLTokenizer:
    return llg_tokenizer((tiny_model_dir / "tokenizer.json").read_text(), eos_token_ids=[EOS])


def accepts(tokenizer: llguidance.LLTokenizer, constraint: Constraint, text: str) -> bool:
    """Whether ``text`` is a complete sentence of ``constraint``'s grammar."""
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(constraint), log_level=0)
    assert not matcher.get_error()
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("constraint", "good", "bad"),
    [
        (Choice(("yes", "no", 'say "hi"')), ["yes", "no", 'say "hi"'], ["ye", "yesno", "maybe"]),
        (Regex(r"[0-9]{3}-[a-z]+"), ["123-abc"], ["12-abc", "123-", "123-ABC"]),
        (LarkGrammar('start: "a" b+\nb: "b"'), ["ab", "abbb"], ["a", "ba"]),
        (
            JsonSchema(
                {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
            ),
            ['{"a":true}'],
            ['{"a":1}', "{}", '{"a":true'],
        ),
        (JsonSchema(), ['{"a":[1,{"b":null}],"c":"x"}', "{}"], ["[1]", "1", '"x"']),
    ],
)
def test_constraints_become_grammars_that_match_their_sentences(
    tokenizer: llguidance.LLTokenizer, constraint: Constraint, good: list[str], bad: list[str]
) -> None:
    assert constraint_problem(constraint, tokenizer) is None
    assert all(accepts(tokenizer, constraint, text) for text in good)
    assert not any(accepts(tokenizer, constraint, text) for text in bad)


def test_json_allows_no_whitespace_between_tokens(tokenizer: llguidance.LLTokenizer) -> None:
    schema = JsonSchema({"type": "object", "properties": {"a": {"type": "array"}}})
    assert accepts(tokenizer, schema, '{"a":[1,2]}')
    for spaced in ['{"a": [1,2]}', '{ "a":[1,2]}', '{"a":[1, 2]}', '{"a":[1,2]} ', '{"a":[1,2]\n}']:
        assert not accepts(tokenizer, schema, spaced), spaced


def test_a_schema_may_ask_for_whitespace_itself(tokenizer: llguidance.LLTokenizer) -> None:
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    assert accepts(tokenizer, JsonSchema(schema), '{"a": 1}')


def test_integers_without_bounds_fit_in_64_bits(tokenizer: llguidance.LLTokenizer) -> None:
    schema = JsonSchema({"anyOf": [{"type": "integer"}, {"type": "null"}]})
    assert accepts(tokenizer, schema, str(NUMBER_BOUND))
    assert accepts(tokenizer, schema, str(-NUMBER_BOUND))
    assert not accepts(tokenizer, schema, str(NUMBER_BOUND + 1))
    assert not accepts(tokenizer, schema, "9" * 20)
    assert NUMBER_BOUND < 2**63


def test_numbers_without_bounds_have_at_most_19_integer_digits(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    schema = JsonSchema({"type": "object", "properties": {"x": {"type": "number"}}})
    assert accepts(tokenizer, schema, '{"x":-12.5}')
    assert not accepts(tokenizer, schema, '{"x":' + "1" * 20 + "}")
    assert not accepts(tokenizer, schema, '{"x":1e400}')


def test_any_json_object_bounds_its_numbers(tokenizer: llguidance.LLTokenizer) -> None:
    assert accepts(tokenizer, JsonSchema(), '{"a":[' + "9" * 18 + "]}")
    assert not accepts(tokenizer, JsonSchema(), '{"a":[' + "9" * 20 + "]}")
    assert not accepts(tokenizer, JsonSchema(), '{"a": 1}')


def test_bounds_given_by_the_schema_are_kept() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0},
            "score": {"type": ["number", "null"], "exclusiveMaximum": 5},
            "tag": {"type": "string"},
            "type": {"const": {"type": "integer"}},
        },
    }
    bounded = bounded_schema(schema)
    props = bounded["properties"]
    assert props["age"] == {"type": "integer", "minimum": 0, "maximum": NUMBER_BOUND}
    assert props["score"] == {
        "type": ["number", "null"],
        "exclusiveMaximum": 5,
        "minimum": -NUMBER_BOUND,
    }
    assert props["tag"] == {"type": "string"}
    assert props["type"] == {"const": {"type": "integer"}}  # data, not a schema
    assert schema["properties"]["age"] == {"type": "integer", "minimum": 0}  # not changed


def test_lark_json_embeds_the_same_defaults(tokenizer: llguidance.LLTokenizer) -> None:
    grammar = LarkGrammar(f'start: "call " obj\nobj: %json {lark_json({"type": "integer"})}')
    assert constraint_problem(grammar, tokenizer) is None
    assert accepts(tokenizer, grammar, "call 12")
    assert not accepts(tokenizer, grammar, "call " + "1" * 20)
    assert "whitespace_flexible" in lark_json(None)
    assert lark_json(None).startswith("{") and "$defs" in lark_json(None)
    assert ANY_JSON_OBJECT["type"] == "object"


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (JsonSchema({"type": "wat"}), "json schema: Invalid type"),
        (Regex("a(b"), "regex: "),
        (LarkGrammar("start: missing"), 'unknown name: "missing"'),
        (Choice(()), "at least one choice"),
        (Choice(("a", "")), "must not be empty"),
    ],
)
def test_bad_constraints_are_problems_naming_the_constraint(
    tokenizer: llguidance.LLTokenizer, constraint: Constraint, words: str
) -> None:
    for vocab in (None, tokenizer):
        problem = constraint_problem(constraint, vocab)
        assert problem is not None
        assert problem.param == "constraint"
        assert words in problem.message


def test_special_tokens_are_checked_against_the_vocabulary(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    assert constraint_problem(LarkGrammar('start: "x" <|im_end|>'), tokenizer) is None
    problem = constraint_problem(LarkGrammar('start: "x" <|no_such|>'), tokenizer)
    assert problem is not None and "unknown special token" in problem.message


def test_the_tokenizer_covers_a_wider_model_vocabulary(tiny_model_dir: Path) -> None:
    text = (tiny_model_dir / "tokenizer.json").read_text()
    assert llg_tokenizer(text).vocab_size == 512
    wide = llg_tokenizer(text, vocab_size=520, eos_token_ids=[EOS])
    assert wide.vocab_size == 520
    assert wide.eos_tokens == [EOS]


def test_an_unreadable_tokenizer_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="llguidance cannot read"):
        llg_tokenizer('{"model": {"type": "nonsense"}}')


def test_equal_constraints_give_equal_grammar_texts() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert grammar_text(JsonSchema(schema)) == grammar_text(JsonSchema(dict(schema)))
    assert grammar_text(Regex("a")) != grammar_text(Regex("b"))


_CYCLE = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (JsonSchema({"$ref": "#"}), "accepts no string: no token can follow its start"),
        (JsonSchema({"$defs": _CYCLE, "$ref": "#/$defs/a"}), "accepts no string"),
        (
            JsonSchema(
                {
                    "type": "object",
                    "properties": {"k": {"$ref": "#/$defs/a"}},
                    "required": ["k"],
                    "$defs": _CYCLE,
                }
            ),
            """accepts no string: no token can follow '{"k":'""",
        ),
        (LarkGrammar('start: "a" x\nx: /[^\\x00-\\U0010FFFF]/'), "no token can follow 'a'"),
        (LarkGrammar('start: "a" x\nx: /[]/'), "unclosed character class"),
        (Regex(""), "accepts only the empty string"),
        (LarkGrammar('start: ""'), "accepts only the empty string"),
    ],
)
def test_grammars_that_can_write_nothing_are_problems(
    tokenizer: llguidance.LLTokenizer, constraint: Constraint, words: str
) -> None:
    problem = constraint_problem(constraint, tokenizer)
    assert problem is not None and problem.param == "constraint"
    assert words in problem.message


@pytest.mark.parametrize(
    "constraint",
    [
        JsonSchema({"const": "x"}),  # one string: forced, then EOS
        JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        JsonSchema(None),
        Regex("[0-9]*"),  # the empty string among others
        Choice(("yes", "no")),
    ],
)
def test_grammars_that_can_write_something_pass(
    tokenizer: llguidance.LLTokenizer, constraint: Constraint
) -> None:
    assert constraint_problem(constraint, tokenizer) is None


def test_a_lexer_past_its_fuel_is_refused_and_one_within_it_compiles(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    """LEXER_FUEL bounds what building a regex's lexer costs: llguidance's own
    default (5x more) builds this one, slowly; tserve refuses it."""
    blow_up = Regex("((a{50}){50}){50}")
    default = llguidance.LLMatcher(tokenizer, grammar_text(blow_up), log_level=0)
    assert start_problem(default, tokenizer) is None
    problem = constraint_problem(blow_up, tokenizer)
    assert problem is not None and "too many expressions constructed" in problem.message
    assert constraint_problem(Regex("((a{40}){40}){40}"), tokenizer) is None
    assert not matcher(tokenizer, grammar_text(blow_up)).is_error()  # it fails as it lexes


@pytest.mark.parametrize(
    ("vocab_size", "eos", "want_size", "want_eos"),
    [
        (None, [2], 512, 2),
        (512, [2], 512, 2),  # the model's vocabulary is the tokenizer's: built once
        (520, [2], 520, 2),  # padding rows past the tokenizer's
        (500, [2], 512, 2),  # smaller than the tokenizer's: the tokenizer's size
        (512, [600], 512, None),  # an EOS id past the vocabulary is left out
    ],
)
def test_llguidance_s_tokenizer_is_as_wide_as_the_model_s_logits(
    tiny_model_dir: Path,
    vocab_size: int | None,
    eos: list[int],
    want_size: int,
    want_eos: int | None,
) -> None:
    built = llg_tokenizer(
        (tiny_model_dir / "tokenizer.json").read_text(), vocab_size=vocab_size, eos_token_ids=eos
    )
    assert built.vocab_size == want_size
    if want_eos is not None:
        assert built.eos_token == want_eos
