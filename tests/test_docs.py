"""README.md and docs/*.md say what tserve does: their code runs, their links resolve.

The convention: a fenced block tagged ``python test`` or ``bash test`` is
run, each in a fresh temporary directory, against one real server of the
tiny test model (with the embedding model when it is installed), with
``OPENAI_BASE_URL`` (ending in ``/v1``), ``OPENAI_API_KEY``, ``TSERVE_URL``
and ``TSERVE_MODEL`` (the served model name) in the environment and this
interpreter's ``python`` first on ``PATH``. A plain ``python`` block is only
compiled; other blocks are not checked. Every relative link points at a file
that exists, and an anchor to a heading of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.markers import needs_embedding_model
from tests.web.conftest import Server

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODEL = "tiny"
BLOCK_TIMEOUT = 120  # s per block: a hang guard
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    tag: str  # the fence's info string: "python test", "bash", ...
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Block(page, line, match.group(1).strip(), match.group(2)))
    return found


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if b.tag in ("python test", "bash test")]
COMPILE = [b for b in BLOCKS if b.tag.split()[:1] == ["python"]]


def test_every_page_is_found_and_some_blocks_run() -> None:
    assert {p.name for p in PAGES} >= {"README.md", "architecture.md", "embedding.md"}
    assert {b.page.name for b in RUN} >= {"README.md", "http-api.md"}


@pytest.mark.parametrize("block", COMPILE, ids=lambda b: b.id)
def test_python_blocks_compile(block: Block) -> None:
    compile(block.code, block.id, "exec")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings (lower case, punctuation
    dropped, spaces as hyphens)."""
    headings = re.findall(r"^#+ (.+)$", _FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings(page: Path) -> None:
    text = _FENCE.sub("", page.read_text())  # links inside code blocks are code
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # another site
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert broken == []


@pytest.fixture(scope="module")
def docs_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The one server every block runs against."""
    log = tmp_path_factory.mktemp("docs-server") / "server.log"
    server = Server(
        tiny_model_dir, "--served-model-name", MODEL, "--embedding-model", "default", log=log
    )
    yield server
    assert server.stop() == 0, server.log.read_text()[-3000:]


@needs_embedding_model
@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_blocks_run(block: Block, docs_server: Server, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "OPENAI_BASE_URL": f"{docs_server.url}/v1",
        "OPENAI_API_KEY": "unused",
        "TSERVE_URL": docs_server.url,
        "TSERVE_MODEL": MODEL,
        "TSERVE_EMBEDDING_MODEL": "none",  # a command of a block starts no encoder
    }
    if block.tag == "python test":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
    )
    assert done.returncode == 0, f"{block.id}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
