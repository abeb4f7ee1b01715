"""Deprecated names carry the release that removes them (core.deprecation): once the package's
version reaches it, this test fails until the shim is deleted, so no shim outlives its promise."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gap_engine
from gap_engine.core.deprecation import REMOVED_IN

pytestmark = pytest.mark.slow  # reads every engine module twice: make test runs it, make test-fast does not

PACKAGE = Path(gap_engine.__file__).resolve().parent
SHIM_CALLS = ("warn_deprecated",)  # an old file field; an old flag is a DeprecatedAlias action


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3])


def _shims() -> list[tuple[str, str]]:
    """(where, removal release) of every deprecated name the engine still accepts: each
    ``warn_deprecated`` call and each ``DeprecatedAlias`` flag, read from the
    source (an explicit ``removed_in=`` wins over the module's ``REMOVED_IN``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "deprecation.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, "id", getattr(node.func, "attr", ""))
            alias = any(k.arg == "action" and getattr(k.value, "id", "") == "DeprecatedAlias" for k in node.keywords)
            if called in SHIM_CALLS or alias:
                given = next((k.value for k in node.keywords if k.arg == "removed_in"), None)
                release = given.value if isinstance(given, ast.Constant) else REMOVED_IN
                name = node.args[0].value if alias and node.args and isinstance(node.args[0], ast.Constant) else called
                found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno} ({name})", release))
    return found


def _overdue(version: str) -> list[str]:
    return [f"{where} was to be removed in {release}" for where, release in _shims() if _release(version) >= _release(release)]


def test_no_deprecated_name_outlives_its_removal_release():
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    assert project["version"] == gap_engine.__version__  # one version, whichever file a release bumps
    assert not _overdue(gap_engine.__version__), "delete these shims (and their tests and docs):\n" + "\n".join(
        _overdue(gap_engine.__version__)
    )


def test_the_check_finds_every_shim_once_the_version_reaches_its_release():
    """It can fail: at the removal release every shim of today is reported (the three old flags
    and the two old "method" fields)."""
    overdue = _overdue(REMOVED_IN)
    assert {"(--approx)", "(--method)", "(--methods)"} <= {where.split(" ")[1] for where in overdue}, overdue
    assert sum("warn_deprecated" in where for where in overdue) == 2, overdue
    assert _release(gap_engine.__version__) < _release(REMOVED_IN)
