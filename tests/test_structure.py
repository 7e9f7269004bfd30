"""The shape of the source tree: import cycles and the layering.

Module size is not checked: a module is split where it holds two jobs, not
at a line count.

Read from the source with ``ast``, so imports inside functions and under
``TYPE_CHECKING`` count as much as those at the top of a module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tserve"

# Which packages each package may import (besides the standard library,
# third-party code, and its own modules). STYLE.md: web → nursery → mux →
# protocol ← gpu; the leaves (protocol, engine_config, sampling, validity,
# grammar, _grammar_worker, _host, _model_json, _errors) import no package but
# each other, and _curve only the root of the error types.
_UNDER_THE_MUX = {"protocol", "sampling", "validity", "_host", "_curve", "_errors"}
"""What the mux may import; the packages above it (nursery, web) may import it too."""
LAYERS: dict[str, set[str]] = {
    "web": {"nursery", "mux", "grammar", *_UNDER_THE_MUX},
    "nursery": {"mux", "grammar", "_grammar_worker", "_model_json", "_gc", *_UNDER_THE_MUX},
    "mux": _UNDER_THE_MUX,
    "gpu": {"protocol", "sampling", "validity", "grammar", "_host", "_model_json", "_curve", "_gc"},
    "bench": {"_host"},
    "protocol": {"engine_config", "sampling"},
    "engine_config": set(),
    "sampling": set(),
    "validity": {"sampling"},
    "grammar": {"sampling", "validity"},
    "_grammar_worker": {"grammar", "sampling", "validity", "_host"},
    "_host": set(),
    "_model_json": set(),
    "_curve": {"_errors"},
    "_errors": set(),
    "_gc": set(),
}


def _modules() -> Iterator[Path]:
    yield from sorted(ROOT.rglob("*.py"))


def _name(path: Path) -> str:
    """``tserve.nursery._llm`` for tserve/nursery/_llm.py; a package for its __init__."""
    parts = ("tserve", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The ``tserve`` modules ``path`` imports, wherever the import statement is.

    ``from a.b import c`` imports module ``a.b.c`` when there is one, else
    the name ``c`` from module ``a.b``.
    """
    found: set[str] = set()
    package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return found & modules


def _graph() -> dict[str, set[str]]:
    paths = {_name(p): p for p in _modules()}
    return {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle_inside_a_package() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    for package in {_package(m) for m in graph}:
        inside = {m: {t for t in ts if _package(t) == package} for m, ts in graph.items()}
        inside = {m: ts for m, ts in inside.items() if _package(m) == package}
        cycles += _cycles(inside)
    assert cycles == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_run_one_way(package: str) -> None:
    graph = _graph()
    allowed = LAYERS[package] | {package}
    wrong = {
        (module, target)
        for module, targets in graph.items()
        if _package(module) == package
        for target in targets
        if _package(target) not in allowed and _package(target) != ""
    }
    assert wrong == set()


def _documented_modules() -> set[str]:
    """The module paths in docs/architecture.md's table (``| `web/_app.py` | ...``)."""
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = page[page.index("## Modules") :]
    return {
        line.split("`")[1]
        for line in section.splitlines()
        if line.startswith("| `") and line.split("`")[1].endswith(".py")
    }


def test_the_architecture_page_names_every_module() -> None:
    files = {str(p.relative_to(ROOT)) for p in _modules() if p.name != "__init__.py"}
    assert _documented_modules() == files


@pytest.mark.parametrize(
    "package", sorted(p.parent for p in ROOT.rglob("__init__.py")), ids=lambda p: p.name
)
def test_each_package_docstring_names_its_modules(package: Path) -> None:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    names = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert {name for name in names if name not in doc} == set()


GPU_LAYERS: list[str] = ["kernels", "models", "gguf", "scheduling", "sampling", "forward", "engine"]
"""``tserve/gpu``'s sub-packages, each importing only itself and those before it."""


def test_the_engine_packages_import_one_way() -> None:
    graph = _graph()

    def layer(module: str) -> int | None:
        parts = module.split(".")
        if parts[:2] != ["tserve", "gpu"] or len(parts) < 4:
            return None  # outside tserve.gpu, or its top level (__main__)
        return GPU_LAYERS.index(parts[2])

    wrong = {
        (module, target)
        for module, targets in graph.items()
        if (own := layer(module)) is not None
        for target in targets
        if (other := layer(target)) is not None and other > own
    }
    assert wrong == set()


def test_every_engine_package_has_its_layer() -> None:
    gpu = ROOT / "gpu"
    assert sorted(p.name for p in gpu.iterdir() if (p / "__init__.py").exists()) == sorted(
        GPU_LAYERS
    )
