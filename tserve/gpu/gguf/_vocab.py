"""A GGUF file's tokenizer, built from its ``tokenizer.*`` metadata the way
llama.cpp reads it: a ``tokenizers`` pipeline, no transformers, no torch.

Two vocabularies (``tokenizer.ggml.model``), the ones GGUF files of chat
models ship; any other is refused with one line:

* ``llama``: SentencePiece BPE (Llama 2, Gemma, Phi-3). Pieces merge by the
  score of the piece they make (highest first), as llama.cpp's SPM tokenizer
  merges them: every split of a piece into two pieces of the vocabulary is a
  merge ranked by that score. Spaces become ``▁``; with ``add_space_prefix``
  a ``▁`` opens the text and every run of text after a special token.
  Characters outside the vocabulary fall back to its ``<0xNN>`` byte pieces.
* ``gpt2``: byte-level BPE (Qwen2, Llama 3, SmolLM) with the file's merges,
  its text split first by the regular expressions llama.cpp chooses by
  ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`; an unknown name is refused).

Token types (``tokenizer.ggml.token_type``) decide what is matched in the
text before the model's pieces: control tokens as special tokens (skipped
when decoding), user-defined ones as plain added tokens, both matched on the
raw text (in Phi-3's files with the whitespace after them, as llama.cpp
matches them there). With ``add_special_tokens`` the pipeline adds BOS and EOS as
``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say (llama.cpp's
defaults where the file is silent), so its ids equal llama.cpp's
``/tokenize`` with ``add_special``.

:func:`end_of_generation_ids` is llama.cpp's list of tokens that end a
generation: EOS, EOT and EOM by id, and tokens whose text is a known
end-of-turn marker (Gemma's ``<end_of_turn>``, ChatML's ``<|im_end|>``).

Everything here is CPU work on the metadata's lists, blocking: about two
seconds for a 262k-token SentencePiece vocabulary, well under one for a
50k byte-level one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

__all__ = [
    "PRE_TOKENIZERS",
    "GgufVocab",
    "VocabError",
    "build_tokenizer",
    "end_of_generation_ids",
    "write_tokenizer_files",
]

# llama.cpp's token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Texts of the tokens that end a generation wherever they appear in a
# vocabulary, as llama.cpp lists them (llama-vocab.cpp, special_eog_ids).
_END_OF_GENERATION_TEXTS: Final = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's, in full-width bars
        "[e~[",
    }
)

# The added tokens of a Phi-3 file that keep the whitespace after them.
_KEEP_SPACE_AFTER: Final = frozenset({"<unk>", "<s>", "<|endoftext|>"})

# llama.cpp's splitting expressions (llama-vocab.cpp, llm_tokenizer_bpe), applied
# one after the other, each match and each gap between matches a piece.
_GPT2: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS: Final = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3: Final = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2: Final = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35: Final = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s+(?!\S)|\s+"
)
_DEFAULT: Final = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")


@dataclasses.dataclass(frozen=True)
class _Pre:
    """A ``tokenizer.ggml.pre`` family: its expressions, whether a word found
    whole in the vocabulary skips the merges, and llama.cpp's add-BOS default."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


def _family(names: str, pre_tokenizer: _Pre) -> dict[str, _Pre]:
    return dict.fromkeys(names.split(), pre_tokenizer)


