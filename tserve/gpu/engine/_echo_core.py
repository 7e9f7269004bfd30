"""A model-free engine: :class:`EchoCore` streams tokens at a set pace, no torch.

It measures the frontend alone (HTTP, the request lifecycle, the mux, the
wire) with an engine whose cost is known and nearly zero. It is a
:class:`~tserve.gpu.engine._core.Core` like the real ones, chosen with
``EngineConfig.engine_kind = "echo"``. Rules:

* The model directory is read for its tokenizer's sake only: ``config.json``
  gives the vocabulary size, the context length and the EOS ids, and the API
  process loads the tokenizer from the same directory. No weights are read.
* A request is checked by the same rule as in the real engine
  (``tserve.validity``); one that can never run ends with an ERROR output.
* Requests run first come, first served, at most ``max_num_seqs`` at a time;
  the rest wait. Each step gives every running request ONE token: its
  prompt's tokens in turn, over and over, leaving out EOS ids (so the
  tokenizer turns them back into text, and EOS never ends a request).
* A request ends with STOP when its token is one of its stop token ids, with
  LENGTH once it has ``max_tokens`` tokens, with ABORT when aborted or when
  its deadline passed (checked at the start of each step).
* A step that gives out tokens takes ``echo_step_time`` seconds from the
  start of the previous one: it sleeps for what is left (it blocks).
* With ``logprobs`` asked for, every token's logprob is 0.0 (it was certain).
* ``constraint`` and ``logit_bias`` are checked like every parameter (an
  out-of-range bias is an ERROR) and otherwise ignored: the echo is not
  masked, so a constrained request gets its prompt back like any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tserve.gpu.engine._core import PeerKeyedBookkeeping, PeerOutput
from tserve.protocol import (
    AddRequest,
    EngineConfig,
    EngineStats,
    FinishReason,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from tserve.validity import generation_problem

__all__ = ["EchoCore"]

DEFAULT_CONTEXT = 2048  # when config.json names no max_position_embeddings


@dataclasses.dataclass(slots=True)
class _Echo:
    """One live request: what it echoes and how far it got."""

    request_id: str
    peer: bytes
    tokens: list[int]  # the prompt without EOS ids; never empty
    params: SamplingParams
    deadline: float | None
    sent: int = 0  # tokens given out so far; < params.max_tokens while live


class EchoCore(PeerKeyedBookkeeping[_Echo]):
    """Paced, model-free token streams. Not thread-safe; one owner calls it."""

    def __init__(self, config: EngineConfig, progress: Callable[[str], None] = print) -> None:
        super().__init__()
        if not config.echo_step_time >= 0:
            raise ValueError(f"echo_step_time must be >= 0, got {config.echo_step_time}")
        if config.model == "default":
            from tserve.gpu.gguf._convert import default_model_dir  # torch: only for "default"

            path = default_model_dir(config.cache_dir, progress=progress)
            self.model_name = "SmolLM2-135M-Instruct"
        else:
            path = Path(config.model).expanduser()
            self.model_name = path.name
        model_config = _read_config(path)
        self.model_path = path.resolve()
        self.vocab_size = int(model_config["vocab_size"])
        self.eos_token_ids = _eos_ids(path, model_config)
        model_len = int(model_config.get("max_position_embeddings") or DEFAULT_CONTEXT)
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.config = config
        self.device = "none (echo)"
        self._last_step = time.monotonic()
        progress(
            f"echo engine ready: {self.model_name}'s tokenizer, no model, "
            f"{config.echo_step_time:g} s per step"
        )

    # -- requests in ---------------------------------------------------------------

    def add(self, request: AddRequest, peer: bytes) -> None:
        """Queue a request; one that can never run is answered with an error."""
        if self._is_duplicate(request.request_id, peer):
            return
        problem = generation_problem(
            request.prompt_token_ids,
            request.params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        if problem is not None:
            self._reject(peer, request.request_id, problem.message)
            return
        eos = self.eos_token_ids
        tokens = [t for t in request.prompt_token_ids if t not in eos] or [0]
        echo = _Echo(request.request_id, peer, tokens, request.params, request.deadline)
        self._requests[(peer, request.request_id)] = echo  # the first max_num_seqs run

    # -- the step ----------------------------------------------------------------

    def step(self, now: float | None = None) -> list[PeerOutput]:
        """One token for each running request; returns (peer, output) pairs.

        Blocks for what is left of ``echo_step_time`` when it gives out
        tokens. ``now`` (default ``time.time()``) is what deadlines are
        checked against.
        """
        now = time.time() if now is None else now
        self._expire(now)  # 1 end expired requests
        running = list(self._requests.values())[: self.config.max_num_seqs]  # 2 schedule
        outputs = self._take_pending()
        if running:
            self._pace()  # 3 the step's time
            self._count_step()
            outputs += [(echo.peer, self._next_token(echo)) for echo in running]  # 4-6
        return outputs

    def _pace(self) -> None:
        """Sleep until ``echo_step_time`` has passed since the previous step began."""
        left = self._last_step + self.config.echo_step_time - time.monotonic()
        if left > 0:
            time.sleep(left)
        self._last_step = time.monotonic()

    def _next_token(self, echo: _Echo) -> RequestOutput:
        token = echo.tokens[echo.sent % len(echo.tokens)]
        echo.sent += 1
        params = echo.params
        reason: FinishReason | None = None
        if token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif echo.sent >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            del self._requests[(echo.peer, echo.request_id)]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprob(token, 0.0, [(token, 0.0)][: params.logprobs])]
        return RequestOutput(echo.request_id, [token], reason, logprobs)

    def stats(self) -> EngineStats:
        running = min(len(self._requests), self.config.max_num_seqs)
        return EngineStats(
            running=running,
            waiting=len(self._requests) - running,
            steps=self._steps,
            aborts_received=self._aborts_received,
        )


def _read_config(path: Path) -> dict[str, Any]:
    """The model directory's ``config.json``. Raises ValueError without a usable one."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} has no readable config.json: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("vocab_size"), int):
        raise ValueError(f"{path}/config.json names no vocab_size")
    return config


def _eos_ids(path: Path, model_config: dict[str, Any]) -> frozenset[int]:
    """EOS ids named by config.json and generation_config.json."""
    sources = [model_config]
    generation = path / "generation_config.json"
    if generation.is_file():
        with contextlib.suppress(ValueError):
            sources.append(json.loads(generation.read_text()))
    ids: set[int] = set()
    for source in sources:
        eos = source.get("eos_token_id") if isinstance(source, dict) else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(e for e in eos if isinstance(e, int))
    return frozenset(ids)
