"""What a model directory says about its tokenizer, read from its JSON and Jinja files.

A directory saved by transformers holds (all optional but ``tokenizer.json``
for a generation model):

* ``tokenizer.json``: the ``tokenizers`` pipeline and its added tokens;
* ``tokenizer_config.json``: the named special tokens (``bos_token``,
  ``eos_token``, ... and any other ``*_token`` key, or a dict under
  ``extra_special_tokens``), further special tokens (a list under
  ``extra_special_tokens`` or the older ``additional_special_tokens``),
  ``added_tokens_decoder`` (id -> token and its flags), ``model_max_length``,
  ``clean_up_tokenization_spaces``, ``split_special_tokens``, and the chat
  template under ``chat_template`` (a string, or a list of
  ``{"name", "template"}``);
* ``chat_template.jinja`` (the default template) and
  ``additional_chat_templates/<name>.jinja``, which take precedence over
  the config's ``chat_template``.

(``generation_config.json``'s sampling values are the engine's business: it
reads them and reports them in ``EngineReady.sampling_defaults``.)

Reading is plain file IO and JSON: blocking (a worker thread), no
tokenizer library involved. An engine on another host sends these files
instead (:func:`load_unpacked`). A special token in the config may be a string
or an ``{"content": ...}`` object; both read as the token's flags.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tserve._model_json import read_json_object
from tserve.nursery._errors import LLMError
from tserve.protocol import tokenizer_file_allowed

__all__ = [
    "AddedTokenSpec",
    "TokenizerFiles",
    "TokenizerFilesError",
    "load_unpacked",
    "named_special_tokens",
    "read_tokenizer_config",
    "read_tokenizer_files",
]

# The named special tokens every tokenizer has a slot for, in the order
# transformers lists them (templates read them by these names).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# tokenizer_config.json leaves model_max_length out, or writes this
# placeholder, when the tokenizer itself sets no limit.
_NO_LIMIT = int(1e30)


class TokenizerFilesError(LLMError):
    """A model directory without a usable tokenizer (missing or malformed files)."""


@dataclasses.dataclass(frozen=True, slots=True)
class AddedTokenSpec:
    """A token matched in text before the model's own pieces, with its flags.

    ``normalized`` None: the default for its kind (normalized unless special).
    """

    content: str
    special: bool = False
    single_word: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool | None = None

    @property
    def is_normalized(self) -> bool:
        return (not self.special) if self.normalized is None else self.normalized


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """Everything the API process needs from a model directory to tokenize and chat."""

    tokenizer_json: Path
    # name -> text of the named special tokens (bos_token, ..., and model-specific names).
    named_special: dict[str, str]
    # The config's added_tokens_decoder, by id: added to the pipeline unless
    # it holds the same token with the same flags.
    config_added: tuple[AddedTokenSpec, ...]
    # The named, then the unnamed special tokens: added to the pipeline when
    # it has no added token with that text (a name makes a token special).
    special_tokens: tuple[AddedTokenSpec, ...]
    # Template name -> Jinja source; "default" is the one used without a name.
    chat_templates: dict[str, str]
    model_max_length: int | None
    clean_up_tokenization_spaces: bool
    split_special_tokens: bool


def read_tokenizer_files(directory: str | Path) -> TokenizerFiles:
    """Read ``directory``'s tokenizer files. Blocking; raises TokenizerFilesError."""
    root = Path(directory)
    tokenizer_json = root / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise TokenizerFilesError(f"{root} has no tokenizer.json")
    config = read_tokenizer_config(root)
    named, extra = _special_tokens(config)
    return TokenizerFiles(
        tokenizer_json=tokenizer_json,
        named_special={name: token.content for name, token in named.items()},
        config_added=_config_added(config.get("added_tokens_decoder")),
        special_tokens=(*(dataclasses.replace(t, special=True) for t in named.values()), *extra),
        chat_templates=_chat_templates(root, config.get("chat_template")),
        model_max_length=_max_length(config.get("model_max_length")),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        split_special_tokens=bool(config.get("split_special_tokens", False)),
    )


