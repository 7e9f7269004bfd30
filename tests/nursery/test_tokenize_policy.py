"""Where tokenizing runs: on the event loop when cheap, in a thread otherwise."""

from __future__ import annotations

from tserve.nursery._tokenizer import INLINE_TOKENIZE_CHARS, _chat_chars


def test_a_chat_of_many_empty_messages_is_not_tokenized_on_the_loop() -> None:
    assert _chat_chars([{"role": "user", "content": "hi"}]) < INLINE_TOKENIZE_CHARS
    assert _chat_chars([{"role": "user", "content": ""}] * 50) >= INLINE_TOKENIZE_CHARS
