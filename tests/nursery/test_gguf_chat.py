"""A GGUF file whose tokenizer and chat template come from its metadata, served
by a real engine process: Gemma's turns in, and generation ends at Gemma's
``<end_of_turn>`` (an end-of-generation id the file's vocabulary names, not
its EOS).

The tiny random Llama's weights carry a Gemma-style SentencePiece vocabulary
of its 512 tokens; ``logit_bias`` makes the token under test the greedy one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.gpu.gguf_files import write_gguf
from tests.gpu.tiny_vocabs import GEMMA3_TEMPLATE, PIECES, TinyVocab, sentencepiece_vocab
from tests.nursery.conftest import ENGINE, settled
from tserve import LLM, SamplingParams, open_llm

pytestmark = pytest.mark.anyio

CHAT = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "world"},
    {"role": "user", "content": "abc"},
]


@pytest.fixture(scope="module")
def vocab() -> TinyVocab:
    vocab = sentencepiece_vocab(PIECES, size=512)
    vocab.metadata["tokenizer.chat_template"] = GEMMA3_TEMPLATE
    return vocab


@pytest.fixture(scope="module")
async def llm(
    anyio_backend: str,
    tiny_model_dir: Path,
    vocab: TinyVocab,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[LLM]:
    directory = tmp_path_factory.mktemp("gemma-vocab")
    path = write_gguf(tiny_model_dir, directory / "gguf" / "tiny.gguf", "Q8_0", vocab=vocab.write)
    async with open_llm(str(path), cache_dir=str(directory / "cache"), **ENGINE) as llm:
        yield llm


async def test_the_prompt_is_gemmas_turns(llm: LLM, vocab: TinyVocab) -> None:
    prompt = await llm.tokenize_chat(CHAT)
    assert llm.decode(prompt) == "user\nhello\nmodel\nworld\nuser\nabc\nmodel\n"
    turns = [vocab.id("<start_of_turn>"), vocab.id("<end_of_turn>")]
    assert [t for t in prompt if t in turns] == turns * 3 + turns[:1]
    assert prompt[0] == vocab.id("<bos>")
    assert prompt.count(vocab.id("<bos>")) == 1  # the template's, not one more


async def test_a_text_prompt_starts_with_the_bos_the_file_asks_for(
    llm: LLM, vocab: TinyVocab
) -> None:
    """As llama.cpp and vLLM encode a completion's prompt: Gemma answers
    without its BOS as a model out of its training would."""
    bos = vocab.id("<bos>")
    words = llm.encode("hello world")
    assert words[0] == bos and words.count(bos) == 1
    assert await llm.tokenize("hello world") == words
    result = await llm.complete("hello world", SamplingParams(max_tokens=1))
    assert result.prompt_token_ids == words
    abc = llm.encode("abc")
    ids = await llm.complete(abc, SamplingParams(max_tokens=1))
    assert ids.prompt_token_ids == abc  # ids as they are: no second BOS
    await settled(llm)


async def test_generation_stops_at_end_of_turn(llm: LLM, vocab: TinyVocab) -> None:
    end_of_turn = vocab.id("<end_of_turn>")
    params = SamplingParams(max_tokens=5, logit_bias=((end_of_turn, 100.0),))
    result = await llm.complete_chat(CHAT, params)
    assert result.finish_reason == "stop"
    assert (result.token_ids, result.text) == ([end_of_turn], "")  # ends it, not shown
    await settled(llm)


async def test_another_special_token_does_not_stop_it(llm: LLM, vocab: TinyVocab) -> None:
    """The control: <start_of_turn> is special, but it ends no generation."""
    start_of_turn = vocab.id("<start_of_turn>")
    params = SamplingParams(max_tokens=5, logit_bias=((start_of_turn, 100.0),))
    result = await llm.complete_chat(CHAT, params)
    assert result.finish_reason == "length"
    assert result.token_ids == [start_of_turn] * 5
    await settled(llm)
