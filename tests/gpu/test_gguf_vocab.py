"""A GGUF file's tokenizer from its metadata (tserve/gpu/gguf/_vocab.py).

Tiny files of each vocabulary kind, written with the ``gguf`` package, check
the logic against ids worked out by hand from the token texts (the real
files against llama.cpp's ids: ``test_gguf_vocab_llama_cpp.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.cores import small_core
from tests.gpu.gguf_files import write_gguf
from tests.gpu.tiny_vocabs import (
    GEMMA3_TEMPLATE,
    PIECES,
    TinyVocab,
    byte_level_vocab,
    sentencepiece_vocab,
)
from tserve.gpu.gguf._file import read_vocab, tokenizer_dir
from tserve.gpu.gguf._vocab import end_of_generation_ids
from tserve.gpu.models._directory import ModelLoadError
from tserve.nursery._model_tokenizer import ModelTokenizer, load_model_tokenizer


def vocab_file(tmp_path: Path, vocab: TinyVocab) -> Path:
    """A GGUF file holding only ``vocab``'s metadata."""
    import gguf

    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    vocab.write(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def file_tokenizer(tmp_path: Path, vocab: TinyVocab) -> ModelTokenizer:
    """The API process's tokenizer of ``vocab`` in a file: the files the engine
    writes once, read as any model directory's."""
    path = vocab_file(tmp_path, vocab)
    return load_model_tokenizer(tokenizer_dir(path, tmp_path / "cache", lambda _: None))


def ids(tokenizer: ModelTokenizer, text: str) -> list[int]:
    """``text``'s ids with BOS/EOS as the file says (llama.cpp's ``add_special``)."""
    return list(tokenizer.tokenizer.encode(text, add_special_tokens=True).ids)


# -- SentencePiece ("llama") -------------------------------------------------------------


def test_sentencepiece_merges_by_score_and_falls_back_to_bytes(tmp_path: Path) -> None:
    vocab = sentencepiece_vocab(PIECES)
    tokenizer = file_tokenizer(tmp_path, vocab)
    bos = vocab.id("<bos>")
    assert ids(tokenizer, "hello world") == [bos, vocab.id("hello"), vocab.id("▁world")]
    assert ids(tokenizer, "abc") == [bos, vocab.id("a"), vocab.id("bc")]
    # "é" is no piece: its UTF-8 bytes are.
    assert ids(tokenizer, "hé") == [bos, vocab.id("h"), vocab.id("<0xC3>"), vocab.id("<0xA9>")]
    assert tokenizer.decode(tokenizer.encode("hé hello\nworld")) == "hé hello\nworld"


def test_sentencepiece_tokens_by_type(tmp_path: Path) -> None:
    """Control tokens are special (decoding skips them), a user-defined one is
    matched in the raw text as it is; both stay whole."""
    vocab = sentencepiece_vocab(PIECES)
    tokenizer = file_tokenizer(tmp_path, vocab)
    text = "<start_of_turn>hello\n<end_of_turn>"
    assert tokenizer.encode(text) == [
        vocab.id("<start_of_turn>"),
        vocab.id("hello"),
        vocab.id("\n"),
        vocab.id("<end_of_turn>"),
    ]
    assert tokenizer.decode(tokenizer.encode(text)) == "hello\n"
    assert tokenizer.special_ids >= {vocab.id(t) for t in ("<bos>", "<eos>", "<end_of_turn>")}


def test_space_prefix_opens_each_run_of_text(tmp_path: Path) -> None:
    """add_space_prefix (Llama 2's files): a "▁" before the text and after
    each special token, as llama.cpp adds one; none at decoding."""
    vocab = sentencepiece_vocab(PIECES, add_space_prefix=True)
    tokenizer = file_tokenizer(tmp_path, vocab)
    world, wor = vocab.id("▁world"), vocab.id("▁wor")
    assert tokenizer.encode("world") == [world]
    assert tokenizer.encode("world<end_of_turn>world") == [world, vocab.id("<end_of_turn>"), world]
    assert tokenizer.encode("wor") == [wor]
    assert tokenizer.decode([world, world]) == "world world"


@pytest.mark.parametrize("name", ["Phi 3 Mini", "Phi-3 Mini 4k Instruct"])
def test_phi3_tokens_take_the_whitespace_after_them(tmp_path: Path, name: str) -> None:
    """As llama.cpp reads a file named Phi-3: an added token takes the
    whitespace after it (not <unk>, <s>, <|endoftext|>); other files keep it."""
    vocab = sentencepiece_vocab(PIECES)
    vocab.metadata["general.name"] = name
    tokenizer = file_tokenizer(tmp_path, vocab)
    eot, space, hello = (vocab.id(t) for t in ("<end_of_turn>", "▁", "hello"))
    stripped = "phi-3" in name.lower()
    assert tokenizer.encode("<end_of_turn>  hello") == (
        [eot, hello] if stripped else [eot, space, space, hello]
    )
    assert tokenizer.encode("<unk> hello") == [vocab.id("<unk>"), space, hello]


def test_bos_and_eos_as_the_file_says(tmp_path: Path) -> None:
    vocab = sentencepiece_vocab(PIECES)
    vocab.metadata["tokenizer.ggml.add_bos_token"] = False
    vocab.metadata["tokenizer.ggml.add_eos_token"] = True
    tokenizer = file_tokenizer(tmp_path, vocab)
    assert ids(tokenizer, "abc") == [vocab.id("a"), vocab.id("bc"), vocab.id("<eos>")]


# -- byte-level BPE ("gpt2") -------------------------------------------------------------

MERGES = ["1 2", "12 3", "4 5", "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]


@pytest.mark.parametrize(
    ("pre", "digits"),
    [
        ("qwen2", ["1", "2", "3", "4", "5"]),  # one digit a piece
        ("qwen35", ["1", "2", "3", "4", "5"]),
        ("smollm", ["1", "2", "3", "4", "5"]),
        ("llama-bpe", ["123", "45"]),  # runs of up to three
        ("gpt-2", ["123", "45"]),  # the whole run, then merges
    ],
)
def test_byte_level_splits_text_by_its_pre_tokenizer(
    tmp_path: Path, pre: str, digits: list[str]
) -> None:
    vocab = byte_level_vocab(MERGES, pre)
    tokenizer = file_tokenizer(tmp_path, vocab)
    assert tokenizer.encode("12345") == [vocab.id(d) for d in digits]
    expected = [vocab.id(t) for t in ("hello", "Ġwor", "l", "d")]
    assert tokenizer.encode("hello world") == expected
    chat = "<|im_start|>hello<|im_end|>"
    assert ids(tokenizer, chat) == [vocab.id("<|im_start|>"), expected[0], vocab.id("<|im_end|>")]
    assert tokenizer.decode(tokenizer.encode("héllo wörld 🦙")) == "héllo wörld 🦙"


def test_end_of_generation_ids_as_llama_cpp_collects_them(tmp_path: Path) -> None:
    """EOS by its id, EOT by its key, and every token whose text marks an end of turn."""
    vocab = byte_level_vocab(MERGES, "qwen2")
    vocab.metadata["tokenizer.ggml.eot_token_id"] = vocab.id("hello")
    found = end_of_generation_ids(read_vocab(vocab_file(tmp_path, vocab)))
    assert found == tuple(sorted(vocab.id(t) for t in ("<|endoftext|>", "<|im_end|>", "hello")))
    spm = sentencepiece_vocab(PIECES)
    found = end_of_generation_ids(read_vocab(vocab_file(tmp_path, spm)))
    assert found == (spm.id("<eos>"), spm.id("<end_of_turn>"))


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("tokenizer.ggml.model", "rwkv", "tokenizer.ggml.model 'rwkv': tserve builds the 'llama'"),
        ("tokenizer.ggml.pre", "nonsense", "tokenizer.ggml.pre 'nonsense': tserve splits text"),
    ],
)
def test_a_vocabulary_tserve_cannot_build_is_refused_in_one_line(
    tmp_path: Path, key: str, value: str, says: str
) -> None:
    vocab = byte_level_vocab(MERGES, "qwen2")
    if key == "tokenizer.ggml.model":
        vocab.model = value
    else:
        vocab.metadata[key] = value
    path = vocab_file(tmp_path, vocab)
    with pytest.raises(ModelLoadError) as caught:
        tokenizer_dir(path, tmp_path / "cache", lambda _: None)
    message = str(caught.value)
    assert message.startswith(f"vocab.gguf: {says}")
    assert "\n" not in message


