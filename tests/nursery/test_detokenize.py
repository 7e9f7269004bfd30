"""Incremental detokenization and stop strings, without a model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tserve.nursery._detokenize import IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """Token id = one byte, plus a few multi-byte tokens, decoded like byte-level BPE."""

    MERGED = {256: "é".encode(), 257: b" the", 258: "\xe2\x82".encode("latin-1")}
    SPECIAL = 259

    def vocab(self, token_id: int) -> bytes:
        if token_id == self.SPECIAL:
            return b"<eos>"
        return self.MERGED.get(token_id, bytes([token_id % 256]))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if not (skip_special_tokens and t == self.SPECIAL)]
        return b"".join(self.vocab(t) for t in ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    out, i = [], 0
    for size in sizes:
        out.append(detok.push(ids[i : i + size]))
        i += size
    out.append(detok.push(ids[i:]))
    out.append(detok.flush())
    return out


TEXTS = ["hello world", "naïve café ☕ — 日本語テキスト 🙂🚀", "€uro", "a\u0301", "plain ascii"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_whole_decode(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@given(
    text=st.text(min_size=0, max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=5), max_size=40),
)
def test_any_chunking_never_emits_broken_utf8(text: str, cuts: list[int]) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    deltas = stream(IncrementalDetokenizer(tok.decode), ids, cuts)
    assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


def test_a_partial_character_is_held_until_complete() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok.decode)
    euro = list("€".encode())
    assert detok.push([ord("a")]) == "a"
    assert detok.push(euro[:1]) == ""
    assert detok.push(euro[1:2]) == ""
    assert detok.push(euro[2:]) == "€"


def test_a_dangling_byte_is_flushed_at_the_end() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok.decode)
    assert detok.push([ord("x"), 258]) == ""
    assert detok.flush() == "x\ufffd"


def test_special_tokens_are_skipped() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok.decode)
    assert detok.push([ord("o"), ord("k"), ByteTokenizer.SPECIAL]) == "ok"
    keep = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert keep.push([ord("o"), ByteTokenizer.SPECIAL]) == "o<eos>"


def feed(matcher: StopMatcher, pieces: list[str]) -> str:
    out = []
    for piece in pieces:
        out.append(matcher.push(piece))
        if matcher.stopped:
            break
    out.append(matcher.flush())
    return "".join(out)


def test_stop_string_split_across_deltas_is_honoured() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abc ST") == "abc "
    assert matcher.push("O") == ""
    assert matcher.push("Pxyz") == ""
    assert matcher.stopped and matcher.matched == "STOP"
    assert matcher.flush() == ""
    assert matcher.push("more") == ""


def test_held_prefix_that_is_not_a_stop_is_released() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("a ST") == "a "
    assert matcher.push("ART") == "START"
    assert not matcher.stopped and matcher.matched is None


def test_first_completed_stop_string_wins_whatever_the_split() -> None:
    for pieces in (["hello", " world"], ["hello world"], list("hello world")):
        assert feed(matcher := StopMatcher(["world", "lo w"]), pieces) == "hel"
        assert matcher.matched == "lo w"
        assert feed(StopMatcher(["abcd", "c"]), ["ab", "cd"]) == "ab"
        assert feed(StopMatcher(["abcd", "c"]), ["abcd"]) == "ab"


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("abc") == "abc"
    assert matcher.flush() == ""


@given(
    text=st.text(alphabet="abST OP", max_size=60),
    stops=st.lists(st.text(alphabet="abST OP", min_size=1, max_size=4), max_size=3),
    seed=st.integers(0, 1000),
)
def test_streamed_stop_equals_stop_on_whole_text(text: str, stops: list[str], seed: int) -> None:
    expected = text
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if text[:end].endswith(s)]
        if ending:
            expected = text[: end - max(ending)]
            break
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 5)
        pieces.append(text[i:j])
        i = j
    assert feed(StopMatcher(stops), pieces) == expected


def test_real_byte_level_tokenizer_one_token_at_a_time(tiny_model_dir: Path) -> None:
    """With the tiny model's byte-level BPE: multi-byte characters split over
    several tokens are held until complete, so no delta holds U+FFFD."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "héllo wörld — ✓ 日本語 🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 3  # many characters span tokens
    detok = IncrementalDetokenizer(lambda t: str(tokenizer.decode(t, skip_special_tokens=True)))
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
