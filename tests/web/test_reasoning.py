"""The reasoning parser on every way to cut its input, its syntax detection, and the
grammar that puts a structured output after the thinking (a real llguidance matcher)."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
from pathlib import Path
from typing import cast

import llguidance
import pytest
from tokenizers import Tokenizer

from tests.web.thinking_model import TEMPLATE, build_thinking_model
from tserve.grammar import grammar_text, llg_tokenizer
from tserve.nursery import LLM
from tserve.nursery._model_tokenizer import ModelTokenizer, load_model_tokenizer
from tserve.sampling import Choice, Constraint, JsonSchema, LarkGrammar, Regex
from tserve.web._reasoning import (
    DEEPSEEK_R1,
    QWEN3,
    ReasoningSyntax,
    Split,
    detect_syntax,
    model_reasoning,
    syntax_named,
    thinking_off,
)

# (output, syntax) -> (reasoning, answer)
CASES = [
    ("<think>\nI think.\n</think>\n\nThe answer.", QWEN3, ("\nI think.\n", "The answer.")),
    ("  <think>a < b </think>x</think>", QWEN3, ("a < b ", "x</think>")),
    ("The answer <think>not this</think>", QWEN3, ("", "The answer <think>not this</think>")),
    ("<think>cut off while thin", QWEN3, ("cut off while thin", "")),
    ("<thin", QWEN3, ("", "<thin")),
    ("  ", QWEN3, ("", "  ")),
    ("<think></think>", QWEN3, ("", "")),
    ("I reason.</think>\n\nAnswer", DEEPSEEK_R1, ("I reason.", "Answer")),
    ("<think>I reason.</think>Answer", DEEPSEEK_R1, ("I reason.", "Answer")),
    ("never closed <think>", DEEPSEEK_R1, ("never closed <think>", "")),
    ("</thi", DEEPSEEK_R1, ("</thi", "")),
    ("x</think>", DEEPSEEK_R1, ("x", "")),
    ("Only the answer", DEEPSEEK_R1.answer_only(), ("", "Only the answer")),
]


def _run(syntax: ReasoningSyntax, pieces: list[str]) -> tuple[list[Split], Split]:
    parser = syntax.parser()
    splits = [parser.push(piece) for piece in pieces]
    return splits, parser.finish()


def _joined(splits: list[Split]) -> tuple[str, str]:
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


@pytest.mark.parametrize(("text", "syntax", "expected"), CASES)
def test_every_split_into_two_and_three_pieces_gives_the_same_result(
    text: str, syntax: ReasoningSyntax, expected: tuple[str, str]
) -> None:
    cuts: list[tuple[int, ...]] = [(i,) for i in range(len(text) + 1)]
    cuts += itertools.combinations(range(1, len(text)), 2)
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        splits, last = _run(syntax, pieces)
        assert _joined([*splits, last]) == expected, pieces


@pytest.mark.parametrize(("text", "syntax", "expected"), CASES)
def test_one_character_at_a_time(
    text: str, syntax: ReasoningSyntax, expected: tuple[str, str]
) -> None:
    splits, last = _run(syntax, list(text))
    assert _joined([*splits, last]) == expected


def test_nothing_is_held_longer_than_a_partial_tag() -> None:
    parser = QWEN3.parser()
    assert parser.push("<think>abc</th") == Split(reasoning="abc")
    assert not parser.reasoning_ended
    assert parser.push("inkx") == Split(reasoning="</thinkx")
    assert parser.push("</think>\n") == Split()
    assert parser.reasoning_ended
    assert parser.push("\nok") == Split(content="ok")
    assert parser.finish() == Split()
    with pytest.raises(RuntimeError):
        parser.push("more")


def test_the_last_piece_can_finish_the_parser() -> None:
    parser = DEEPSEEK_R1.parser()
    assert parser.push("a</thi") == Split(reasoning="a")
    assert parser.push("nk>  b</thi", final=True) == Split(content="b</thi")
    with pytest.raises(RuntimeError):
        parser.push("")


def test_an_answer_without_thinking_streams_at_once_with_qwen3() -> None:
    parser = QWEN3.parser()
    assert parser.push("Hi") == Split(content="Hi")
    assert parser.reasoning_ended


def test_names_and_detection() -> None:
    assert syntax_named("qwen3") == QWEN3
    assert syntax_named("deepseek_r1") == DEEPSEEK_R1
    assert syntax_named("none") is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        syntax_named("o1")
    assert detect_syntax("{{ messages }}", "<|user|>Hi<|assistant|>") is None
    qwen = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert detect_syntax(qwen, "<|im_start|>assistant\n") == QWEN3
    assert detect_syntax(qwen, None) == QWEN3
    bar = "\uff5c"  # DeepSeek's turn markers use a full-width bar
    r1 = f"{{{{ '<{bar}Assistant{bar}><think>\\n' }}}}"
    assert detect_syntax(r1, f"<{bar}User{bar}>Hi<{bar}Assistant{bar}><think>\n") == DEEPSEEK_R1
    assert thinking_off({"enable_thinking": False})
    assert thinking_off({"thinking": False})
    assert not thinking_off({"enable_thinking": True})
    assert not thinking_off(None)


# -- the grammar: a structured output after the thinking ----------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> tuple[Tokenizer, llguidance.LLTokenizer]:
    text = (tiny_model_dir / "tokenizer.json").read_text()
    return Tokenizer.from_str(text), llg_tokenizer(text)


def _accepts(
    tokenizers: tuple[Tokenizer, llguidance.LLTokenizer], constraint: Constraint, text: str
) -> bool:
    tokenizer, llg = tokenizers
    matcher = llguidance.LLMatcher(llg, grammar_text(constraint))
    ok = all(matcher.consume_token(t) for t in tokenizer.encode(text).ids)
    return ok and matcher.is_accepting()


SCHEMA = JsonSchema({"type": "object", "properties": {"ok": {"type": "boolean"}}})


@pytest.mark.parametrize(
    ("syntax", "text", "accepted"),
    [
        (QWEN3, '<think>Let me see: {"ok": 1}</think>\n\n{"ok":true}', True),
        (QWEN3, '{"ok":false}', True),
        (QWEN3, '<think>no end {"ok":false}', False),
        (QWEN3, 'free text</think>{"ok":false}', False),
        (QWEN3, '<think>a</think>b</think>{"ok":true}', False),
        (DEEPSEEK_R1, 'thinking</think>{"ok":true}', True),
        (DEEPSEEK_R1, '<think>thinking</think> {"ok":true}', True),
        (DEEPSEEK_R1, '{"ok":true}', False),
    ],
)
def test_the_grammar_admits_thinking_then_the_answer(
    tiny_tokenizer: tuple[Tokenizer, llguidance.LLTokenizer],
    syntax: ReasoningSyntax,
    text: str,
    accepted: bool,
) -> None:
    assert _accepts(tiny_tokenizer, syntax.grammar(SCHEMA), text) is accepted


@pytest.mark.parametrize(
    ("constraint", "answer", "wrong"),
    [
        (Regex(r"[0-9]{2}/[a-z]}"), "42/x}", "4/x}"),
        (Choice(("yes", "no")), "no", "maybe"),
        (LarkGrammar('start: "{" item "}"\nitem: %json {"type": "integer"}'), "{7}", "{x}"),
    ],
)
def test_every_kind_of_constraint_follows_the_thinking(
    tiny_tokenizer: tuple[Tokenizer, llguidance.LLTokenizer],
    constraint: Constraint,
    answer: str,
    wrong: str,
) -> None:
    grammar = QWEN3.grammar(constraint)
    assert _accepts(tiny_tokenizer, grammar, f"<think>hmm</think>\n{answer}")
    assert _accepts(tiny_tokenizer, grammar, answer)
    assert not _accepts(tiny_tokenizer, grammar, f"<think>hmm</think>\n{wrong}")


# -- what --reasoning-parser means for a model -----------------------------------------


@dataclasses.dataclass
class _Model:
    """What model_reasoning reads of an LLM: its tokenizer (a real one)."""

    tokenizer: ModelTokenizer


def _model(directory: Path) -> LLM:
    return cast(LLM, _Model(load_model_tokenizer(directory)))


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def tags_as_text_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with the thinking template, and no <think> token."""
    directory = tmp_path_factory.mktemp("tags-as-text") / "model"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory


def test_auto_detects_a_thinking_model(thinking_dir: Path) -> None:
    reasoning = model_reasoning("auto", _model(thinking_dir))
    assert reasoning is not None
    assert reasoning.syntax == QWEN3.with_tags_as_tokens(True)
    assert reasoning.switchable  # the template reads enable_thinking
    assert reasoning.for_request({"enable_thinking": False}) == reasoning.syntax.answer_only()
    r1 = model_reasoning("deepseek_r1", _model(thinking_dir))
    assert r1 is not None and r1.syntax.starts_inside and r1.syntax.tags_are_tokens
    assert not r1.for_request({"enable_thinking": False}).starts_inside
    assert r1.for_request(None).starts_inside
    assert model_reasoning("none", _model(thinking_dir)) is None


def test_auto_wants_the_tags_as_tokens(tags_as_text_dir: Path, tiny_model_dir: Path) -> None:
    assert model_reasoning("auto", _model(tags_as_text_dir)) is None
    assert model_reasoning("auto", _model(tiny_model_dir)) is None
    named = model_reasoning("qwen3", _model(tiny_model_dir))
    assert named is not None and named.syntax == QWEN3 and not named.switchable
