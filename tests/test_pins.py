"""The dependency ranges in pyproject.toml hold for what the tests run on.

A dependency that tserve uses through its internals (hypercorn's trio
worker, quart's response bodies, quart-trio's disconnect handling) has an
upper bound: these tests are what shows a version works, so the installed
version must lie inside every declared range, and each such library must
have its bound.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
THROUGH_INTERNALS = {"hypercorn", "quart", "quart-trio"}


def _requirements() -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["test"]]]


@pytest.mark.parametrize("requirement", _requirements(), ids=str)
def test_the_installed_version_is_in_range(requirement: Requirement) -> None:
    installed = importlib.metadata.version(requirement.name)
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{requirement.name} {installed} is outside {requirement}"
    )


def test_libraries_used_through_internals_have_an_upper_bound() -> None:
    bounded = {
        r.name.lower()
        for r in _requirements()
        if any(spec.operator in {"<", "<=", "=="} for spec in r.specifier)
    }
    assert bounded >= THROUGH_INTERNALS
