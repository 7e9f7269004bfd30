"""A model directory's tokenizer in the API process: ``tokenizers`` and ``jinja2``, no torch.

:func:`load_model_tokenizer` builds the same pipeline transformers'
``AutoTokenizer`` builds for a directory with a ``tokenizer.json`` (the file's
pipeline, plus the config's added and special tokens, see
:mod:`tserve.nursery._tokenizer_files`), and :class:`ModelTokenizer` answers
the three questions the API asks of it, the way transformers answers them:

* :meth:`~ModelTokenizer.encode` is ``encode(text, add_special_tokens=False)``
  (``special=True``: ``add_special_tokens=True``, a completion prompt's BOS);
* :meth:`~ModelTokenizer.decode` is ``decode(ids, skip_special_tokens=True)``;
* :meth:`~ModelTokenizer.encode_chat` is ``apply_chat_template(messages,
  add_generation_prompt=True)`` (text from :meth:`~ModelTokenizer.render_chat`).

:func:`load_encoder_pipeline` is the embedding model's counterpart: the
bare ``tokenizers`` pipeline, from ``tokenizer.json`` or a BERT ``vocab.txt``.

Not mirrored: tokenizer classes whose own ``__init__`` rebuilds the pipeline
from the vocabulary instead of taking ``tokenizer.json`` as written (a few
model-specific classes in transformers), and the regex patch transformers
applies to some Mistral tokenizers. For those the ids can differ.

Every call is CPU work: blocking, never a checkpoint. A long text is
encoded with the GIL released (see :meth:`ModelTokenizer.encode`), and
nothing here holds per-call state, so threads may share one ModelTokenizer.
:func:`cached_model_tokenizer` keeps the last few built, for a model's next
load (a model unloaded and loaded again, a switch between models).
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import Final, Unpack

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from tserve.nursery._chat_template import ChatOptions, ChatTemplate, select_template
from tserve.nursery._tokenizer_files import (
    AddedTokenSpec,
    TokenizerFiles,
    TokenizerFilesError,
    named_special_tokens,
    read_tokenizer_config,
    read_tokenizer_files,
)

__all__ = [
    "CACHED_TOKENIZERS",
    "ModelTokenizer",
    "cached_model_tokenizer",
    "load_encoder_pipeline",
    "load_model_tokenizer",
]

# Texts at least this long are encoded with the GIL released. Why: the
# binding's one-text call holds the GIL throughout (4 MB of text: 6 s here,
# all of it with the event loop stopped, even from a worker thread), and
# the Encoding it returns holds every token's string, which its deallocation
# frees with the GIL held (0.7 s for 2.9M tokens). ``encode_batch_fast``
# releases the GIL while it works, computes no offsets (tserve uses none;
# the ids are the same), and its Encoding is freed in milliseconds. Below
# this length the call is under a millisecond, and on the event loop
# releasing the GIL would only risk waiting a switch interval (5 ms) to
# take it back.
_RELEASE_GIL_CHARS = 2048

# Tokenizer classes whose directories may carry only a vocab.txt: BERT's
# WordPiece, which ``tokenizers`` builds the same way transformers does.
_WORDPIECE_CLASSES = frozenset(
    f"{name}{suffix}"
    for name in ("Bert", "DistilBert", "Electra")
    for suffix in ("Tokenizer", "TokenizerFast")
)

# transformers' clean-up of spaces before punctuation and contractions, in its
# order. Off unless the config asks for it, and never for BPE (it would
# remove spaces the text has).
_CLEAN_UPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class ModelTokenizer:
    """Text to ids, ids to text, and chats to ids for one model. Create with
    :func:`load_model_tokenizer`."""

    def __init__(self, tokenizer: Tokenizer, files: TokenizerFiles) -> None:
        self.tokenizer = tokenizer
        self.files = files
        self.model_max_length = files.model_max_length
        # Invariant: the template objects are built once; rendering mutates nothing.
        self._templates = {
            name: ChatTemplate(source, files.named_special)
            for name, source in files.chat_templates.items()
        }
        self._clean_up = files.clean_up_tokenization_spaces and _model_type(tokenizer) != "BPE"
        self._decode = tokenizer.decode

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids :meth:`decode` skips (the pipeline's special added tokens)."""
        return frozenset(
            i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special
        )

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text``, no special tokens added around it; with
        ``special``, those the pipeline adds to a prompt (BOS where the model
        says so: transformers' ``add_special_tokens=True``, llama.cpp's
        ``add_special``).

        Blocking. From ``_RELEASE_GIL_CHARS`` characters on, the GIL is free
        while the Rust tokenizer works; only building the list of ids holds
        it (about 30 ns an id: some 100 ms for the 2.9M ids of a 4 MB text).
        """
        if len(text) < _RELEASE_GIL_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=special).ids)
        [encoding] = self.tokenizer.encode_batch_fast([text], add_special_tokens=special)
        return encoding.ids  # a new list

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens skipped (about a microsecond for a few ids)."""
        text = str(self._decode(token_ids, skip_special_tokens=True))
        if self._clean_up:
            for before, after in _CLEAN_UPS:
                text = text.replace(before, after)
        return text

    def chat_template(self, *, tools: bool) -> ChatTemplate:
        """The template a chat uses (with ``tools``: its "tool_use" one if it has one).
        Raises ChatTemplateError when the model has none to use."""
        return select_template(self._templates, tools=tools)

    def render_chat(self, messages: object, **options: Unpack[ChatOptions]) -> str:
        """The prompt text of a chat, by the model's template (its "tool_use"
        one when given tools and it has one). Raises ChatTemplateError (an
        InvalidRequest naming ``messages``) when the template cannot render it."""
        template = select_template(self._templates, tools=options.get("tools") is not None)
        return template.render(messages, **options)

    def encode_chat(self, messages: object, **options: Unpack[ChatOptions]) -> list[int]:
        """Prompt ids of a chat: :meth:`render_chat`, then :meth:`encode`."""
        return self.encode(self.render_chat(messages, **options))


