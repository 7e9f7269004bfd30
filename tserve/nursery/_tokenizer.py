"""Tokenizer policy in the API process: where tokenizing runs, and loading.

Two tokenizers, one per kind of engine:

* :class:`ChatTokenizer` (the generation model's, for :class:`~tserve.nursery.LLM`):
  text and chats to prompt ids, inline on the event loop when short and in
  a worker thread when long (:data:`INLINE_TOKENIZE_CHARS`), and a fast path
  for decoding a few ids per streamed token.
* :class:`EncoderTokenizer` (the embedding model's, for
  :class:`~tserve.nursery.Embedder`): a batch of texts to ids, always in a
  worker thread, never truncated.

Both load in a worker thread (``load_*`` block); only ``tokenizers`` and,
for the generation model, ``transformers`` (imported inside the loaders, so
that importing tserve does not import torch) are needed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from tserve.nursery._errors import InvalidRequest

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "INLINE_TOKENIZE_CHARS",
    "ChatTokenizer",
    "EncoderTokenizer",
    "Message",
    "load_chat_tokenizer",
    "load_encoder_tokenizer",
]

Message = dict[str, Any]
_Input = TypeVar("_Input")

# Prompts (or chats, counting their messages' contents) shorter than this many
# characters are tokenized on the event loop; longer ones in a worker thread.
# Why: handing work to a thread costs the loop 40-50 us of its own CPU plus two
# wakeups (measured here, and a load test found 22% of the API process's
# samples in that hand-off), while tokenizing costs about 20 us + 0.2 us per
# character. Below ~512 characters the tokenizer is the cheaper of the two, and
# at most ~0.15 ms of loop time per request. Above it, the thread wins and
# the loop stays free: the Rust tokenizer releases the GIL, so a long prompt
# tokenizes in parallel with the loop.
INLINE_TOKENIZE_CHARS = 512


class ChatTokenizer:
    """The generation model's tokenizer and where its work runs.

    The blocking calls (:meth:`encode`, :meth:`apply_chat_template`) are for
    worker threads or short inputs; :meth:`tokenize` and :meth:`tokenize_chat`
    choose between the two by length.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.decode = _fast_decoder(tokenizer)
        # Tokenizer calls in worker threads. Bound: this many at once; more
        # wait for a thread (they are admitted requests, so at most
        # max_pending of them wait).
        self._limiter = anyio.CapacityLimiter(4)

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``: on the event loop below ``INLINE_TOKENIZE_CHARS``,
        else in a worker thread (at most 4 at once; the rest wait for one).

        Not a checkpoint when short. In a thread it is not cancellable: a
        cancel takes effect once the thread returns (a few ms at most).
        """
        return await self._run(self.encode, text, len(text))

    async def tokenize_chat(self, messages: list[Message]) -> list[int]:
        """Prompt ids for a chat (:meth:`apply_chat_template`), inline or in a
        thread by its messages' length, like :meth:`tokenize`."""
        return await self._run(self.apply_chat_template, messages, _chat_chars(messages))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Blocking (tokenizer work): :meth:`tokenize` decides where."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        """Prompt ids for a chat. Blocking; raises InvalidRequest for bad messages."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise InvalidRequest(f"messages: {exc}", param="messages") from None
        return self.encode(str(text))

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
        """Token ids of each text, special tokens included, never truncated. Blocking."""
        return [list(e.ids) for e in self.tokenizer.encode_batch(texts)]

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` in a worker thread (at most 2 at once; the rest wait).

        A checkpoint; a cancel takes effect once the thread returns.
        """
        return await anyio.to_thread.run_sync(self.encode, texts, limiter=self._limiter)


def _chat_chars(messages: list[Message]) -> int:
    """The length of a chat's contents (a content that is not text counts as its repr)."""
    total = 0
    for message in messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else len(str(content))
    return total


def _fast_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, minus Python overhead.

    A fast tokenizer's Rust backend decodes a few ids in about a microsecond;
    the Python wrapper around it costs four times that, twice per
    streamed token. Same text unless the tokenizer cleans up spaces.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        decode = backend.decode

        def fast(token_ids: list[int]) -> str:
            return str(decode(token_ids, skip_special_tokens=True))

        return fast

    def slow(token_ids: list[int]) -> str:
        return str(tokenizer.decode(token_ids, skip_special_tokens=True))

    return slow


def load_chat_tokenizer(path: str) -> ChatTokenizer:
    """The generation model's tokenizer from its directory. Blocking (a worker thread)."""
    from transformers import AutoTokenizer

    return ChatTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))


def load_encoder_tokenizer(path: str) -> EncoderTokenizer:
    """The encoder's tokenizer from its directory. Blocking (a worker thread).

    ``tokenizer.json`` when the directory has one, else whatever fast
    tokenizer transformers makes of it.
    """
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if file.is_file():
        tokenizer = Tokenizer.from_file(str(file))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True).backend_tokenizer
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return EncoderTokenizer(tokenizer)
