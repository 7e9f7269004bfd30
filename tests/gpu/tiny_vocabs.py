"""Small vocabularies of both GGUF kinds, written as ``tokenizer.*`` metadata.

:class:`TinyVocab` lists tokens with their llama.cpp types and scores and
writes them with a ``gguf.GGUFWriter`` (:meth:`TinyVocab.write`), so a test
can build a file whose expected ids it computes by hand from the token texts.

* :func:`sentencepiece_vocab`: a Gemma-style ``llama`` vocabulary: control
  tokens (``<bos>``, ``<eos>``, ``<start_of_turn>``, ``<end_of_turn>``), a
  user-defined ``"\\n"``, the 256 ``<0xNN>`` byte pieces and a few scored
  pieces, padded with ``<unusedN>`` control tokens to a given size.
* :func:`byte_level_vocab`: a ``gpt2`` vocabulary: the 256 byte characters,
  ChatML's control tokens and a few merges.
"""

from __future__ import annotations

import dataclasses
from typing import Any

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# Gemma 3's chat template (its instruction-tuned files carry it as tokenizer.chat_template).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Scored best first: "hello" and "▁world" are built by merges of pieces that
# score higher; "bc" outscores "ab", so "abc" is "a" + "bc", not "ab" + "c".
PIECES = [
    "▁", "a", "b", "c", "d", "e", "h", "l", "o", "r", "w",
    "bc", "he", "ll", "▁w", "or", "hell", "hello", "▁wor", "ld", "▁world", "ab",
]  # fmt: skip


@dataclasses.dataclass
class TinyVocab:
    model: str  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str] = dataclasses.field(default_factory=list)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # further keys

    def id(self, text: str) -> int:
        return self.tokens.index(text)

    def write(self, writer: Any) -> None:
        """Write the vocabulary as ``tokenizer.*`` metadata with ``writer``."""
        writer.add_tokenizer_model(self.model)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.model == "llama":
            writer.add_token_scores(self.scores)
        if self.merges:
            writer.add_token_merges(self.merges)
        for key, value in self.metadata.items():
            if isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, int):
                writer.add_uint32(key, value)
            else:
                writer.add_string(key, value)


def sentencepiece_vocab(
    pieces: list[str], *, size: int | None = None, add_space_prefix: bool = False
) -> TinyVocab:
    """A Gemma-style vocabulary; ``pieces`` scored best first (-0, -1, ...)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = [*specials, "\n", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [CONTROL] * 3 + [UNKNOWN] + [CONTROL] * 2 + [USER_DEFINED] + [BYTE] * 256
    types += [NORMAL] * len(pieces)
    scores = [0.0] * (7 + 256) + [-float(rank) for rank in range(len(pieces))]
    for n in range(len(tokens), size or len(tokens)):
        tokens.append(f"<unused{n}>")
        types.append(CONTROL)
        scores.append(0.0)
    metadata = {
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }
    return TinyVocab("llama", tokens, types, scores, metadata=metadata)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_CHARS = _byte_chars()


def byte_level_vocab(merges: list[str], pre: str) -> TinyVocab:
    """A ``gpt2`` vocabulary: ChatML's control tokens, the byte characters, and
    one token per merge (its two sides joined), in the merges' order."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *BYTE_CHARS, *(merge.replace(" ", "") for merge in merges)]
    types = [CONTROL] * len(specials) + [NORMAL] * (len(tokens) - len(specials))
    metadata = {
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }
    return TinyVocab("gpt2", tokens, types, [], merges=merges, metadata=metadata)
