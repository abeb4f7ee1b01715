"""The engine's layout: packages in a declared layer order, no streamlit, small modules and functions.

Read from the source with ``ast`` (nothing is imported), so an upward import or a cycle hidden in
a function-local import counts as much as one at the top of a module, and so do the package
``__init__`` files that importing a module runs and the CLI's handler strings.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gap_engine"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# Figure builders spell out one Plotly figure each, trace by trace; they may run longer.
FIGURE_PACKAGE = "gap_engine.views.figures"
# The engine's packages from foundation to surface: a module may import its own package and the
# packages before it, never one after it. docs/layout.md lists the same order (checked below).
LAYERS = ("core", "data", "model", "prune", "evaluate", "tables", "plan", "recover", "export", "pipeline", "views", "api", "cli")
# Layers that are one module, not a package: the Python front door (gap_engine/api.py).
MODULE_LAYERS = ("api",)
# Top-level files beside the packages: the package marker and `python -m gap_engine`.
TOP_LEVEL_FILES = ("__init__.py", "__main__.py")


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


def _handler_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules named by the CLI's ``handler="module:function"`` strings (imported by name at run time)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "handler" and isinstance(node.value, ast.Constant):
            target = f"{PACKAGE.name}.cli.{str(node.value.value).split(':')[0]}"
            found.add(target if target in known else f"{target} (missing)")
    return found


def _choice_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules a registry's entries name as their code, ``"gap_engine.package.module:attribute"``
    (``core.registry``: imported by name on first use)."""
    found = set()
    target = re.compile(rf"({re.escape(PACKAGE.name)}(?:\.\w+)+):\w+")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (named := target.fullmatch(node.value)):
            found.add(named.group(1) if named.group(1) in known else f"{named.group(1)} (missing)")
    return found - {module}


