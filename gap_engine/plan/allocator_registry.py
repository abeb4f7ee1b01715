"""The allocators: how the budget is spread over the layers (the registry).

Every module of ``gap_engine.plan`` may declare allocators on their functions with
``@register("allocator", name, description, tags)`` (``core.registry``); this registry reads the
declarations from the source, nothing imported, so the CLI's choices stay light and adding an
allocator is one new file in ``plan/`` (docs/layout.md). A name declared twice is refused.

Tags: ``grid`` for allocators whose plans sit on the table's rate grid (``dp``, ``evo``;
``allocators.plan_from_table`` runs them itself); ``windows`` for those that read
calibration windows; ``criterion:<name>`` for those whose paper prescribes which units go
(their plans record that criterion instead of the table's). Every other allocator is a baseline: its function takes a
``baselines.BaselineInputs`` and returns ``(rungs, wanted or None)``, which
``ladders.settle`` fixes to the budget (see ``baselines``).
"""

from __future__ import annotations

from gap_engine.core.errors import PlanError
from gap_engine.core.registry import Registry

ALLOCATORS = Registry("allocator", ("gap_engine.plan",), PlanError, first=("dp", "uniform", "flap", "owl", "evo"))
GRID_ALLOCATORS = ALLOCATORS.tagged("grid")  # plans on the table's rate grid
BASELINE_ALLOCATORS = tuple(name for name in ALLOCATORS if name not in GRID_ALLOCATORS)  # settled unit by unit


def needs_windows(allocator: str) -> bool:
    """Whether an allocator reads calibration windows (FLAP, OWL and evo run the model)."""
    return "windows" in ALLOCATORS[allocator].tags


def own_criterion(allocator: str) -> str | None:
    """The criterion an allocator's plans prune with (tag ``criterion:<name>``), or None: the table's."""
    named = [tag.partition(":")[2] for tag in ALLOCATORS[allocator].tags if tag.startswith("criterion:")]
    return named[0] if named else None
