"""Tokenizer policy in the API process: where tokenizing runs, and loading.

Two tokenizers, one per kind of engine:

* :class:`ChatTokenizer` (the generation model's, for :class:`~tserve.nursery.LLM`):
  text and chats to prompt ids, inline on the event loop when short and in
  a worker thread when long (:data:`INLINE_TOKENIZE_CHARS`), and decoding
  a few ids per streamed token.
* :class:`EncoderTokenizer` (the embedding model's, for
  :class:`~tserve.nursery.Embedder`): a batch of texts to ids, always in a
  worker thread, never truncated.

Both load in a worker thread (``load_*`` block) from the model directory's
files (``_model_tokenizer``): only ``tokenizers`` and ``jinja2`` are needed,
never torch or transformers, and only once a loader runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from tserve.nursery._errors import InvalidRequest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from tserve.nursery._model_tokenizer import ModelTokenizer

__all__ = [
    "INLINE_TOKENIZE_CHARS",
    "ChatTokenizer",
    "EncoderTokenizer",
    "Message",
    "load_chat_tokenizer",
    "load_encoder_tokenizer",
]

Message = dict[str, Any]
Tools = Sequence[Mapping[str, Any]] | None  # the template's ``tools`` variable
TemplateKwargs = Mapping[str, Any] | None  # more variables of the template (enable_thinking)
_Input = TypeVar("_Input")

# Prompts (or chats, counting their messages' contents) shorter than this many
# characters are tokenized on the event loop; longer ones in a worker thread.
# Why: handing work to a thread costs the loop 40-50 us of its own CPU plus two
# wakeups (measured here, and a load test found 22% of the API process's
# samples in that hand-off), while tokenizing costs about 20 us + 0.2 us per
# character. Below ~512 characters the tokenizer is the cheaper of the two, and
# at most ~0.15 ms of loop time per request. Above it, the thread wins and
# the loop stays free: a long text is tokenized with the GIL released
# (ModelTokenizer.encode), in parallel with the loop.
INLINE_TOKENIZE_CHARS = 512


class ChatTokenizer:
    """The generation model's tokenizer and where its work runs.

    The blocking calls (:meth:`encode`, :meth:`apply_chat_template`) are for
    worker threads or short inputs; :meth:`tokenize` and :meth:`tokenize_chat`
    choose between the two by length.
    """

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self.decode = tokenizer.decode
        # Tokenizer calls in worker threads. Bound: this many at once; more
        # wait for a thread (they are admitted requests, so at most
        # max_pending of them wait).
        self._limiter = anyio.CapacityLimiter(4)

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of the text prompt ``text``, with the special tokens the
        model's tokenizer adds around a text (a BOS where the model asks for
        one, as llama.cpp and vLLM encode a completion's prompt): on the event
        loop below ``INLINE_TOKENIZE_CHARS``, else in a worker thread (at most
        4 at once; the rest wait for one).

        Not a checkpoint when short. In a thread it is not cancellable: a
        cancel takes effect once the thread returns (a few ms at most).
        """
        return await self._run(partial(self.encode, special=True), text, len(text))

    async def tokenize_chat(
        self, messages: list[Message], tools: Tools = None, template_kwargs: TemplateKwargs = None
    ) -> list[int]:
        """Prompt ids for a chat (:meth:`apply_chat_template`), inline or in a
        thread by its messages' length, like :meth:`tokenize`."""
        work = partial(self.apply_chat_template, tools=tools, template_kwargs=template_kwargs)
        return await self._run(work, messages, _chat_chars(messages, tools))

    def encode(self, text: str, param: str = "prompt", *, special: bool = True) -> list[int]:
        """Token ids of ``text``, a prompt: with the special tokens the model adds
        to one (``special``; its BOS where it says so, as llama.cpp and
        transformers add it), or as it is. Blocking (tokenizer work):
        :meth:`tokenize` decides where. Raises InvalidRequest naming ``param``
        for text that is not valid Unicode."""
        try:
            return self.tokenizer.encode(text, special=special)
        except TypeError as exc:
            problem = _not_unicode([text], param)
            if problem is None:
                raise
            raise problem from exc

    def apply_chat_template(
        self, messages: list[Message], tools: Tools = None, template_kwargs: TemplateKwargs = None
    ) -> list[int]:
        """Prompt ids for a chat, the assistant's turn opened, ``tools`` the template's
        ``tools`` variable, ``template_kwargs`` more of its variables. Blocking; raises
        InvalidRequest (``param`` "messages") for a chat the template rejects."""
        text = self.tokenizer.render_chat(
            messages, add_generation_prompt=True, tools=tools, template_kwargs=template_kwargs
        )
        return self.encode(text, "messages", special=False)  # the template wrote its BOS

    async def _run(self, work: Callable[[_Input], list[int]], arg: _Input, chars: int) -> list[int]:
        if chars < INLINE_TOKENIZE_CHARS:
            return work(arg)
        return await anyio.to_thread.run_sync(work, arg, limiter=self._limiter)


