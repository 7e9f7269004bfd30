"""Real GGUF files' tokenizers, built from their metadata, against llama.cpp.

SmolLM2's byte-level BPE (pre "smollm") and Gemma 3's SentencePiece give the
ids llama.cpp's ``/tokenize`` gave (``add_special``) for a fixed multilingual
text set (and so do the API process's completion prompts), and SmolLM2's
chat template the prompts of llama.cpp's ``/apply-template``:
``tests/gpu/data/*_tokenize.json``, recorded by ``benchmarks/llama_tokenize.py``
(its docstring has the commands).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.tiny_vocabs import GEMMA3_TEMPLATE
from tserve.gpu.gguf._file import read_vocab, tokenizer_dir
from tserve.gpu.gguf._vocab import end_of_generation_ids
from tserve.gpu.models._directory import default_gguf
from tserve.nursery._model_tokenizer import ModelTokenizer, load_model_tokenizer
from tserve.nursery._tokenizer import ChatTokenizer

DATA = Path(__file__).parent / "data"


def _recorded(name: str, gguf: Path) -> dict[str, Any]:
    """The ids recorded for ``gguf`` (the very file: its sha256 is in the record)."""
    record: dict[str, Any] = json.loads((DATA / f"{name}_tokenize.json").read_text())
    assert len(record["texts"]) == len(record["ids"]) >= 10
    assert record["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    return record


def _check_against_llama_cpp(tokenizer: ModelTokenizer, record: dict[str, Any]) -> None:
    """Each text's ids with BOS/EOS as the file says (``add_special``)."""
    for text, expected in zip(record["texts"], record["ids"], strict=True):
        assert tokenizer.tokenizer.encode(text, add_special_tokens=True).ids == expected, text


def test_smollm2_ids_equal_llama_cpp(tmp_path: Path) -> None:
    """The bundled file (byte-level BPE, pre "smollm"), and the prompts its
    chat template makes."""
    path = default_gguf()
    tokenizer = load_model_tokenizer(tokenizer_dir(path, tmp_path, lambda _: None))
    record = _recorded("smollm2", path)
    _check_against_llama_cpp(tokenizer, record)
    assert len(record["chats"]) >= 2
    for chat in record["chats"]:  # its chat template, as llama.cpp renders it
        assert tokenizer.render_chat(chat["messages"], add_generation_prompt=True) == chat["prompt"]
    assert end_of_generation_ids(read_vocab(path)) == (0, 2)  # <|endoftext|>, <|im_end|>


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Gemma 3 file's tokenizer directory, built once (a minute on a busy machine)."""
    return tokenizer_dir(gemma3_gguf, tmp_path_factory.mktemp("gemma3-tok"), lambda _: None)


def test_gemma3_ids_and_end_of_turn_equal_llama_cpp(
    gemma3_gguf: Path, gemma3_tokenizer: Path
) -> None:
    """Gemma 3's 262k SentencePiece vocabulary; generation ends at <eos> and <end_of_turn>."""
    vocab = read_vocab(gemma3_gguf)
    assert (vocab.model, len(vocab.tokens)) == ("llama", 262144)
    directory = gemma3_tokenizer
    tokenizer = load_model_tokenizer(directory)
    _check_against_llama_cpp(tokenizer, _recorded("gemma3", gemma3_gguf))
    end_of_turn = vocab.tokens.index("<end_of_turn>")
    eog = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    assert {vocab.tokens.index("<eos>"), end_of_turn} <= set(eog)
    assert eog == list(end_of_generation_ids(vocab))


def test_a_completion_prompt_gets_bos_as_llama_cpp_adds_it(
    tmp_path: Path, gemma3_gguf: Path, gemma3_tokenizer: Path
) -> None:
    """The ids ``/v1/completions`` gives a text prompt (the API process's
    :class:`ChatTokenizer`) are llama.cpp's with ``add_special``: Gemma 3's file
    says ``add_bos_token``, so each starts with ``<bos>``; SmolLM2's does not.
    A chat prompt, whose template writes its own ``<bos>``, has it once."""
    smollm2 = tokenizer_dir(default_gguf(), tmp_path, lambda _: None)
    for name, path, directory in (
        ("gemma3", gemma3_gguf, gemma3_tokenizer),
        ("smollm2", default_gguf(), smollm2),
    ):
        tokens = ChatTokenizer(load_model_tokenizer(directory))
        record = _recorded(name, path)
        for text, expected in zip(record["texts"], record["ids"], strict=True):
            assert tokens.encode(text) == expected, text
        assert (tokens.encode("Hello")[0] == 2) is (name == "gemma3")  # Gemma's <bos>
    chat_dir = tmp_path / "chat"  # the base model's files with Gemma 3's chat template
    shutil.copytree(gemma3_tokenizer, chat_dir)
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = GEMMA3_TEMPLATE
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(config))
    chat = ChatTokenizer(load_model_tokenizer(chat_dir))
    prompt = chat.apply_chat_template([{"role": "user", "content": "Hello"}])
    vocab = read_vocab(gemma3_gguf)
    bos = vocab.tokens.index("<bos>")
    assert prompt[0] == bos and prompt.count(bos) == 1
    assert prompt[1] == vocab.tokens.index("<start_of_turn>")
