"""An in-process generation engine on the tiny model, small enough for unit tests,
and a request run through it alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tserve.gpu.engine._engine_core import EngineCore
from tserve.protocol import AddRequest, EngineConfig


def small_core(model_dir: Path, **config: Any) -> EngineCore:
    """An :class:`EngineCore` on CPU/fp32 (its KV cache fp32 too, so that it
    matches transformers' fp32 ``generate``) with a small batch and KV budget;
    ``config`` overrides any :class:`EngineConfig` field. Blocks while it loads."""
    settings: dict[str, Any] = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_dtype": "fp32",
        "max_num_seqs": 16,
        "max_num_batched_tokens": 64,
        "kv_cache_tokens": 8192,
        "block_size": 16,
    }
    settings.update(config)
    return EngineCore(EngineConfig(**settings), progress=lambda _: None)


def generated(core: EngineCore, request: AddRequest) -> list[int]:
    """The token ids ``core`` generates for ``request``, stepped until it has no
    work left (so nothing else should be running). Blocks."""
    core.add(request, b"p")
    tokens: list[int] = []
    while core.has_work:
        for _, out in core.step():
            tokens += out.token_ids
    return tokens
