"""One model directory's tokenizer twice: transformers' and tserve's torch-free one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest

from tserve.nursery._chat_template import ChatTemplateError
from tserve.nursery._model_tokenizer import ModelTokenizer, load_model_tokenizer


class Pair:
    """transformers' tokenizer and ours for one directory."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        self.reference = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.ours: ModelTokenizer = load_model_tokenizer(directory)

    def check_chat(self, messages: Any, **kwargs: Any) -> str | None:
        """Assert both agree on ``messages``; the text, or None where both raised."""
        render: Callable[..., Any] = self.reference.apply_chat_template
        try:
            text = render(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            ids = render(messages, add_generation_prompt=True, return_dict=False, **kwargs)
        except Exception as exc:  # whatever transformers raises for it
            with pytest.raises(ChatTemplateError) as ours:
                self.ours.encode_chat(messages, **kwargs)
            assert ours.value.param == "messages"
            if type(exc) in (jinja2.TemplateError, jinja2.UndefinedError):  # the template's words
                assert ours.value.reason == str(exc)
            return None
        assert self.ours.render_chat(messages, **kwargs) == text
        assert self.ours.encode_chat(messages, **kwargs) == list(ids)
        return str(text)

    def check_text(self, text: str) -> None:
        ids = self.reference.encode(text, add_special_tokens=False)
        assert self.ours.encode(text) == ids
        assert self.ours.decode(ids) == self.reference.decode(ids, skip_special_tokens=True)
