"""Where tokenizing runs: on the event loop when cheap, in a thread otherwise."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tserve.nursery._model_tokenizer import _RELEASE_GIL_CHARS, load_model_tokenizer
from tserve.nursery._tokenizer import INLINE_TOKENIZE_CHARS, _chat_chars


def test_a_chat_of_many_empty_messages_is_not_tokenized_on_the_loop() -> None:
    assert _chat_chars([{"role": "user", "content": "hi"}]) < INLINE_TOKENIZE_CHARS
    assert _chat_chars([{"role": "user", "content": ""}] * 50) >= INLINE_TOKENIZE_CHARS


def test_a_long_text_is_encoded_with_the_gil_released(tiny_model_dir: Path) -> None:
    """While a worker thread encodes a megabyte of text, another thread keeps
    running, as the event loop must (the tokenizer's one-text call held the
    GIL for all of it: seconds). A count of the other thread's turns, far
    below what any machine gives it; not a timing."""
    tokenizer = load_model_tokenizer(tiny_model_dir)
    text = "Shall I compare thee to a summer's day? " * 25_000
    assert len(text) >= _RELEASE_GIL_CHARS
    result: list[list[int]] = []
    worker = threading.Thread(target=lambda: result.append(tokenizer.encode(text)))
    turns = 0
    worker.start()
    while worker.is_alive():
        turns += 1
        time.sleep(0.001)
    worker.join()
    assert result == [tokenizer.tokenizer.encode(text, add_special_tokens=False).ids]
    assert turns >= 10