# -- chat template -----------------------------------------------------------------------


def test_gemma_template_renders_its_turns(tmp_path: Path) -> None:
    """A file's tokenizer.chat_template is the chat's template; Gemma's turns
    come out as <start_of_turn>user ... <end_of_turn>, the assistant's as "model"."""
    vocab = sentencepiece_vocab(PIECES)
    vocab.metadata["tokenizer.chat_template"] = GEMMA3_TEMPLATE
    tokenizer = file_tokenizer(tmp_path, vocab)
    chat = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "abc "},
    ]
    text = tokenizer.render_chat(chat, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nhello<end_of_turn>\n"
        "<start_of_turn>model\nworld<end_of_turn>\n"
        "<start_of_turn>user\nabc<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    prompt = tokenizer.encode_chat(chat, add_generation_prompt=True)
    assert prompt[:2] == [vocab.id("<bos>"), vocab.id("<start_of_turn>")]
    assert prompt.count(vocab.id("<end_of_turn>")) == 3
    assert prompt.count(vocab.id("<bos>")) == 1


@pytest.mark.parametrize("dequantize", [False, True], ids=["as-is", "dequantized"])
def test_the_engine_ends_generation_at_the_files_end_of_turn(
    tmp_path: Path, tiny_model_dir: Path, dequantize: bool
) -> None:
    """Served as it is or through its fp32 conversion (whose tokenizer knows
    only EOS), a file's end-of-turn marker is one of the engine's EOS ids."""
    vocab = sentencepiece_vocab(PIECES, size=512)
    path = write_gguf(tiny_model_dir, tmp_path / "gguf" / "tiny.gguf", "Q8_0", vocab=vocab.write)
    core = small_core(path, cache_dir=str(tmp_path / "cache"), dequantize=dequantize)
    assert set(core.eos_token_ids) == {vocab.id("<eos>"), vocab.id("<end_of_turn>")}


def test_the_engine_refuses_an_unknown_vocabulary_at_load(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    vocab = sentencepiece_vocab(PIECES, size=512)
    vocab.model = "rwkv"
    path = write_gguf(tiny_model_dir, tmp_path / "gguf" / "tiny.gguf", "Q8_0", vocab=vocab.write)
    with pytest.raises(ModelLoadError) as caught:
        small_core(path, cache_dir=str(tmp_path / "cache"))
    assert str(caught.value) == (
        "tiny.gguf: tokenizer.ggml.model 'rwkv': tserve builds the 'llama' (SentencePiece) "
        "and 'gpt2' (byte-level BPE) vocabularies"
    )
