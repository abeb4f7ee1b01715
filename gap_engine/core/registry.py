"""Registries of choices: every criterion, estimator, objective, allocator and recovery method
is registered once, with its name, a one-line description and the function that does it.

The CLI's ``choices=`` and help texts, the explorer's selectors and the validators
(``TableSpec``, ``RatePlan``, recovery settings) all read the same registry, so a name, its
description and its code cannot drift apart. A registry module holds no heavy imports: a
`Choice` names its function as ``"package.module:attribute"`` and imports it on first use,
so ``gap --help`` and the parser never load torch.

Allocators are found rather than listed (`declared_choices`): a module of ``gap_engine.plan``
that assigns ``DECLARED_ALLOCATORS = (Choice(...), ...)`` declares them, and the registry
reads those declarations from the source without importing it. Adding an allocator is one
new file.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gap_engine.core.errors import GapError


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


class Registry:
    """The choices of one kind, in the order surfaces list them."""

    def __init__(self, kind: str, choices: Iterable[Choice], error: type[GapError] = GapError):
        self.kind = kind  # "criterion", "allocator", ...: the noun error messages use
        self.error = error  # what `check` raises
        self._choices = {choice.name: choice for choice in choices}

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


def declared_choices(folder: Path, package: str, variable: str, first: tuple[str, ...] = ()) -> list[Choice]:
    """The choices that the modules of ``folder`` declare, read from their source.

    A module declares its choices by assigning ``<variable> = (Choice(...), ...)`` at its top
    level; the arguments must be literals. No module is imported.

    Args:
        folder: the package's folder; package: its dotted name (a ``function`` without a
            module part means this module: ``":rungs"``).
        first: names listed first, in this order; the others follow by name.
    """
    found: dict[str, Choice] = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
                if not isinstance(node.value, (ast.Tuple, ast.List)):
                    raise TypeError(f"{path}: {variable} must be a tuple of Choice(...) calls")
                for call in node.value.elts:
                    choice = _literal_choice(call, f"{package}.{path.stem}")
                    found[choice.name] = choice
    order = [name for name in first if name in found] + sorted(name for name in found if name not in first)
    return [found[name] for name in order]


def _literal_choice(call: ast.expr, module: str) -> Choice:
    """A ``Choice(...)`` call with literal arguments, as a Choice."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "Choice"):
        raise TypeError(f"{module}: a declared choice must be a Choice(...) call")
    fields = ("name", "description", "function", "tags")
    values = dict(zip(fields, (ast.literal_eval(arg) for arg in call.args)))
    values |= {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    if values.get("function", "").startswith(":"):
        values["function"] = module + values["function"]
    return Choice(**values)