def read_tokenizer_config(directory: str | Path) -> dict[str, Any]:
    """tokenizer_config.json (empty without it), with special_tokens_map.json's
    entries over it in an older directory (one without added_tokens_decoder).
    Blocking; raises TokenizerFilesError for a file that is not a JSON object."""
    root = Path(directory)
    config = read_json_object(root / "tokenizer_config.json", TokenizerFilesError)
    if "added_tokens_decoder" in config:
        return config
    special_tokens_map = read_json_object(root / "special_tokens_map.json", TokenizerFilesError)
    return _with_special_tokens_map(config, special_tokens_map)


def named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """Name -> text of the special tokens a tokenizer config names."""
    return {name: token.content for name, token in _special_tokens(config)[0].items()}


_T = TypeVar("_T")


def load_unpacked(files: Mapping[str, bytes], load: Callable[[str], _T]) -> _T:
    """``load(directory)`` on a private temporary directory (0700, removed after)
    holding ``files``, a :class:`~tserve.protocol.TokenizerBundle`'s: the
    tokenizer of an engine on another host. Blocking (file IO). Raises
    TokenizerFilesError for a name ``tokenizer_file_allowed`` refuses."""
    with tempfile.TemporaryDirectory(prefix="tserve-tokenizer-") as directory:
        root = Path(directory)
        for name, data in files.items():
            if not tokenizer_file_allowed(name):
                raise TokenizerFilesError(f"the engine sent {name!r}, which is no tokenizer file")
            (root / name).parent.mkdir(exist_ok=True)
            (root / name).write_bytes(data)
        return load(directory)


# -- pieces ------------------------------------------------------------------------------


def _token(value: object) -> AddedTokenSpec | None:
    """A config's token entry: a string (a special token), or an object with
    ``content`` and its flags."""
    if isinstance(value, str):
        return AddedTokenSpec(value, special=True)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return AddedTokenSpec(
            value["content"],
            special=bool(value.get("special", False)),
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=None if value.get("normalized") is None else bool(value["normalized"]),
        )
    return None


def _with_special_tokens_map(config: dict[str, Any], mapped: dict[str, Any]) -> dict[str, Any]:
    """``config`` with special_tokens_map.json's entries over it (its objects are special)."""
    merged = dict(config)
    for key, value in mapped.items():
        if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
            old = merged.get("extra_special_tokens") or merged.get("additional_special_tokens")
            tokens = list(old) if isinstance(old, list) else []
            tokens += [t for t in value if t not in tokens]
            merged["extra_special_tokens"] = [
                {**t, "special": True} if isinstance(t, dict) else t for t in tokens
            ]
        elif isinstance(value, dict):
            merged[key] = {**value, "special": True}
        else:
            merged[key] = value
    return merged


def _special_tokens(
    config: dict[str, Any],
) -> tuple[dict[str, AddedTokenSpec], list[AddedTokenSpec]]:
    """(named special tokens, unnamed ones) as the config declares them.

    Names: the standard ones, any other ``*_token`` key, and the keys of a
    dict under ``extra_special_tokens``. Unnamed: a list there (or under
    ``additional_special_tokens``).
    """
    named: dict[str, AddedTokenSpec] = {}
    for key in NAMED_SPECIAL_TOKENS:
        if (token := _token(config.get(key))) is not None:
            named[key] = token
    for key, value in config.items():
        if key.endswith("_token") and key not in named and (token := _token(value)) is not None:
            named[key] = token
    extra_config = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    extra: list[AddedTokenSpec] = []
    if isinstance(extra_config, dict):  # model-specific names (image_token, ...)
        for key, value in extra_config.items():
            if (token := _token(value)) is not None:
                named[key] = token
    elif isinstance(extra_config, list):
        extra = [token for token in map(_token, extra_config) if token is not None]
    return named, extra


def _config_added(decoder: object) -> tuple[AddedTokenSpec, ...]:
    """added_tokens_decoder's tokens, by id."""
    if not isinstance(decoder, dict):
        return ()
    entries = sorted((int(i), value) for i, value in decoder.items() if str(i).isdigit())
    return tuple(token for _, value in entries if (token := _token(value)) is not None)


def _chat_templates(root: Path, configured: object) -> dict[str, str]:
    """Template files first (they take precedence), else the config's entry."""
    files: dict[str, str] = {}
    default_file = root / "chat_template.jinja"
    if default_file.is_file():
        files["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        return {
            entry["name"]: entry["template"]
            for entry in configured
            if isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)
        }
    return {}


def _max_length(value: object) -> int | None:
    if isinstance(value, int | float) and 0 < value < _NO_LIMIT:
        return int(value)
    return None
