"""``--models-dir DIR``: the models a folder holds, found again at each listing.

A model of the folder is a ``.gguf`` file (named by its file name without
``.gguf``) or a directory holding a ``config.json`` (named by the
directory's name); hidden entries and anything else are skipped. A name
that another served model already has (a MODEL on the command line) keeps
that model. :meth:`ModelsDir.rescan` adds the models new in the folder and
removes those gone from it whose model has no engine, no load and no
request (a loaded one stays served until it is unloaded).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from tserve.engine_config import EngineConfig
from tserve.nursery._registry import ModelRegistry, ModelSpec

__all__ = ["ModelsDir", "scan"]

log = logging.getLogger("tserve")


def scan(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The models in ``directory`` by name, sorted. Raises OSError if it cannot be listed."""
    found: dict[str, Path] = {}
    for entry in sorted(Path(directory).iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.suffix == ".gguf" and entry.is_file():
            found[entry.stem] = entry
        elif entry.is_dir() and (entry / "config.json").is_file():
            found[entry.name] = entry
    return found


class ModelsDir:
    """One ``--models-dir``: which served names came from it, and its engine options."""

    def __init__(self, directory: str, template: EngineConfig) -> None:
        self.directory = directory
        self._template = template  # every engine option; ``model`` is replaced per file
        self._names: set[str] = set()  # the served names this folder added

    def specs(self, taken: set[str]) -> list[ModelSpec]:
        """The folder's models as specs, but for ``taken`` names. Raises OSError."""
        return [
            self._spec(name, path)
            for name, path in scan(self.directory).items()
            if name not in taken
        ]

    def _spec(self, name: str, path: Path) -> ModelSpec:
        self._names.add(name)
        return ModelSpec(name, msgspec.structs.replace(self._template, model=str(path)))

    def rescan(self, registry: ModelRegistry) -> None:
        """Add the folder's new models to ``registry``, remove those gone that can be.
        Synchronous (lists one folder); a folder that cannot be listed changes nothing."""
        try:
            found = scan(self.directory)
        except OSError as exc:
            log.warning("--models-dir %s: %s", self.directory, exc)
            return
        served = set(registry.names)
        for name, path in found.items():
            if name not in served:
                registry.add(self._spec(name, path))
        for name in sorted(self._names - found.keys()):
            if name in served and registry.remove(name):
                self._names.discard(name)
