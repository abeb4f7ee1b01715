"""Registries of choices: one explicit table per kind (criterion, estimator, objective,
allocator, compensation, recovery method and objective), beside the stage that uses it.

    ALLOCATORS = Registry("allocator", Allocator, (
        Allocator("dp", "GAP: the exact DP on the loss table", "gap_engine.plan.front:dp_choice", on_grid=True, plan_passes=0),
        Allocator("owl", "OWL outlier-weighted layer rates", "gap_engine.plan.baselines:owl_ladder_steps", reads_windows=True, plan_passes=1),
    ), PlanError)

Each entry is a small frozen dataclass of its kind (a `Strategy`): the name flags, files and
selectors say, one line of description, the code that does it as a ``"module:attribute"``
string that a grep and an IDE follow (imported on first use, so ``gap --help`` and the parser
never load torch) and the properties the other stages ask about (whether it reads calibration
windows, its price for the cost model, its plot style), so no stage keeps a list of names.

Plugins: ``GAP_PLUGINS=pkg.module,other.module`` names modules that each export
``STRATEGIES``, a sequence of entries of any kinds; every registry adds the ones of its kind
after its own, read again whenever the variable changes. A new criterion, allocator or
compensation is thus one new file (docs/python-api.md, "Adding a strategy"). A name given
twice is refused with both places named (`RegistryError`), and so is a plugin module that
does not import, in one line.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gap_engine.core.errors import GapError

PLUGINS_VARIABLE = "GAP_PLUGINS"  # comma-separated modules whose STRATEGIES every registry adds
PLUGIN_ATTRIBUTE = "STRATEGIES"


class RegistryError(GapError):
    """A registry's entries contradict each other (a name given twice), or a plugin cannot be read."""


@dataclass(frozen=True)
class Strategy:
    """One registered choice; each kind adds the properties its callers ask about."""

    name: str  # what flags, files and selectors say
    description: str  # one line: help texts and selector labels show it
    function: str  # "package.module:attribute", imported on first use

    def load(self) -> Callable[..., Any]:
        """The function (or class) that does this choice."""
        module, _, attribute = self.function.partition(":")
        loaded = importlib.import_module(module)  # a missing optional package surfaces as itself (the CLI names its extra)
        function = getattr(loaded, attribute, None)
        if not callable(function):
            raise RegistryError(f"'{self.name}' names {self.function}, which is not a function of {module}")
        found: Callable[..., Any] = function
        return found


E = TypeVar("E", bound=Strategy)


class Registry(Generic[E]):
    """The choices of one kind, in the order surfaces list them: the table's, then the plugins'."""

    def __init__(
        self,
        kind: str,
        entry: type[E],
        table: Iterable[E],
        error: type[GapError] = GapError,
        keep: Callable[[E], bool] | None = None,
    ):
        """
        Args:
            kind: the registry's noun ("criterion", "allocator", ...) in messages.
            entry: the entry class of this kind: plugins' entries of it join the table.
            table: the built-in entries, in the order selectors list them.
            error: what `check` raises for an unknown name.
            keep: a filter of the entries (`subset`).
        Raises:
            RegistryError: a name given twice.
        """
        self.kind, self.entry, self.error, self._keep = kind, entry, error, keep
        self._table = tuple(table)
        self._plugins: str | None = None
        self._choices = self._merged(())

    def _merged(self, added: Iterable[Strategy]) -> dict[str, E]:
        found: dict[str, E] = {}
        for choice in (*self._table, *(e for e in added if isinstance(e, self.entry))):
            if choice.name in found:
                raise RegistryError(
                    f"{self.kind} '{choice.name}' is given twice: by {found[choice.name].function} and by {choice.function}"
                )
            found[choice.name] = choice
        return {name: choice for name, choice in found.items() if self._keep is None or self._keep(choice)}

    @property
    def choices(self) -> dict[str, E]:
        """name -> entry, plugins included (read again when ``GAP_PLUGINS`` changes)."""
        wanted = os.environ.get(PLUGINS_VARIABLE, "")
        if wanted != self._plugins:
            self._choices, self._plugins = self._merged(plugin_entries(wanted)), wanted
        return self._choices

    def subset(self, keep: Callable[[E], bool]) -> Registry[E]:
        """The entries ``keep`` accepts, as a registry of their own (plugins included)."""
        return Registry(self.kind, self.entry, self._table, self.error, keep)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.choices)

    def __contains__(self, name: object) -> bool:
        return name in self.choices

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.choices)

    def __getitem__(self, name: str) -> E:
        return self.choices[self.check(name)]

    def describe(self, name: str) -> str:
        """The one-line description of ``name``."""
        return self[name].description

    def label(self, name: str) -> str:
        """``name — description``: how a selector shows a choice."""
        return f"{name} — {self.describe(name)}"

    def help(self) -> str:
        """Every choice with its description, for a help text: ``a: ...; b: ...``."""
        return "; ".join(f"{c.name}: {c.description}" for c in self.choices.values())

    def check(self, name: object, what: str | None = None) -> str:
        """``name`` when it is registered; else the registry's error, naming the choices."""
        choices = self.choices
        if not isinstance(name, str) or name not in choices:
            raise self.error(f"unknown {what or self.kind} '{str(name)[:40]}'; choose one of {', '.join(choices)}")
        return name

    def function(self, name: str) -> Callable[..., Any]:
        """The function registered for ``name`` (imported now)."""
        return self[name].load()


_PLUGINS: dict[str, tuple[Strategy, ...]] = {}


def plugin_entries(modules: str) -> tuple[Strategy, ...]:
    """The entries the comma-separated plugin ``modules`` export (``STRATEGIES``), each module imported once.

    Raises:
        RegistryError: a module that does not import, or whose STRATEGIES is not a sequence of entries.
    """
    entries: list[Strategy] = []
    for module in (name.strip() for name in modules.split(",") if name.strip()):
        if module not in _PLUGINS:
            try:
                exported = getattr(importlib.import_module(module), PLUGIN_ATTRIBUTE, None)
            except Exception as exc:  # any failure of a user's module is one line, not a traceback
                raise RegistryError(f"plugin module '{module}' ({PLUGINS_VARIABLE}) does not import: {_one_line(exc)}") from None
            if not isinstance(exported, Sequence) or not all(isinstance(e, Strategy) for e in exported):
                raise RegistryError(
                    f"plugin module '{module}' ({PLUGINS_VARIABLE}) must export {PLUGIN_ATTRIBUTE}, a list of strategy entries"
                )
            _PLUGINS[module] = tuple(exported)
        entries += _PLUGINS[module]
    return tuple(entries)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