PRE_TOKENIZERS: Final[Mapping[str, _Pre]] = {
    "default": _Pre(_DEFAULT),
    **_family(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        _Pre((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **_family("dbrx smaug-bpe", _Pre((_LLAMA3,))),
    **_family("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2", _Pre((_QWEN2,))),
    "qwen35": _Pre((_QWEN35,)),
    **_family(
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        _Pre((r"\p{N}", _GPT2)),
    ),
    **_family(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum "
        "modern-bert mpt olmo jais exaone4 trillion granite-docling",
        _Pre((_GPT2,)),
    ),
}
"""``tokenizer.ggml.pre`` -> how llama.cpp splits text before its byte-level BPE."""


class VocabError(ValueError):
    """Metadata tserve cannot build a tokenizer from (one line, naming the key)."""


@dataclasses.dataclass(frozen=True)
class GgufVocab:
    """The ``tokenizer.*`` metadata a tokenizer is built from."""

    model: str  # tokenizer.ggml.model
    tokens: Sequence[str]
    token_types: Sequence[int]  # one per token; NORMAL where the file has none
    scores: Sequence[float]  # one per token ("llama"); empty for "gpt2"
    merges: Sequence[str]  # "left right" ("gpt2")
    pre: str  # tokenizer.ggml.pre ("default" where absent)
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eot_id: int | None = None
    eom_id: int | None = None
    chat_template: str | None = None
    # Phi-3's files (by general.name, as llama.cpp tells them): whitespace
    # after a special or user-defined token is part of it (not <unk>, <s>,
    # <|endoftext|>).
    rstrip_added: bool = False

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> GgufVocab:
        """From ``tokenizer.*`` keys and ``general.name`` (full key -> value), with llama.cpp's
        defaults for the ones a file leaves out. Raises VocabError for a
        vocabulary kind or pre-tokenizer it does not know."""
        model = meta.get("tokenizer.ggml.model")
        if model not in ("llama", "gpt2"):
            raise VocabError(
                f"tokenizer.ggml.model {model!r}: tserve builds the 'llama' (SentencePiece) "
                "and 'gpt2' (byte-level BPE) vocabularies"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise VocabError("no tokenizer.ggml.tokens in its metadata")
        pre_name = str(meta.get("tokenizer.ggml.pre") or "default")
        spm = model == "llama"
        if not spm and pre_name not in PRE_TOKENIZERS:
            raise VocabError(
                f"tokenizer.ggml.pre {pre_name!r}: tserve splits text as llama.cpp does for "
                "default, gpt-2, llama-bpe, qwen2, qwen35, smollm and the names it treats alike"
            )
        n = len(tokens)
        add_bos_default = spm or PRE_TOKENIZERS[pre_name].add_bos

        def token_id(key: str, default: int | None = None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}", default)
            return int(value) if value is not None and 0 <= int(value) < n else None

        template = meta.get("tokenizer.chat_template")
        name = str(meta.get("general.name") or "").lower()
        return cls(
            model=model,
            tokens=tokens,
            token_types=meta.get("tokenizer.ggml.token_type") or [_NORMAL] * n,
            scores=meta.get("tokenizer.ggml.scores") or ([0.0] * n if spm else []),
            merges=meta.get("tokenizer.ggml.merges") or [],
            pre=pre_name,
            # llama.cpp's defaults for a SentencePiece file: <unk> 0, <s> 1, </s> 2.
            bos_id=token_id("bos_token_id", 1 if spm else None),
            eos_id=token_id("eos_token_id", 2 if spm else None),
            unk_id=token_id("unknown_token_id", 0 if spm else None),
            pad_id=token_id("padding_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", spm)),
            eot_id=token_id("eot_token_id"),
            eom_id=token_id("eom_token_id"),
            chat_template=template if isinstance(template, str) else None,
            rstrip_added="phi-3" in name or "phi3" in name,
        )


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """The ``tokenizers`` pipeline of ``vocab`` (see the module). Blocking."""
    tokenizer = _sentencepiece(vocab) if vocab.model == "llama" else _byte_level(vocab)
    tokenizer.add_tokens(_added_tokens(vocab))
    post = _post_processor(vocab)
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer


def end_of_generation_ids(vocab: GgufVocab) -> tuple[int, ...]:
    """The ids that end a generation, as llama.cpp collects them: EOS, EOT and
    EOM by the file's ids, and every token whose text is a known end marker."""
    ids = {i for i in (vocab.eos_id, vocab.eot_id, vocab.eom_id) if i is not None}
    ids.update(i for i, text in enumerate(vocab.tokens) if text in _END_OF_GENERATION_TEXTS)
    return tuple(sorted(ids))


def write_tokenizer_files(vocab: GgufVocab, out: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (the special tokens'
    texts and the chat template) and ``generation_config.json`` (the
    end-of-generation ids) into directory ``out``: a model directory's files,
    which the API process and the grammar engine read. Blocking."""
    build_tokenizer(vocab).save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        name: vocab.tokens[i]
        for name, i in (
            ("bos_token", vocab.bos_id),
            ("eos_token", vocab.eos_id),
            ("unk_token", vocab.unk_id),
            ("pad_token", vocab.pad_id),
        )
        if i is not None
    }
    config["clean_up_tokenization_spaces"] = False
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # for transformers: the file as written
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    generation: dict[str, Any] = {"eos_token_id": list(end_of_generation_ids(vocab))}
    if vocab.bos_id is not None:
        generation["bos_token_id"] = vocab.bos_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))


# -- the two vocabularies -------------------------------------------------------------


def _sentencepiece(vocab: GgufVocab) -> Tokenizer:
    """BPE over characters, merges ranked by the score of the piece they make."""
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    merges = []
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if kind == _BYTE or len(text) < 2:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                merges.append((-vocab.scores[i], i, left, right))
    merges.sort()
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(
            ids,
            [(left, right) for _, _, left, right in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps: list[normalizers.Normalizer] = []
    if vocab.add_space_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode: list[decoders.Decoder] = [
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if vocab.add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _byte_level(vocab: GgufVocab) -> Tokenizer:
    """Byte-level BPE with the file's merges, text split as ``pre`` says."""
    family = PRE_TOKENIZERS[vocab.pre]
    merges = []
    for merge in vocab.merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise VocabError(f"tokenizer.ggml.merges: {merge!r} is not two pieces")
        merges.append((left, right))
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(models.BPE(ids, merges, ignore_merges=family.ignore_merges))
    splits: list[pre.PreTokenizer] = [
        pre.Split(Regex(expression), behavior="isolated") for expression in family.regexes
    ]
    splits.append(pre.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = pre.Sequence(splits)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _added_tokens(vocab: GgufVocab) -> list[AddedToken]:
    """Control and unknown tokens as special tokens, user-defined ones as plain
    added tokens: matched in the raw text before the model's pieces, as
    llama.cpp partitions its text."""
    added = []
    for text, kind in zip(vocab.tokens, vocab.token_types, strict=True):
        if kind in (_CONTROL, _UNKNOWN, _USER_DEFINED):
            special = kind != _USER_DEFINED
            rstrip = vocab.rstrip_added and text not in _KEEP_SPACE_AFTER
            added.append(AddedToken(text, special=special, normalized=False, rstrip=rstrip))
    return added


def _post_processor(vocab: GgufVocab) -> processors.PostProcessor | None:
    """BOS and EOS around a text encoded with ``add_special_tokens``."""
    before = [vocab.bos_id] if vocab.add_bos and vocab.bos_id is not None else []
    after = [vocab.eos_id] if vocab.add_eos and vocab.eos_id is not None else []
    if not before and not after:
        return None
    named = [vocab.tokens[i] for i in before]
    closing = [vocab.tokens[i] for i in after]
    return processors.TemplateProcessing(
        single=" ".join([*named, "$A", *closing]),
        pair=" ".join([*named, "$A", *closing, *named, "$B", *closing]),
        special_tokens=[(vocab.tokens[i], i) for i in {*before, *after}],
    )
