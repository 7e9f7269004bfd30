"""The embedding engine's step loop: :class:`EmbedCore`, in process and without sockets.

It is a :class:`~tserve.gpu.engine._core.Core` like :class:`EngineCore`, so an
embedding engine is the same process, socket and wire as a generation engine
with another core inside; the bookkeeping they share is in ``_core.py``.

Rules:

* An embedding request is an ordinary ``AddRequest`` (its prompt token ids
  are the input, as the tokenizer made them, special tokens included; its
  sampling parameters are ignored). It is answered by exactly ONE
  ``RequestOutput``: ``FinishReason.STOP``, no token ids, and ``embedding``
  set to the unit-norm vector as little-endian float32; or
  ``FinishReason.ERROR`` (empty, out of the vocabulary, longer than
  ``max_model_len``: the engine never truncates), or ``FinishReason.ABORT``
  (aborted or past its deadline while it waited).
* A step takes waiting requests first come, first served: at most
  ``max_num_seqs`` inputs, and at most ``max_num_batched_tokens`` tokens once
  padded to the longest of them (the first always goes, whatever its
  length). It pads them into ONE forward pass of the encoder, mean-pools the
  last hidden states over the attention mask, and L2-normalises.
* Requests never outlive the step that takes them, so an abort only ever
  finds a request still waiting. Only an exception out of the forward pass
  (the batch as a whole) escapes ``step()``: the process treats it as fatal.

The test-only faults of ``_core.py`` apply here too. Its progress (what the
engine's pulse thread reads during a step, ``_pulse.py``) counts each encoder
layer a forward pass finishes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tserve.gpu.engine._core import PeerKeyedBookkeeping, PeerOutput
from tserve.gpu.forward._gemm import tune_linears
from tserve.gpu.forward._runner import resolve_device
from tserve.gpu.models._directory import (
    DEFAULT_EMBEDDING_MODEL_NAME,
    ProgressCallback,
    default_embedding_model_dir,
    load_encoder,
)
from tserve.protocol import (
    AddRequest,
    EngineConfig,
    EngineStats,
    FinishReason,
    RequestOutput,
)
from tserve.validity import embedding_problem

__all__ = ["EmbedCore", "mean_pool"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Waiting:
    request_id: str
    peer: bytes
    token_ids: list[int]
    deadline: float | None


class EmbedCore(PeerKeyedBookkeeping[_Waiting]):
    """Batched embedding over one encoder. Not thread-safe; one owner calls it."""

    task = "embed"
    device: torch.device

    def __init__(self, config: EngineConfig, progress: ProgressCallback = print) -> None:
        super().__init__()
        torch.set_num_threads(max(1, config.threads))
        device, _ = resolve_device(config)
        # Embeddings are compared by cosine across requests and servers: fp32
        # unless told otherwise, on every device (the encoders are small).
        dtype = torch.float32 if config.dtype == "auto" else resolve_device(config)[1]
        if config.model == "default":
            path = default_embedding_model_dir()
            self.model_name = DEFAULT_EMBEDDING_MODEL_NAME
        else:
            path = Path(config.model).expanduser()
            self.model_name = path.name
        progress(f"loading the encoder {path} on {device} ({dtype})")
        self.model = load_encoder(path, device=device, dtype=dtype)
        tune_linears(self.model, config.cpu_gemm)  # on CPU: the library measured fastest
        self._layers_done = 0  # encoder layers finished by forward passes: progress()
        for stack in self.model.modules():
            if isinstance(stack, torch.nn.ModuleList):
                for layer in stack:
                    layer.register_forward_hook(self._layer_done)
        self.model_path = path.resolve()
        model_config = self.model.config
        self.vocab_size = int(model_config.vocab_size)
        self.embedding_dim = int(model_config.hidden_size)
        self.pad_token_id = int(getattr(model_config, "pad_token_id", None) or 0)
        self.max_model_len = _max_length(path, model_config, config.max_model_len)
        self.device = device
        self.config = config
        _check_pooling(path)
        progress(
            f"embedding engine ready: {self.model_name}, {self.embedding_dim} dimensions, "
            f"inputs up to {self.max_model_len} tokens"
        )

    def progress(self) -> int:
        """Steps begun and encoder layers finished (read by the pulse thread)."""
        return super().progress() + self._layers_done

    def _layer_done(self, *_: object) -> None:
        self._layers_done += 1

    # -- requests in ---------------------------------------------------------------

    def add(self, request: AddRequest, peer: bytes) -> None:
        """Queue an input; one that can never be embedded is answered with an error.

        An id already waiting for the SAME peer is dropped (see ``_core.py``).
        """
        if self._is_duplicate(request.request_id, peer):
            return
        problem = self._check(request.prompt_token_ids)
        if problem is not None:
            self._reject(peer, request.request_id, problem)
            return
        ids = list(request.prompt_token_ids)
        key = (peer, request.request_id)
        self._requests[key] = _Waiting(request.request_id, peer, ids, request.deadline)

    # -- the step ----------------------------------------------------------------

    def step(self, now: float | None = None) -> list[PeerOutput]:
        """Embed one batch of waiting inputs; return (peer, output) pairs.

        ``now`` (default ``time.time()``) is what deadlines are checked
        against. Blocks for one forward pass. Raises only for a failure of
        the whole batch (the forward pass, the device), which is fatal.
        """
        now = time.time() if now is None else now
        self._expire(now)  # 1 end expired requests
        batch = self._schedule()  # 2 take a batch, FCFS
        outputs = self._take_pending()
        if batch:
            vectors = self._forward([w.token_ids for w in batch])  # 3 ONE forward pass
            outputs += [  # 4 one final output per request
                (w.peer, RequestOutput(w.request_id, [], FinishReason.STOP, embedding=vector))
                for w, vector in zip(batch, vectors, strict=True)
            ]
        return outputs

    def _schedule(self) -> list[_Waiting]:
        """The longest FCFS prefix of the waiting inputs that fits one forward pass."""
        batch: list[_Waiting] = []
        width = 0
        for w in self._requests.values():
            wider = max(width, len(w.token_ids))
            if batch and (
                len(batch) >= self.config.max_num_seqs
                or wider * (len(batch) + 1) > self.config.max_num_batched_tokens
            ):
                break
            batch.append(w)
            width = wider
        for w in batch:
            del self._requests[(w.peer, w.request_id)]
        return batch

    def _forward(self, inputs: list[list[int]]) -> list[bytes]:
        """Unit-norm vectors of ``inputs`` (one padded forward pass), as float32 LE bytes."""
        self._count_step()
        width = max(len(ids) for ids in inputs)
        ids = torch.full((len(inputs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            vectors = mean_pool(hidden, mask)
        rows = vectors.cpu().numpy().astype("<f4", copy=False)
        return [row.tobytes() for row in rows]

    def stats(self) -> EngineStats:
        return EngineStats(
            waiting=len(self._requests), steps=self._steps, aborts_received=self._aborts_received
        )

    # -- internals -------------------------------------------------------------------

    def _check(self, ids: list[int]) -> str | None:
        """Why this input cannot be embedded, or None (the API process checks first)."""
        problem = embedding_problem(ids, vocab_size=self.vocab_size, max_len=self.max_model_len)
        return None if problem is None else problem.message


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """L2-normalised mean of ``hidden`` (batch, tokens, dim) over ``mask`` (batch, tokens), fp32."""
    weights = mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * weights).sum(dim=1)
    pooled = summed / weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


def _max_length(path: Path, model_config: Any, requested: int | None) -> int:
    """The longest input: ``requested``, else the sentence-transformers setting
    (``max_seq_length``), else the position table; never past the position table."""
    positions = int(getattr(model_config, "max_position_embeddings", 0) or 512)
    own = positions
    settings = path / "sentence_bert_config.json"
    if settings.is_file():
        try:
            own = int(json.loads(settings.read_text())["max_seq_length"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s: %s", settings, exc)
    return max(1, min(requested or own, positions))


def _check_pooling(path: Path) -> None:
    """Warn when the directory's sentence-transformers pooling is not mean pooling."""
    pooling = path / "1_Pooling" / "config.json"
    if not pooling.is_file():
        return
    try:
        mean = bool(json.loads(pooling.read_text()).get("pooling_mode_mean_tokens", True))
    except (ValueError, AttributeError) as exc:
        log.warning("ignoring %s: %s", pooling, exc)
        return
    if not mean:
        log.warning("%s asks for another pooling than mean; tserve uses mean pooling", pooling)
