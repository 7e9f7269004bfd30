"""Fixtures for the fault-isolation tests: trio unless a test asks for asyncio."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "trio"