class EncoderTokenizer:
    """The embedding model's fast tokenizer (truncation and padding off: lengths are checked)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # Tokenizer calls in worker threads; more wait for a thread (they are
        # admitted, so at most max_pending inputs' worth of calls wait).
        self._limiter = anyio.CapacityLimiter(2)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, special tokens included, never truncated. Blocking.
        Raises InvalidRequest (``param`` "input") for text that is not valid Unicode."""
        try:
            return [list(e.ids) for e in self.tokenizer.encode_batch(texts)]
        except TypeError as exc:
            problem = _not_unicode(texts, "input")
            if problem is None:
                raise
            raise problem from exc

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` in a worker thread (at most 2 at once; the rest wait).

        A checkpoint; a cancel takes effect once the thread returns.
        """
        return await anyio.to_thread.run_sync(self.encode, texts, limiter=self._limiter)


def _not_unicode(texts: list[str], param: str) -> InvalidRequest | None:
    """The tokenizer's TypeError for a ``str`` it cannot take (a lone surrogate
    is a ``str`` but not Unicode text) as the caller's InvalidRequest; None
    when every text is valid, so the TypeError was something else."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return InvalidRequest(f"{param}: not valid Unicode text ({exc.reason})", param)
    return None


# The template's work per message, in characters of tokenizing: rendering
# costs about 20 us a message (1 s per 50,000 empty messages), tokenizing
# about 0.2 us a character. So a chat of many short messages leaves the loop.
_MESSAGE_CHARS = 100


def _chat_chars(messages: list[Message], tools: Tools = None) -> int:
    """A chat's cost in characters: its contents (a content that is not text
    counts as its repr) plus :data:`_MESSAGE_CHARS` per message and per tool
    (tools count as their repr too)."""
    total = _MESSAGE_CHARS * len(messages)
    for tool in tools or ():
        total += _MESSAGE_CHARS + len(str(tool))
    for message in messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else len(str(content))
    return total


def load_chat_tokenizer(path: str) -> ChatTokenizer:
    """The generation model's tokenizer from its directory. Blocking (a worker
    thread); built once while the directory's files stay as they were
    (:func:`~tserve.nursery._model_tokenizer.cached_model_tokenizer`)."""
    from tserve.nursery._model_tokenizer import cached_model_tokenizer

    return ChatTokenizer(cached_model_tokenizer(path))


def load_encoder_tokenizer(path: str) -> EncoderTokenizer:
    """The encoder's tokenizer from its directory. Blocking (a worker thread).

    ``tokenizer.json`` when the directory has one, else a BERT ``vocab.txt``
    (see :func:`~tserve.nursery._model_tokenizer.load_encoder_pipeline`).
    """
    from tserve.nursery._model_tokenizer import load_encoder_pipeline

    return EncoderTokenizer(load_encoder_pipeline(path))
