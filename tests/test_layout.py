"""The engine's layout: dependencies flow one way, no streamlit, small modules and functions.

Read from the source with ``ast`` (nothing is imported), so a cycle hidden in a function-
local import counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gap_engine"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# Figure builders spell out one Plotly figure each, trace by trace; they may run longer.
FIGURE_PACKAGE = "gap_engine.figures"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """gap_engine modules that ``module`` imports anywhere in its source (``from . import x`` included)."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node, is_package)
            names = [target] + [f"{target}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            # The deepest gap_engine module the name refers to.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # Importing a submodule runs its package's __init__ first; a package importing its own
    # submodules is how packages are built and is not a cycle edge back.
    for name in list(graph):
        graph[name] = {dep for dep in graph[name] if not name.startswith(dep + ".")}
    return graph


def test_no_import_cycles_inside_the_engine():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    # The check itself must be able to fail: a two-module cycle written to disk is found.
    package = tmp_path / "gap_engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text("from .a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    with pytest.raises(AssertionError, match="gap_engine.a -> gap_engine.b -> gap_engine.a|gap_engine.b -> gap_engine.a -> gap_engine.b"):
        test_no_import_cycles_inside_the_engine()


def test_the_engine_never_imports_streamlit():
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "streamlit" for a in node.names):
                offenders.append(name)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "streamlit":
                offenders.append(name)
    assert not offenders, offenders
    code = "import sys, gap_engine.pipeline, gap_engine.jobs, gap_engine.cli; print('streamlit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_modules_and_functions_stay_small():
    too_long = []
    for name, path in _modules().items():
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not name.startswith(FIGURE_PACKAGE):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert not too_long, too_long


def test_no_private_name_crosses_a_module_boundary():
    crossings = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("gap_engine")):
                crossings += [
                    f"{name} imports {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.endswith("__")
                ]
    assert not crossings, crossings
