"""Reading a model directory's tokenizer files without transformers
(tserve.nursery._tokenizer_files, loaded by _model_tokenizer): the ways a
directory declares its special tokens and templates, checked against
transformers where it loads the same directory, and the errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.nursery.tokenizer_pair import Pair
from tserve.gpu.models._directory import default_embedding_model_dir
from tserve.nursery._chat_template import ChatTemplateError
from tserve.nursery._model_tokenizer import (
    cached_model_tokenizer,
    load_encoder_pipeline,
    load_model_tokenizer,
)
from tserve.nursery._tokenizer_files import TokenizerFilesError, read_tokenizer_files

HI = [{"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _model(directory: Path, source: Path, config: dict[str, Any], **files: Any) -> Path:
    """``source``'s tokenizer.json with ``config`` as tokenizer_config.json, and
    ``files`` (name -> JSON object or text) beside them."""
    directory.mkdir()
    shutil.copy(source / "tokenizer.json", directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (directory / name.replace("__", ".")).write_text(text)
    return directory


def test_named_extra_and_legacy_special_tokens_match_transformers(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A dict of model-specific names, a list of unnamed tokens, and (without
    added_tokens_decoder) special_tokens_map.json over the config."""
    named = _model(
        tmp_path / "named",
        tiny_model_dir,
        {
            "eos_token": "<|im_end|>",
            "extra_special_tokens": {"image_token": "<image>", "audio_token": "<audio>"},
            "chat_template": TEMPLATE + "{{ image_token }}{{ eos_token }}",
        },
    )
    unnamed = _model(
        tmp_path / "unnamed",
        tiny_model_dir,
        {"eos_token": "<|im_end|>", "additional_special_tokens": ["<a1>", "<a2>"]},
    )
    legacy = _model(
        tmp_path / "legacy",
        tiny_model_dir,
        {"eos_token": "<old>", "chat_template": TEMPLATE + "{{ eos_token }}{{ bos_token }}"},
        special_tokens_map__json={
            "eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False},
            "bos_token": "<s>",
        },
    )
    for directory in (named, unnamed, legacy):
        pair = Pair(directory)
        assert pair.ours.files.named_special == pair.reference.special_tokens_map
        for text in ("x <image> y <a1> <audio> z <s> <old>", "<|im_end|> plain"):
            pair.check_text(text)
        pair.check_chat(HI)


def test_a_template_that_does_not_compile_fails_each_chat(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    broken = _model(tmp_path / "m", tiny_model_dir, {"chat_template": "{% for m in messages %}"})
    pair = Pair(broken)
    assert pair.check_chat(HI) is None
    with pytest.raises(ChatTemplateError, match="does not compile"):
        pair.ours.encode_chat(HI)
    assert pair.ours.encode("still tokenizes") == pair.reference.encode(
        "still tokenizes", add_special_tokens=False
    )


def test_no_template_or_no_default_raises(tmp_path: Path, tiny_model_dir: Path) -> None:
    bare = _model(tmp_path / "bare", tiny_model_dir, {})
    named = _model(
        tmp_path / "named", tiny_model_dir, {"chat_template": [{"name": "rag", "template": "x"}]}
    )
    for directory, words in ((bare, "no chat template"), (named, "no default: rag")):
        pair = Pair(directory)
        assert pair.check_chat(HI) is None
        with pytest.raises(ChatTemplateError, match=words) as raised:
            pair.ours.render_chat(HI)
        assert raised.value.param == "messages"


def test_template_files_take_precedence_over_the_config(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    directory = _model(
        tmp_path / "m",
        tiny_model_dir,
        {"chat_template": "config {{ messages | length }}"},
        chat_template__jinja="file {{ messages | length }}",
    )
    assert Pair(directory).check_chat(HI) == "file 1"


def test_the_embedding_model_tokenizes_as_transformers_does() -> None:
    """A WordPiece (BERT) tokenizer.json from another family."""
    pair = Pair(default_embedding_model_dir())
    for text in ("Hello, World! Don't stop.", "Grüße Çà va?  x", "[CLS] a [SEP] b"):
        pair.check_text(text)


def test_missing_or_malformed_files_raise(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(TokenizerFilesError, match=r"no tokenizer\.json"):
        read_tokenizer_files(tmp_path)
    malformed = _model(tmp_path / "m", tiny_model_dir, {})
    (malformed / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerFilesError, match=r"tokenizer_config\.json"):
        read_tokenizer_files(malformed)
    broken = _model(tmp_path / "b", tiny_model_dir, {})
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerFilesError, match="cannot load"):
        load_model_tokenizer(broken)


def test_an_encoder_without_tokenizer_json_builds_bert_wordpiece(tmp_path: Path) -> None:
    """What transformers makes of a BERT directory with only vocab.txt, ids
    with [CLS] and [SEP] as the embedder encodes them."""
    from transformers import AutoTokenizer

    source = default_embedding_model_dir()
    bert = tmp_path / "bert"
    bert.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(source / name, bert / name)
    reference = AutoTokenizer.from_pretrained(bert, local_files_only=True)
    ours = load_encoder_pipeline(bert)
    for text in ("Hello, World! Don't stop.", "Grüße Çà va?  x 中文", "[CLS] a [SEP] b", "x" * 600):
        assert ours.encode(text).ids == reference.encode(text)
    assert load_encoder_pipeline(source).encode("x" * 600).ids == reference.encode("x" * 600)

    (bert / "vocab.txt").unlink()
    with pytest.raises(TokenizerFilesError, match="no tokenizer"):
        load_encoder_pipeline(bert)


def test_a_tokenizer_is_built_once_while_its_files_stay_as_they_were(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    directory = _model(tmp_path / "m", tiny_model_dir, {"chat_template": TEMPLATE})
    first = cached_model_tokenizer(directory)
    assert cached_model_tokenizer(directory) is first  # the next load of the model
    assert first.render_chat(HI) == "<user>hi"
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE.replace("<", "<<")})  # another size
    )
    rewritten = cached_model_tokenizer(directory)
    assert rewritten is not first and rewritten.render_chat(HI) == "<<user>hi"
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert cached_model_tokenizer(directory).render_chat(HI) == "hi!"  # a new file counts
