"""Registries of choices: every criterion, estimator, objective, allocator and recovery method
is declared once, on the function (or class) that does it, and a registry collects them.

    @register("allocator", "owl", "OWL outlier-weighted layer rates", tags=("windows",))
    def owl_rungs(inputs): ...

    ALLOCATORS = Registry("allocator", ("gap_engine.plan",), PlanError, first=("dp", "uniform"))

The CLI's ``choices=`` and help texts, the explorer's selectors and the validators
(``TableSpec``, ``RatePlan``, recovery settings) all read the registry, so a name, its
description and its code cannot drift apart. A registry reads the declarations from the source
of the modules (or every module of the packages) it names, with ``ast``, without importing
them, so ``gap --help`` and the parser never load torch; a choice's function is imported on
first use. The decorator's arguments must therefore be literals; at run time it returns the
function unchanged. A name declared twice for one registry is refused, both places named
(``RegistryError``), and so is a module still declaring choices in the retired
``DECLARED_*`` tuples. Adding an allocator is one new file in ``plan/``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gap_engine.core.errors import GapError

F = TypeVar("F")


class RegistryError(GapError):
    """A registry's declarations contradict each other (a name declared twice, an order naming nothing)."""


@dataclass(frozen=True)
class Choice:
    """One registered choice."""

    name: str  # what flags, files and selectors say
    description: str  # one line: help texts and selector labels show it
    function: str  # "gap_engine.package.module:attribute", imported on first use
    tags: tuple[str, ...] = ()  # properties callers ask about (e.g. an allocator that reads windows)

    def load(self) -> Callable[..., Any]:
        """The function (or class) that does this choice."""
        module, _, attribute = self.function.partition(":")
        function: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
        return function


def register(kind: str, name: str, description: str, tags: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Declare the decorated function or class as the choice ``name`` of the registry of ``kind``
    ("criterion", "table estimator", ...), with a one-line ``description`` and ``tags``. Every
    argument must be a literal: the registry reads them from the source (see the module docstring)."""

    def declared(function: F) -> F:
        return function

    return declared


class Registry:
    """The choices of one kind, in the order surfaces list them."""

    def __init__(self, kind: str, sources: Iterable[str], error: type[GapError] = GapError, first: Iterable[str] = ()):
        """
        Args:
            kind: the registry's noun ("criterion", "allocator", ...): what ``@register`` names and error messages use.
            sources: dotted names of the modules, or packages, whose ``@register(kind, ...)`` declarations it collects.
            error: what `check` raises for an unknown name.
            first: names listed first, in this order; the others follow in declaration order (module by module).
        Raises:
            RegistryError: a name declared twice, or ``first`` naming a choice nobody declared.
        """
        self.kind = kind
        self.error = error
        found: dict[str, Choice] = {}
        for choice in declared_choices(kind, sources):
            if choice.name in found:
                raise RegistryError(f"{kind} '{choice.name}' is declared twice: by {found[choice.name].function} and by {choice.function}")
            found[choice.name] = choice
        missing = [name for name in first if name not in found]
        if missing:
            raise RegistryError(f"the {kind} registry lists {', '.join(missing)} first, but nothing declares them")
        order = list(dict.fromkeys([*first, *found]))
        self._choices = {name: found[name] for name in order}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._choices)

    def __contains__(self, name: object) -> bool:
        return name in self._choices

    def __iter__(self) -> Iterator[str]:
        return iter(self._choices)

    def __len__(self) -> int:
        return len(self._choices)

    def __getitem__(self, name: str) -> Choice:
        return self._choices[self.check(name)]

    def describe(self, name: str) -> str:
        """The one-line description of ``name``."""
        return self[name].description

    def label(self, name: str) -> str:
        """``name — description``: how a selector shows a choice."""
        return f"{name} — {self.describe(name)}"

    def help(self) -> str:
        """Every choice with its description, for a help text: ``a: ...; b: ...``."""
        return "; ".join(f"{c.name}: {c.description}" for c in self._choices.values())

    def tagged(self, tag: str) -> tuple[str, ...]:
        """The names of the choices carrying ``tag``."""
        return tuple(c.name for c in self._choices.values() if tag in c.tags)

    def check(self, name: object, what: str | None = None) -> str:
        """``name`` when it is registered; else the registry's error, naming the choices."""
        if not isinstance(name, str) or name not in self._choices:
            raise self.error(f"unknown {what or self.kind} '{name}'; choose one of {', '.join(self._choices)}")
        return name

    def function(self, name: str) -> Callable[..., Any]:
        """The function registered for ``name`` (imported now)."""
        return self[name].load()


def source_files(source: str) -> list[tuple[str, Path]]:
    """(module name, file) of ``source``: a module, or every module of a package, found without
    importing it (only its parent packages, whose ``__init__`` files import nothing)."""
    spec = importlib.util.find_spec(source)
    if spec is None or spec.origin is None:
        raise RegistryError(f"registry source '{source}' is not a module or package")
    if spec.submodule_search_locations is None:
        return [(source, Path(spec.origin))]
    folder = Path(spec.origin).parent
    return [(f"{source}.{path.stem}", path) for path in sorted(folder.glob("*.py")) if path.name != "__init__.py"]


def declared_choices(kind: str, sources: Iterable[str]) -> list[Choice]:
    """Every ``@register(kind, ...)`` declaration in ``sources``, in module and line order."""
    found: list[Choice] = []
    for source in sources:
        for module, path in source_files(source):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                _refuse_retired_declarations(node, module)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    calls = [call for call in node.decorator_list if isinstance(call, ast.Call) and _declares(call, kind)]
                    found += [_choice(call, module, node.name) for call in calls]
    return found


def _declares(decorator: ast.Call, kind: str) -> bool:
    """Whether ``decorator`` is ``register(kind, ...)`` (or ``registry.register(kind, ...)``)."""
    if not decorator.args:
        return False
    func = decorator.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    first = decorator.args[0]
    return called == "register" and isinstance(first, ast.Constant) and first.value == kind


def _choice(call: ast.Call, module: str, attribute: str) -> Choice:
    """The Choice a ``@register(kind, name, description, tags)`` call declares."""
    try:
        fields = {key: ast.literal_eval(arg) for key, arg in zip(("kind", "name", "description", "tags"), call.args)}
        fields |= {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
        return Choice(fields["name"], fields["description"], f"{module}:{attribute}", tuple(fields.get("tags", ())))
    except (ValueError, KeyError):
        raise RegistryError(f"{module}.{attribute}: @register takes a literal kind, name, description and tags") from None


def _refuse_retired_declarations(node: ast.stmt, module: str) -> None:
    """A module still declaring choices the old way would be left out in silence: say so."""
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.startswith("DECLARED_") for t in node.targets):
        raise RegistryError(f"{module} declares its choices in a DECLARED_* tuple: declare each with @register(...) on its function")
