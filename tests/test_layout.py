"""The package's shape: folders in data-flow order, imports only downward, small modules.

These checks read the source (ast), so they keep the layout the README describes from
drifting as code is added.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autopipe"

# Bottom to top: a folder may import from the ones before it, never after it.
LAYERS = ["machine", "planning", "layouts", "reporting", "runtime", "models", "cli"]
# Private helpers and the package's own top-level modules that every layer may use.
BASE = {"_checks", "_progress", "_spawn", "errors"}
# The deliberate exceptions: a convenience method that reaches up lazily, inside a function.
LAZY_UPWARD = {("planning/plan.py", "reporting")}

MAX_LINES = 650


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: Path) -> list[tuple[ast.ImportFrom, bool]]:
    """Every relative ``from ... import`` in ``path``, with whether it sits inside a function."""
    tree = ast.parse(path.read_text())
    found: list[tuple[ast.ImportFrom, bool]] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.level:
                found.append((child, in_function))
            walk(child, inner)

    walk(tree, False)
    return found


def _target(path: Path, node: ast.ImportFrom) -> list[str]:
    """The imported module as parts below ``autopipe``, e.g. ``["planning", "trace"]``."""
    here = list(path.relative_to(PACKAGE).parent.parts)
    base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
    return base + (node.module.split(".") if node.module else [])


def _layer(parts: list[str]) -> str | None:
    return parts[0] if parts and parts[0] in LAYERS else None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_go_down(path: Path) -> None:
    rel = str(path.relative_to(PACKAGE))
    own = _layer(list(path.relative_to(PACKAGE).parts))
    if own is None:
        return  # the package's __init__/__main__ and base modules sit on top and bottom
    for node, in_function in _imports(path):
        target = _layer(_target(path, node))
        if target is None or target == own:
            continue
        if LAYERS.index(target) > LAYERS.index(own):
            assert in_function and (rel, target) in LAZY_UPWARD, (
                f"{rel}:{node.lineno} imports from {target}/, which sits above {own}/ in the layout")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_another_modules_private_names(path: Path) -> None:
    for node, _ in _imports(path):
        module = (node.module or "").split(".")[-1]
        if module.startswith("_"):
            continue  # a private module exists to be imported by its package
        private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
        assert not private, f"{path.relative_to(PACKAGE)}:{node.lineno} imports private {private} from {node.module}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path: Path) -> None:
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {n} lines; split it by concern (at most {MAX_LINES})"


def test_base_modules_import_no_layer() -> None:
    for name in BASE:
        path = PACKAGE / f"{name}.py"
        for node, _ in _imports(path):
            assert _layer(_target(path, node)) is None, f"{name}.py imports {node.module}: base modules stay at the bottom"


def _package_imports(path: Path) -> list[str]:
    """The package modules ``path`` imports (module- or function-level, type-only too), dotted below ``autopipe``.

    ``from .x import y`` counts as importing module ``x.y`` where that is a module, else ``x``.
    """
    tree = ast.parse(path.read_text())
    here = list(path.relative_to(PACKAGE).parent.parts)
    found: list[str] = []

    def add(parts: list[str]) -> None:
        for cut in range(len(parts), 0, -1):
            base = PACKAGE.joinpath(*parts[:cut])
            if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
                found.append(".".join(parts[:cut]))
                return

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and child.level:
                base = here[: len(here) - (child.level - 1)] if child.level > 1 else here
                module = base + (child.module.split(".") if child.module else [])
                for alias in child.names:
                    add(module + [alias.name])
            walk(child)

    walk(tree)
    return found


def test_no_import_circles() -> None:
    # A module's name below autopipe: "planning.plan"; a package's is its folder's ("planning").
    def name(path: Path) -> str:
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    import networkx as nx

    graph = nx.DiGraph()
    for path in _modules():
        for target in _package_imports(path):
            if target != name(path) and not name(path).startswith(target + ".") and target:
                graph.add_edge(name(path), target)  # a package's own __init__ is not a circle with its modules
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not circles, f"import circles (module-level, function-level or type-only imports): {circles}"


def test_docstrings_are_at_most_a_quarter_of_the_package() -> None:
    # Public names carry Args/Returns/Example; internal ones a summary line (and their doctests).
    total = docstring = 0
    for path in _modules():
        source = path.read_text()
        total += len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and ast.get_docstring(node) is not None:
                docstring += node.body[0].end_lineno - node.body[0].lineno + 1
    assert docstring <= 0.25 * total, f"docstrings are {docstring / total:.0%} of the package's lines"
