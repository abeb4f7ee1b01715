"""The allocators: how the budget is spread over the layers (the registry).

Every module of ``gap_engine.plan`` may declare allocators with a top-level
``DECLARED_ALLOCATORS = (Choice(name, description, function, tags), ...)``; this module reads
those declarations from the source (``core.registry.declared_choices``, nothing imported),
so the CLI's choices stay light and adding an allocator is one new file in ``plan/``.

Tags: ``grid`` for allocators whose plans sit on the table's rate grid (``dp``, ``evo``;
``allocators.plan_from_table`` runs them itself); ``windows`` for those that read
calibration windows; ``criterion:<name>`` for those whose paper prescribes which units go
(their plans record that criterion instead of the table's). Every other allocator is a baseline: its function takes a
``baselines.BaselineInputs`` and returns ``(rungs, wanted or None)``, which
``ladders.settle`` fixes to the budget (see ``baselines``).
"""

from __future__ import annotations

from pathlib import Path

from gap_engine.core.errors import PlanError
from gap_engine.core.registry import Registry, declared_choices

ALLOCATORS = Registry(
    "allocator",
    declared_choices(Path(__file__).parent, "gap_engine.plan", "DECLARED_ALLOCATORS", first=("dp", "uniform", "flap", "owl", "evo")),
    PlanError,
)
GRID_ALLOCATORS = ALLOCATORS.tagged("grid")  # plans on the table's rate grid
BASELINE_ALLOCATORS = tuple(name for name in ALLOCATORS if name not in GRID_ALLOCATORS)  # settled unit by unit


def needs_windows(allocator: str) -> bool:
    """Whether an allocator reads calibration windows (FLAP, OWL and evo run the model)."""
    return "windows" in ALLOCATORS[allocator].tags


def own_criterion(allocator: str) -> str | None:
    """The criterion an allocator's plans prune with (tag ``criterion:<name>``), or None: the table's."""
    named = [tag.partition(":")[2] for tag in ALLOCATORS[allocator].tags if tag.startswith("criterion:")]
    return named[0] if named else None