CACHED_TOKENIZERS: Final = 8
"""How many built tokenizers :func:`cached_model_tokenizer` keeps, least recently used dropped."""

_cached: collections.OrderedDict[tuple[object, ...], ModelTokenizer] = collections.OrderedDict()
_cached_lock = threading.Lock()


def cached_model_tokenizer(directory: str | Path) -> ModelTokenizer:
    """:func:`load_model_tokenizer`'s tokenizer of ``directory``, built once
    while the directory's files stay as they were: keyed by its path and the
    name, inode, size and modification time of each file in it and in its
    ``additional_chat_templates``, so that a file rewritten is read afresh.
    At most :data:`CACHED_TOKENIZERS` are kept (tens of MB each for a large
    vocabulary). Blocking (a worker thread); thread-safe, and two threads
    that miss at once both build it."""
    key = _identity(Path(directory))
    with _cached_lock:
        found = _cached.get(key)
        if found is not None:
            _cached.move_to_end(key)
            return found
    tokenizer = load_model_tokenizer(directory)
    with _cached_lock:
        _cached[key] = tokenizer
        while len(_cached) > CACHED_TOKENIZERS:
            _cached.popitem(last=False)
    return tokenizer


def _identity(root: Path) -> tuple[object, ...]:
    """``root`` and its files' (and chat templates') names, inodes, sizes and times."""
    files: list[tuple[str, int, int, int]] = []
    for folder in (root, root / "additional_chat_templates"):
        if not folder.is_dir():
            continue
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_file():
                    stat = entry.stat()
                    files.append((entry.path, stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return (str(root.resolve()), tuple(sorted(files)))


def load_model_tokenizer(directory: str | Path) -> ModelTokenizer:
    """The tokenizer of the model in ``directory``. Blocking (file IO and parsing:
    tens of ms for a 50k vocabulary; a worker thread). Raises TokenizerFilesError."""
    files = read_tokenizer_files(directory)
    tokenizer = _read_pipeline(files.tokenizer_json)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = files.split_special_tokens
    _add_tokens(tokenizer, files)
    return ModelTokenizer(tokenizer, files)


def load_encoder_pipeline(directory: str | Path) -> Tokenizer:
    """An embedding model's ``tokenizers`` pipeline, truncation and padding off.

    ``tokenizer.json`` as written when the directory has one, else a BERT
    ``vocab.txt`` as the WordPiece pipeline transformers builds from it (its
    config's casing, accent and CJK settings, [CLS] ... [SEP] around each
    text). Blocking (file IO); raises TokenizerFilesError for anything else.
    """
    root = Path(directory)
    if (root / "tokenizer.json").is_file():
        tokenizer = _read_pipeline(root / "tokenizer.json")
    else:
        tokenizer = _wordpiece_pipeline(root)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _read_pipeline(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust parser's error, whatever its type
        raise TokenizerFilesError(f"cannot load {path}: {exc}") from exc


def _wordpiece_pipeline(root: Path) -> Tokenizer:
    config = read_tokenizer_config(root)
    kind = config.get("tokenizer_class")
    vocab = root / "vocab.txt"
    if not vocab.is_file() or (kind is not None and kind not in _WORDPIECE_CLASSES):
        raise TokenizerFilesError(
            f"{root} has no tokenizer.json (and no BERT vocab.txt to build one from)"
        )
    named = named_special_tokens(config)
    unk, sep, cls = (named.get(f"{n}_token", f"[{n.upper()}]") for n in ("unk", "sep", "cls"))
    tokenizer = Tokenizer(models.WordPiece.from_file(str(vocab), unk_token=unk))
    tokenizer.add_special_tokens(
        [unk, sep, cls, named.get("pad_token", "[PAD]"), named.get("mask_token", "[MASK]")]
    )
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=bool(config.get("tokenize_chinese_chars", True)),
        strip_accents=config.get("strip_accents"),
        lowercase=bool(config.get("do_lower_case", True)),
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.BertProcessing(
        (sep, _token_id(tokenizer, sep)), (cls, _token_id(tokenizer, cls))
    )
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None  # add_special_tokens gave each one an id
    return token_id


def _add_tokens(tokenizer: Tokenizer, files: TokenizerFiles) -> None:
    """Add what the config declares and the pipeline lacks, as transformers does.

    A config entry is added unless the pipeline already has that token with
    the same flags (adding it again updates the flags), and is made special
    when a special token names it; a special token is added only when no
    added token has its text.
    """
    existing = tokenizer.get_added_tokens_decoder().values()
    same = {repr(token) for token in existing}
    named = set(files.named_special.values())
    to_add = [
        _added_token(spec, special=spec.special or spec.content in named)
        for spec in files.config_added
        if repr(_added_token(spec)) not in same
    ]
    known = {token.content for token in existing} | {token.content for token in to_add}
    for spec in files.special_tokens:
        if spec.content not in known:
            to_add.append(_added_token(spec))
            known.add(spec.content)
    if to_add:
        tokenizer.add_tokens(to_add)


def _added_token(spec: AddedTokenSpec, *, special: bool | None = None) -> AddedToken:
    """``spec`` as a ``tokenizers`` token; ``special`` overrides its flag (only that)."""
    return AddedToken(
        spec.content,
        single_word=spec.single_word,
        lstrip=spec.lstrip,
        rstrip=spec.rstrip,
        normalized=spec.is_normalized,
        special=spec.special if special is None else special,
    )


def _model_type(tokenizer: Tokenizer) -> str:
    return type(tokenizer.model).__name__
