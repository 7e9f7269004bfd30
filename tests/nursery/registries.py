"""What the model registry's tests share: a registry of real engines."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

from tests.guards import HANG_GUARD
from tserve.nursery import ClientSettings
from tserve.nursery._open import EngineOwner
from tserve.nursery._open_registry import open_registry
from tserve.nursery._registry import ModelRegistry, ModelSpec


def engine_registry(
    specs: Iterable[ModelSpec], **rules: Any
) -> AbstractAsyncContextManager[ModelRegistry]:
    """A registry of ``specs`` whose loads wait up to the hang guard; ``rules``
    are :func:`open_registry`'s (keep-alive, budget, ...)."""
    owner = EngineOwner(ClientSettings(startup_timeout=HANG_GUARD), log_level="WARNING")
    return open_registry(owner, specs, **rules)