def _graph(lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the gap_engine modules it imports; ``lazy`` adds those its registered choices
    name (a registry and the module that consults it may name each other: not a cycle)."""
    modules = _modules()
    known = set(modules)
    graph = {
        name: _imports(name, path, known) | _handler_modules(name, path, known) | (_choice_modules(name, path, known) if lazy else set())
        for name, path in modules.items()
    }
    # Importing a submodule runs its package's __init__ first; a package importing its own
    # submodules is how packages are built and is not a cycle edge back.
    for name in list(graph):
        graph[name] = {dep for dep in graph[name] if not name.startswith(dep + ".")}
    return graph


@pytest.mark.slow
def test_no_import_cycles_inside_the_engine():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
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


@pytest.mark.slow
def test_the_engine_never_imports_streamlit():
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "streamlit" for a in node.names):
                offenders.append(name)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "streamlit":
                offenders.append(name)
    assert not offenders, offenders
    # Nor any optional package (a pyproject extra) before a feature asks for it.
    code = (
        "import sys, gap_engine.pipeline, gap_engine.pipeline.jobs, gap_engine.cli; from gap_engine.cli.main import OPTIONAL_MODULES; "
        "print(sorted(name for name in ('streamlit', *OPTIONAL_MODULES) if name in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


def test_optional_packages_are_extras_of_their_own():
    """The core install leaves out what one feature imports on first use; the CLI names the extra
    that installs each (cli/main.py: OPTIONAL_MODULES), and that extra must install it."""
    import importlib.metadata
    import re

    import tomllib

    from gap_engine.cli.main import OPTIONAL_MODULES

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}

    installed = importlib.metadata.packages_distributions()
    for module, extra in OPTIONAL_MODULES.items():
        distributions = {d.lower().replace("_", "-") for d in installed[module]}
        assert distributions & names(project["optional-dependencies"][extra]), (module, extra)
        assert not distributions & names(project["dependencies"]), f"{module} is optional but in the core dependencies"


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_engine_raises_named_errors_instead_of_asserting():
    # `python -O` strips assert statements: an engine invariant checked by one would vanish there.
    asserts = [
        f"{name}:{node.lineno}"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert not asserts, asserts


@pytest.mark.slow
def test_no_private_name_crosses_a_module_boundary():
    crossings = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("gap_engine")):
                crossings += [
                    f"{name} imports {alias.name}" for alias in node.names if alias.name.startswith("_") and not alias.name.endswith("__")
                ]
    assert not crossings, crossings


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def _with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing ``a.b.c`` runs ``a.b``'s ``__init__`` first: each edge also reaches the packages above its target."""
    closed = {}
    for name, deps in graph.items():
        reached = set(deps)
        for dep in deps:
            parts = dep.split(".")
            reached |= {".".join(parts[:i]) for i in range(2, len(parts))}
        closed[name] = {dep for dep in reached if dep in graph and dep != name}
    return closed


def test_the_top_level_folder_is_the_layer_list():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    expected = [f"{layer}.py" if layer in MODULE_LAYERS else layer for layer in LAYERS]
    assert entries == sorted(expected + list(TOP_LEVEL_FILES))


@pytest.mark.slow
def test_imports_only_go_down_the_layers():
    graph = _with_package_inits(_graph(lazy=True))
    upward = []
    for name, deps in sorted(graph.items()):
        here = _layer(name)
        for dep in sorted(deps):
            if dep.endswith("(missing)"):
                upward.append(f"{name} names a handler or choice module that does not exist: {dep}")
                continue
            there = _layer(dep)
            if here is None and name != f"{PACKAGE.name}.__main__":
                upward.append(f"{name} (the package root) imports {dep}")
            elif here is not None and there is not None and there > here:
                upward.append(f"{name} ({LAYERS[here]}) imports {dep} ({LAYERS[there]})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
    # The check must be able to fail: a function-local import of a higher layer, planted on disk.
    package = tmp_path / "gap_engine"
    for layer in ("core", "tables"):
        (package / layer).mkdir(parents=True)
        (package / layer / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "tables" / "build.py").write_text("X = 1\n")
    (package / "core" / "hooks.py").write_text("def f():\n    from gap_engine.tables.build import X\n    return X\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    with pytest.raises(AssertionError, match=r"gap_engine.core.hooks \(core\) imports gap_engine.tables.build \(tables\)"):
        test_imports_only_go_down_the_layers()


def test_a_registered_choice_of_a_higher_layer_counts(tmp_path, monkeypatch):
    # A registry's entry names the module of its code, imported on first use: one above its layer is upward too.
    package = tmp_path / "gap_engine"
    for layer in ("core", "plan"):
        (package / layer).mkdir(parents=True)
        (package / layer / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "plan" / "dp.py").write_text("def solve():\n    return 1\n")
    (package / "core" / "choices.py").write_text('CHOICES = (Allocator("dp", "the DP", "gap_engine.plan.dp:solve", plan_passes=0),)\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    with pytest.raises(AssertionError, match=r"gap_engine.core.choices \(core\) imports gap_engine.plan.dp \(plan\)"):
        test_imports_only_go_down_the_layers()


def test_a_package_init_that_imports_a_higher_layer_counts(tmp_path, monkeypatch):
    # Importing core.a runs core/__init__; an __init__ that pulls in a higher layer is an upward edge too.
    package = tmp_path / "gap_engine"
    for layer in ("core", "plan"):
        (package / layer).mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plan" / "__init__.py").write_text("")
    (package / "plan" / "dp.py").write_text("Y = 2\n")
    (package / "core" / "__init__.py").write_text("from gap_engine.plan.dp import Y\n")
    (package / "core" / "a.py").write_text("Z = 3\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    with pytest.raises(AssertionError, match=r"gap_engine.core \(core\) imports gap_engine.plan.dp \(plan\)"):
        test_imports_only_go_down_the_layers()


def test_package_inits_only_re_export():
    # A package's __init__ holds a docstring and re-exports of its own modules, nothing that runs work,
    # so importing one module of a stage never drags in the rest of it (or another stage).
    offenders = []
    for name, path in _modules().items():
        if path.name != "__init__.py" or name == PACKAGE.name:
            continue
        for node in ast.parse(path.read_text()).body:
            is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            is_all = isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            own = (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith(name + ".")
                or (isinstance(node, ast.ImportFrom) and node.module == "__future__")
            )
            if not (is_doc or is_all or own):
                offenders.append(f"{name}: line {node.lineno}")
    assert not offenders, offenders


def test_the_layout_doc_lists_the_layers_in_order():
    section = (PACKAGE.parent / "docs" / "layout.md").read_text()
    listed = [
        line.split()[0].rstrip("/").removesuffix(".py")
        for line in section.splitlines()
        if line.startswith("  ") and not line.startswith("   ") and line.split()[0].endswith(("/", ".py"))
    ]
    assert tuple(listed) == LAYERS, listed


def test_files_found_beside_the_source_are_where_they_were(monkeypatch):
    # Modules that locate files from their own path (the cache root, the remote modeling code)
    # must still find them after a move between packages.
    from gap_engine.core import fsutil
    from gap_engine.model import remote_code

    monkeypatch.delenv(fsutil.CACHE_ENV, raising=False)
    assert fsutil.cache_root() == PACKAGE.parent / "cache"
    assert remote_code.MODELING_SOURCE.is_file()


# Folders of tests/ beside the engine's layers: the explorer's pages (AppTest) and the real browser.
APP_TEST_FOLDERS = ("explorer", "browser")
# The benchmarks' results and the commands that write them (bench/).
BENCH_TEST_FOLDERS = ("bench",)


def test_tests_mirror_the_packages():
    # A change to gap_engine/plan/ has its tests in tests/plan/; only shared helpers, this
    # whole-package check and the check of the suite's own workers (conftest.py) sit at the top of tests/.
    tests = PACKAGE.parent / "tests"
    folders = sorted(p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    assert set(folders) <= set(LAYERS + APP_TEST_FOLDERS + BENCH_TEST_FOLDERS), folders
    top_level_tests = sorted(p.name for p in tests.glob("test_*.py"))
    assert top_level_tests == ["test_layout.py", "test_workers.py"], top_level_tests
    # Test module names stay unique: the folders are not packages, so two equal names would collide.
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_time_budget_names_tests_that_exist():
    """tests/budgets.toml (read by conftest's summary of the slowest tests) must not keep budgets of
    tests that moved or went: each key is a test folder, a test file or file::test function."""
    import tomllib
    from conftest import time_budget

    root = PACKAGE.parent
    table = tomllib.loads((root / "tests" / "budgets.toml").read_text())
    for key in table["budgets"]:
        path, _, test = key.partition("::")
        assert (root / path).exists(), key
        if test:
            names = {node.name for node in ast.walk(ast.parse((root / path).read_text())) if isinstance(node, ast.FunctionDef)}
            assert test.split("[")[0] in names, key
    assert time_budget("tests/browser/test_browser_jobs.py::test_x", table) == table["budgets"]["tests/browser/test_browser_jobs.py"]
    assert time_budget("tests/plan/test_allocators.py::test_x", table) == table["default"]
