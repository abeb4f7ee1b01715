"""The allocators: how the budget is spread over the layers (the registry).

An allocator ``on_grid`` plans on the table's rate grid (``dp``, ``evo``;
``allocators.plan_from_table`` runs them itself). Every other allocator is a baseline: its
function takes a ``baselines.BaselineInputs`` and returns ``(ladder_steps, wanted or None)``, which
``ladders.fit_to_budget`` fits to the budget (see ``baselines``). A new baseline is one entry: here,
or in a plugin module (``core.registry``, docs/python-api.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from gap_engine.core.errors import PlanError
from gap_engine.core.registry import Registry, Strategy


@dataclass(frozen=True, kw_only=True)
class Allocator(Strategy):
    """An allocator and what the stages around it need to know of it."""

    plan_passes: float  # what one plan costs, in forward passes over the calibration windows (the cost model); 0: none
    reads_windows: bool = False  # runs the model on calibration windows (FLAP, OWL, evo)
    on_grid: bool = False  # plans on the table's rate grid, run by plan_from_table itself
    criterion: str | None = None  # the criterion its paper prescribes (its plans record it); None: the table's
    scores_first: bool = False  # the baseline-plans stage scores the units by the table's criterion before its plans
    family_step: bool = False  # its plans prune by the model family's default step (``plan.step``) where it has one
    symbol: str = "circle"  # its marker in figures
    color: str | None = None  # its colour in figures (None: the figure's default)


ALLOCATORS: Registry[Allocator] = Registry(
    "allocator",
    Allocator,
    (
        Allocator("dp", "GAP: the exact DP on the loss table", "gap_engine.plan.front:dp_choice", plan_passes=0.0, on_grid=True, family_step=True, color="#333333"),
        Allocator("uniform", "same rate everywhere", "gap_engine.plan.baselines:uniform_ladder_steps", plan_passes=0.0, symbol="square", color="#54A24B"),
        Allocator(
            "flap", "FLAP: fluctuation metric, standardised per layer, global selection", "gap_engine.plan.baselines:flap_ladder_steps",
            plan_passes=1.0, reads_windows=True, criterion="flap", scores_first=True, symbol="diamond", color="#B279A2",
        ),
        Allocator(
            "owl", "OWL outlier-weighted layer rates", "gap_engine.plan.baselines:owl_ladder_steps",
            plan_passes=1.0, reads_windows=True, symbol="triangle-up", color="#9D755D",
        ),
        Allocator(
            "evo", "EvoPress-style search seeded with the DP (slow: runs the model per candidate)", "gap_engine.plan.evo:evolve",
            plan_passes=20.0, reads_windows=True, on_grid=True, symbol="star", color="#72B7B2",
        ),
        Allocator(
            "slimgpt", "SlimGPT: log-increasing layer rates, greedy OBS block by block with its update",
            "gap_engine.plan.slimgpt:slimgpt_ladder_steps", plan_passes=0.0, criterion="obs",
        ),
    ),
    PlanError,
)  # fmt: skip
GRID_ALLOCATORS = ALLOCATORS.subset(lambda allocator: allocator.on_grid)  # plans on the table's rate grid
BASELINE_ALLOCATORS = ALLOCATORS.subset(lambda allocator: not allocator.on_grid)  # fitted to the budget unit by unit


def needs_windows(allocator: str) -> bool:
    """Whether an allocator reads calibration windows (FLAP, OWL and evo run the model)."""
    return ALLOCATORS[allocator].reads_windows


def own_criterion(allocator: str) -> str | None:
    """The criterion an allocator's plans prune with, or None: the table's."""
    return ALLOCATORS[allocator].criterion
