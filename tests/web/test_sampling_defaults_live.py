"""The model's recommended sampling values over HTTP: a real server on the tiny
model, whose generation_config.json the test writes, and the official SDK.

Every comparison is between seeded requests: a seeded request's tokens depend
only on its prompt, its sampling values and its seed, so two requests agree
exactly when the engine sampled them with the same values.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.web.conftest import Server

pytestmark = pytest.mark.slow

SEEDS = (1, 2, 3, 4)
MODEL_DEFAULTS = {"temperature": 0.5, "top_k": 3}  # as _texts(server, 0.5, 3) asks


@pytest.fixture(scope="module")
def servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """The tiny model with MODEL_DEFAULTS in its generation_config.json, served
    twice: as configured (``auto``) and with ``--generation-config none``."""
    root = tmp_path_factory.mktemp("sampling-defaults")
    model = root / "tiny"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **MODEL_DEFAULTS}))
    name = ("--served-model-name", "tiny")
    on = Server(model, *name, "--log-level", "info", log=root / "auto.log")
    try:
        off = Server(model, *name, "--generation-config", "none", log=root / "none.log")
    except BaseException:
        on.stop()
        raise
    yield on, off
    assert on.stop() == 0 and off.stop() == 0


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def _texts(server: Server, temperature: float | None = None, top_k: int | None = None) -> list[str]:
    """One completion per seed; None leaves the field out of the request."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if top_k is not None:
        extra["top_k"] = top_k
    texts = []
    for seed in SEEDS:
        completion = _client(server).completions.create(
            model="tiny",
            prompt="The capital of France is",
            max_tokens=24,
            seed=seed,
            extra_body=extra,
            temperature=openai.omit if temperature is None else temperature,
        )
        texts.append(completion.choices[0].text)
    return texts


def test_an_unset_temperature_and_top_k_take_the_models_values(
    servers: tuple[Server, Server],
) -> None:
    on, off = servers
    unset = _texts(on)
    assert unset == _texts(on, 0.5, 3) == _texts(off, 0.5, 3)
    # Not vacuous: OpenAI's defaults give other tokens for every seed.
    openai_defaults = _texts(off)
    assert all(a != b for a, b in zip(unset, openai_defaults, strict=True))
    assert "sampling defaults: temperature 0.5, top_k 3 (from " in on.log.read_text()


def test_a_requests_own_values_win_and_none_restores_openais_defaults(
    servers: tuple[Server, Server],
) -> None:
    on, off = servers
    # top_k -1 (vLLM's "off") is a value of the request's own, as 0 is.
    assert _texts(on, temperature=1.0, top_k=-1) == _texts(off) == _texts(off, 1.0, 0)
    # One field of the request's own, the other from the model.
    assert _texts(on, temperature=0.9) == _texts(off, temperature=0.9, top_k=3)


def test_chat_completions_take_them_too(servers: tuple[Server, Server]) -> None:
    on, off = servers
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]

    def reply(server: Server, temperature: float | None = None, top_k: int | None = None) -> str:
        chat = _client(server).chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=24,
            seed=7,
            extra_body={} if top_k is None else {"top_k": top_k},
            temperature=openai.omit if temperature is None else temperature,
        )
        return str(chat.choices[0].message.content)

    assert reply(on) == reply(off, temperature=0.5, top_k=3)
    assert reply(on) != reply(off)
