"""Session fixtures shared by every test package.

torch and transformers are imported inside the fixtures, so test packages that
never ask for a model (mux, protocol) do not pay for importing them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + byte-level BPE tokenizer, built once per session (~1 s)."""
    from tserve.gpu._models import TINY_MODEL_VERSION, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-model-v{TINY_MODEL_VERSION}"))


@pytest.fixture(scope="session")
def smollm2_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama in SmolLM2's layout (tied output head, 3:1 GQA), built once."""
    from tserve.gpu._models import TINY_MODEL_VERSION, build_tiny_model

    directory = tmp_path_factory.mktemp(f"smollm2-tiny-v{TINY_MODEL_VERSION}")
    return build_tiny_model(directory, smollm2_layout=True)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the tiny model, fp32 on CPU, shared by the session.

    Use it as the reference (``generate``, plain forward). Do NOT hand it to a
    ModelRunner, which takes over the model's attention: load a fresh copy
    with ``load_model(tiny_model_dir, ...)`` for that (tens of milliseconds).
    """
    import torch

    from tserve.gpu._models import load_model

    return load_model(tiny_model_dir, device="cpu", dtype=torch.float32)


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Collect, then keep the cyclic GC off for the test.

    Tests that compare fd counts need it: a client leaked by an earlier test
    can otherwise be finalized between two counts and close its sockets.
    """
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
