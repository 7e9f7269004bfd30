"""Parity of the torch-free tokenizer (tserve.nursery._model_tokenizer) with transformers.

The same conversations go through ``AutoTokenizer.apply_chat_template`` and
through ``ModelTokenizer``: the text and the ids must be identical, and
where transformers raises, ours raises ChatTemplateError (an InvalidRequest
naming ``messages``) with the same words when the template itself raised.
Models: the default model (SmolLM2-135M-Instruct), the tiny test model, and
directories that pair the tiny model's tokenizer.json with the templates of
tests/nursery/chat_templates.py, written in each of the ways a directory
can carry a template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.nursery import chat_templates
from tests.nursery.tokenizer_pair import Pair
from tserve.nursery import InvalidRequest

Chat = list[dict[str, Any]]

SIMPLE: Chat = [{"role": "user", "content": "Hi!"}]
SYSTEM: Chat = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]
MULTI: Chat = [
    {"role": "system", "content": "You answer in French."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Bonjour"},
    {"role": "user", "content": "How are you?"},
]
UNICODE: Chat = [{"role": "user", "content": 'Grüße 👋 — "quoted" <b>&amp;</b> \\ back\u00a0slash'}]
SPACES: Chat = [
    {"role": "user", "content": "  padded  \n\n"},
    {"role": "assistant", "content": " ok "},
    {"role": "user", "content": "next\t"},
]
TOKEN_TEXT: Chat = [{"role": "user", "content": "say <|im_end|> then <think> and <|endoftext|>"}]
NONE_KEYS: Chat = [{"role": "user", "content": "Hi", "name": None, "tool_calls": None}]
REASONING: Chat = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "Add them."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": " Again. "},
]
TOOL_CALLS: Chat = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
        ],
    },
    {"role": "tool", "content": '{"celsius": 21}'},
    {"role": "user", "content": "Thanks"},
]
STOP: Chat = [{"role": "user", "content": "STOP"}, {"role": "user", "content": "after"}]
CHATS = {
    "simple": SIMPLE,
    "system": SYSTEM,
    "multi": MULTI,
    "unicode": UNICODE,
    "spaces": SPACES,
    "token_text": TOKEN_TEXT,
    "none_keys": NONE_KEYS,
    "reasoning": REASONING,
    "tool_calls": TOOL_CALLS,
    "stop": STOP,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Today's weather — in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
DOCUMENTS = [{"title": "Zürich", "text": "A city."}, {"title": "B", "text": "two\nlines"}]
BAD_CHATS: dict[str, Any] = {
    "empty": [],
    "missing content": [{"role": "user"}],
    "content None": [{"role": "user", "content": None}],
    "content not a string": [{"role": "user", "content": 5}],
    "content parts": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "role not a string": [{"role": 5, "content": "hi"}],
    "string instead of dict": ["hi"],
}

# Template name -> how the directory carries it: "config" (tokenizer_config's
# chat_template string), "jinja" (chat_template.jinja), "named" (a list of
# named templates in the config), "files" (chat_template.jinja plus
# additional_chat_templates/).
TEMPLATES: dict[str, tuple[str, str]] = {
    "headers": (chat_templates.HEADERS, "config"),
    "alternating": (chat_templates.ALTERNATING, "jinja"),
    "turns": (chat_templates.TURNS, "config"),
    "tools": (chat_templates.TOOLS, "jinja"),
    "documents": (chat_templates.DOCUMENTS, "config"),
    "underscore": (chat_templates.UNDERSCORE, "config"),
    "named": (chat_templates.NAMED_DEFAULT, "named"),
    "named_files": (chat_templates.NAMED_DEFAULT, "files"),
}

# Added tokens only the config declares: a special one (skipped when
# decoding) and a plain one that still matches as a whole in text.
CONFIG_ADDED = {
    "600": {"content": "<think>", "special": True, "normalized": False},
    "601": {"content": "<tool_call>", "special": False, "normalized": False},
}


def _write_model(directory: Path, source: Path, template: str, how: str) -> Path:
    directory.mkdir()
    shutil.copy(source / "tokenizer.json", directory / "tokenizer.json")
    config: dict[str, Any] = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tool_token": "<tool_call>",
        "added_tokens_decoder": CONFIG_ADDED,
        "model_max_length": 512,
    }
    if how == "config":
        config["chat_template"] = template
    elif how == "named":
        config["chat_template"] = [
            {"name": "default", "template": template},
            {"name": "tool_use", "template": chat_templates.NAMED_TOOL_USE},
        ]
    else:
        (directory / "chat_template.jinja").write_text(template)
    if how == "files":
        (directory / "additional_chat_templates").mkdir()
        extra = directory / "additional_chat_templates" / "tool_use.jinja"
        extra.write_text(chat_templates.NAMED_TOOL_USE)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9, "top_k": 20})
    )
    return directory


@pytest.fixture(scope="module")
def default_model() -> Path:
    """The converted default model (converted once, as the engine does, if absent)."""
    from tserve.gpu.gguf._convert import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def template_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {
        name: _write_model(root / name, tiny_model_dir, template, how)
        for name, (template, how) in TEMPLATES.items()
    }


@pytest.fixture(scope="module")
def pairs(
    default_model: Path, tiny_model_dir: Path, template_dirs: dict[str, Path]
) -> dict[str, Pair]:
    found = {"default": Pair(default_model), "tiny": Pair(tiny_model_dir)}
    found.update({name: Pair(path) for name, path in template_dirs.items()})
    return found


@pytest.mark.parametrize("model", ["default", "tiny"])
@pytest.mark.parametrize("chat", list(CHATS))
def test_model_templates_match_transformers(pairs: dict[str, Pair], model: str, chat: str) -> None:
    rendered = pairs[model].check_chat(CHATS[chat])
    # ChatML templates add content to text: a message without content cannot render.
    assert (rendered is None) == (chat == "tool_calls")


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("chat", list(CHATS))
def test_written_templates_match_transformers(
    pairs: dict[str, Pair], template: str, chat: str
) -> None:
    pairs[template].check_chat(CHATS[chat])


@pytest.mark.parametrize("template", ["headers", "tools", "documents", "named", "named_files"])
def test_tools_and_documents_match_transformers(pairs: dict[str, Pair], template: str) -> None:
    rendered = pairs[template].check_chat(MULTI, tools=TOOLS, documents=DOCUMENTS)
    assert rendered is not None
    if template.startswith("named"):  # tools select the tool_use template
        assert rendered.startswith("[weather]")


@pytest.mark.parametrize("model", ["default", "tiny", "tools", "alternating"])
@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_chats_raise_where_transformers_raises(
    pairs: dict[str, Pair], model: str, case: str
) -> None:
    rendered = pairs[model].check_chat(BAD_CHATS[case])
    if model != "tools":  # it renders only the roles it knows, and no message without content
        assert rendered is None, case


def test_every_written_template_renders_something_and_rejects_something(
    pairs: dict[str, Pair],
) -> None:
    """The matrix above is not vacuous: the rules of each template are exercised."""
    outcomes = {
        name: {chat: pairs[name].check_chat(CHATS[chat]) is not None for chat in CHATS}
        for name in ("headers", "alternating", "turns", "tools", "documents")
    }
    assert all(any(row.values()) for row in outcomes.values())
    assert not outcomes["alternating"]["stop"]  # two user turns in a row
    assert not outcomes["turns"]["system"]  # no system role
    assert outcomes["tools"]["tool_calls"] and outcomes["headers"]["multi"]


@pytest.mark.parametrize(
    ("template", "chat", "words"),
    [
        ("alternating", STOP, "roles must alternate"),
        ("alternating", [{"role": "tool", "content": "x"}], "must alternate"),
        ("turns", SYSTEM, "System role not supported"),
        ("underscore", SIMPLE, "underscore"),
    ],
)
def test_template_errors_are_invalid_requests_naming_messages(
    pairs: dict[str, Pair], template: str, chat: Chat, words: str
) -> None:
    with pytest.raises(InvalidRequest, match=words) as raised:
        pairs[template].ours.encode_chat(chat)
    assert raised.value.param == "messages"
    assert str(raised.value).startswith("messages: ")
    assert pairs[template].check_chat(chat) is None


@pytest.mark.parametrize("model", ["default", "tiny", "tools"])
@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello, world!",
        " leading and trailing ",
        "Grüße 👋\n\ttabs",
        "<|im_start|>user\nhi<|im_end|>",
        "a <think> b <tool_call> c",
        "x" * 300,
        "Grüße 👋 <|im_start|>user\nhi<|im_end|>\n" * 100,  # long: encoded with the GIL released
    ],
)
def test_encode_and_decode_match_transformers(
    pairs: dict[str, Pair], model: str, text: str
) -> None:
    pairs[model].check_text(text)


@pytest.mark.parametrize("model", ["default", "tiny", "tools"])
def test_special_tokens_and_limits_match_transformers(pairs: dict[str, Pair], model: str) -> None:
    pair = pairs[model]
    assert pair.ours.files.named_special == pair.reference.special_tokens_map
    assert set(pair.reference.all_special_ids) <= pair.ours.special_ids
    assert pair.ours.tokenizer.get_vocab_size() == len(pair.reference)
    limit = pair.reference.model_max_length
    assert pair.ours.model_max_length == (limit if limit < 1e29 else None)


def test_generation_defaults_match_transformers(template_dirs: dict[str, Path]) -> None:
    """The engine's reading of generation_config.json (its sampling defaults)."""
    from transformers import GenerationConfig

    from tserve.gpu.models._sampling_defaults import read_sampling_defaults

    reference = GenerationConfig.from_pretrained(template_dirs["tools"])
    ours = read_sampling_defaults("auto", model_dir=template_dirs["tools"])
    assert (ours.temperature, ours.top_p, ours.top_k) == (
        reference.temperature,
        reference.top_p,
        reference.top_k,
    )
