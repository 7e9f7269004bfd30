"""Every architecture tserve runs, served end to end from a tiny GGUF file.

For each architecture a tiny random model (:mod:`tests.gpu.tiny_architectures`)
is written as a Q8_0 GGUF file whose metadata hold its vocabulary and a small
chat template (Gemma's turns over a SentencePiece vocabulary that adds
``<bos>``; ChatML over a byte-level one that does not), and served by
``python -m tserve serve FILE`` (one server per architecture, for the
module). Through the ``openai`` client: a chat and a completion, streamed
and not, greedy (no token of the bytes 0x80-0xFF), give the same text; the
chat's prompt is the template's rendering (by jinja2 here), tokenized
without special tokens (the template writes its own ``<bos>``), and the
completion's prompt is its text with the vocabulary's ``<bos>`` where it
adds one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jinja2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tokenizers import Tokenizer

from tests.gpu.gguf_files import write_gguf
from tests.gpu.tiny_architectures import KINDS, build_tiny_architecture
from tests.gpu.tiny_vocabs import (
    BYTE_CHARS,
    PIECES,
    TinyVocab,
    byte_level_vocab,
    sentencepiece_vocab,
)
from tests.web.conftest import Server
from tserve.gpu.gguf._file import tokenizer_dir

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
_MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]
_IGNORE_EOS = {"ignore_eos": True}


def _vocab(kind: str) -> TinyVocab:
    """Qwen's byte-level vocabulary with ChatML, else a SentencePiece one with Gemma's turns."""
    if kind.startswith("qwen"):
        vocab, template = byte_level_vocab(_MERGES, "qwen2"), _CHATML
    else:
        vocab, template = sentencepiece_vocab(PIECES), _TURNS
    vocab.metadata["tokenizer.chat_template"] = template
    return vocab


class _Served:
    def __init__(self, server: Server, vocab: TinyVocab, tokenizer: Tokenizer) -> None:
        self.server, self.vocab, self.tokenizer = server, vocab, tokenizer
        self.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        # Generate none of the bytes 0x80-0xFF: a random model strings them
        # into invalid UTF-8, whose replacement characters a stream and a whole text
        # place differently.
        high = [f"<0x{b:02X}>" for b in range(128, 256)] + BYTE_CHARS[128:]
        self.banned = {str(vocab.id(t)): -100 for t in high if t in vocab.tokens}


@pytest.fixture(scope="module", params=sorted(KINDS))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Served]:
    kind = request.param
    root = tmp_path_factory.mktemp(f"served-{kind}")
    vocab = _vocab(kind)
    ids = vocab.metadata
    model_dir = build_tiny_architecture(
        kind,
        root / "model",
        vocab_size=len(vocab.tokens),
        bos_token_id=ids["tokenizer.ggml.bos_token_id"],
        eos_token_id=ids["tokenizer.ggml.eos_token_id"],
        pad_token_id=ids.get("tokenizer.ggml.padding_token_id"),
    )
    path = write_gguf(model_dir, root / "gguf" / f"{kind}.gguf", "Q8_0", vocab=vocab.write)
    # The file's tokenizer as tserve builds it (its ids against llama.cpp's are
    # tests/gpu/test_gguf_vocab*.py's); the server builds its own from the file.
    tokenizer = Tokenizer.from_file(
        str(tokenizer_dir(path, root, lambda _: None) / "tokenizer.json")
    )
    server = Server(
        path, "--served-model-name", "tiny", "--cache-dir", str(root / "cache"),
        log=root / "server.log",
    )  # fmt: skip
    try:
        yield _Served(server, vocab, tokenizer)
    finally:
        assert server.stop() == 0, server.log.read_text()[-3000:]


def _tokenize(served: _Served, body: dict[str, Any]) -> list[int]:
    response = served.server.client.post("/tokenize", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_a_streamed_chat_is_the_greedy_chat_on_the_files_template(served: _Served) -> None:
    vocab = served.vocab
    template = vocab.metadata["tokenizer.chat_template"]
    bos = vocab.tokens[vocab.metadata["tokenizer.ggml.bos_token_id"]]
    text = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=_MESSAGES, add_generation_prompt=True, bos_token=bos)
    )
    expected = served.tokenizer.encode(text, add_special_tokens=False).ids
    assert _tokenize(served, {"messages": _MESSAGES}) == expected
    if template == _TURNS:  # its <bos> once, the template's
        assert expected[0] == vocab.id(bos) and expected.count(vocab.id(bos)) == 1
    whole = served.client.chat.completions.create(
        model="tiny", messages=_MESSAGES, max_tokens=6, temperature=0,
        logit_bias=served.banned, extra_body=_IGNORE_EOS,
    )  # fmt: skip
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(expected), 6)
    chunks = served.client.chat.completions.create(
        model="tiny", messages=_MESSAGES, max_tokens=6, temperature=0,
        logit_bias=served.banned, extra_body=_IGNORE_EOS, stream=True,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_a_streamed_completion_is_the_greedy_completion_after_bos(served: _Served) -> None:
    vocab = served.vocab
    prompt = "hello world"
    expected = served.tokenizer.encode(prompt, add_special_tokens=True).ids
    adds_bos = vocab.metadata["tokenizer.ggml.add_bos_token"]
    bos = vocab.metadata["tokenizer.ggml.bos_token_id"]
    assert (expected[0] == bos) is adds_bos
    assert _tokenize(served, {"prompt": prompt}) == expected
    whole = served.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0,
        logit_bias=served.banned, extra_body=_IGNORE_EOS,
    )  # fmt: skip
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(expected), 6)
    chunks = served.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0,
        logit_bias=served.banned, extra_body=_IGNORE_EOS, stream=True,
    )  # fmt: skip
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
