"""The API process never loads torch or transformers: only the engines do.

Checked two ways: in live API processes (``--api-processes 2`` with an
embedding model, after a chat and an embedding request), by the shared
objects mapped into them (torch is native code: a process that imported it
maps libtorch; transformers always brings safetensors' and regex's
extensions); and in a fresh interpreter that imports the API's packages,
loads the model's tokenizer as the API process does and renders a chat, by
``sys.modules``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.processes import child_pids, command_line
from tests.web.conftest import Server
from tserve.gpu.models._directory import default_embedding_model_dir

pytestmark = pytest.mark.slow

# Paths that only an import of torch or transformers maps into a process.
ENGINE_ONLY = ("/torch/", "/transformers/", "/safetensors/", "/regex/")


def mapped_files(pid: int) -> set[str]:
    """The files mapped into process ``pid``."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6}


def children(server: Server) -> dict[int, bool]:
    """The server's child processes: pid -> whether it is an engine (``-m tserve.gpu``);
    the others are API workers."""
    found = {}
    for child in child_pids(server.process.pid):
        cmdline = command_line(child)
        if cmdline is not None:
            found[child] = b"-m\0tserve.gpu\0" in cmdline
    return found


def test_no_api_process_maps_torch_or_transformers(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--api-processes", "2", "--embedding-model", "default")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert server.client.post("/v1/chat/completions", json=chat).status_code == 200
    embed = {"model": "all-MiniLM-L6-v2", "input": "hi"}
    assert server.client.post("/v1/embeddings", json=embed).status_code == 200

    kids = children(server)
    pids = [server.process.pid, *(pid for pid, engine in kids.items() if not engine)]
    assert len(pids) == 2, kids
    for pid in pids:
        loaded = [f for f in mapped_files(pid) if any(part in f for part in ENGINE_ONLY)]
        assert loaded == [], (pid, loaded)
    engines = [pid for pid, engine in kids.items() if engine]
    assert len(engines) == 2, kids  # generation and embedding
    for pid in engines:  # the probe does see torch where it is
        assert any("/torch/" in f for f in mapped_files(pid))


def test_the_api_packages_tokenize_and_chat_without_torch(tiny_model_dir: Path) -> None:
    script = f"""
import sys
import tserve, tserve.web, tserve.nursery
from tserve.nursery._model_tokenizer import load_encoder_pipeline, load_model_tokenizer
tokenizer = load_model_tokenizer({str(tiny_model_dir)!r})
ids = tokenizer.encode_chat([{{"role": "user", "content": "hi"}}])
tokenizer.decode(ids)
load_encoder_pipeline({str(default_embedding_model_dir())!r}).encode("hi")
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
