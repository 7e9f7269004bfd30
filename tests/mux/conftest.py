"""Fixtures for the mux tests: a private ipc address, both anyio backends."""

from __future__ import annotations

import resource
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def ipc_address() -> Iterator[str]:
    """``ipc://`` in a fresh 0700 directory (short: unix paths max ~107 bytes)."""
    directory = tempfile.mkdtemp(prefix="tserve-mux-", dir="/tmp")
    try:
        yield f"ipc://{directory}/engine.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _raise_nofile_limit() -> None:
    """As the API process does at start: soft RLIMIT_NOFILE up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
