"""The DP front as the explorer and the report show it: budget steps, their plans, the uniform line.

The budget chart (the app's one budget control) and the stakeholder report draw the
Pareto front of `front.front_rows`. Three things keep what they show equal to what
gets pruned:

- **Steps are front rows.** A slider step is one row of the front, and its budget is that
  row's own removed fraction, so the value under the thumb, the bars, the readout and the
  plan are the same optimum (an evenly spaced budget picking "the first row at or above it"
  shows one budget and prunes another).
- **The plan of a step is built from its row** (`row_plan`), not re-solved at the row's
  budget: `solve_budget` runs on a finer bucket grid than the front and, with the budget
  turned back into a parameter count through floats, can pick a different optimum.
- **The uniform line is made of real uniform plans** (`uniform_line`): the same
  `plan_from_table(..., "uniform")` the baseline markers come from, unit-rounded and held
  to the constraints, so markers sit on the line.

No plotting, no streamlit: numbers in, numbers out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from gap_engine.core.errors import BudgetError, InvariantError, PlanError
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan, make_plan
from gap_engine.plan.allocators import plan_from_table
from gap_engine.plan.problem import Constraints
from gap_engine.tables.artefact import LossTable

log = logging.getLogger(__name__)

MAX_STEPS = 600  # slider steps shipped to the browser: about one per pixel of a wide rail
UNIFORM_STEP = 0.05  # budget spacing of the uniform line's plans


def budget_steps(front: Sequence[dict[str, Any]], max_steps: int = MAX_STEPS) -> list[int]:
    """Indices of the front rows that become slider steps, by increasing budget.

    Every row when there are at most ``max_steps``; otherwise the first row at or above
    each of ``max_steps`` evenly spaced budgets (the first and last row always included,
    no row twice).

    Args:
        front: rows of `front.front_rows` (strictly increasing ``budget``).
        max_steps: the most steps to keep (>= 2).
    Returns:
        Increasing row indices into ``front``; empty for an empty front.
    """
    if max_steps < 2:
        raise BudgetError(f"a budget slider needs at least 2 steps, got {max_steps}")
    n = len(front)
    if n <= max_steps:
        return list(range(n))
    budgets = np.array([row["budget"] for row in front], dtype=np.float64)
    wanted = np.linspace(budgets[0], budgets[-1], max_steps)
    picks = np.minimum(np.searchsorted(budgets, wanted - 1e-12), n - 1)
    return sorted(set(int(i) for i in picks) | {0, n - 1})


def step_at_budget(front: Sequence[dict[str, Any]], steps: Sequence[int], budget: float) -> int:
    """Position in ``steps`` of the first step whose row removes at least ``budget``.

    A budget above the last step gives the last step, so any stored budget lands on a row.
    A budget taken from a row (a released step) gives exactly that row back.
    """
    if not steps:
        raise BudgetError("the front is empty: no plan satisfies these constraints")
    budgets = np.array([front[i]["budget"] for i in steps], dtype=np.float64)
    return min(int(np.searchsorted(budgets, float(budget) - 1e-12)), len(steps) - 1)


def grid_indices(rate_grid: Sequence[float], rates: Sequence[float]) -> list[int]:
    """Each rate's index in the table's rate grid (front rows are always on the grid).

    Raises:
        PlanError: a rate that is not a grid point.
    """
    grid = np.asarray(rate_grid, dtype=np.float64)
    values = np.asarray(rates, dtype=np.float64)
    nearest = np.abs(values[:, None] - grid[None, :]).argmin(axis=1)  # (N,) closest grid point
    off = np.flatnonzero(np.abs(grid[nearest] - values) > 1e-9)
    if off.size:
        raise PlanError(f"rate {values[off[0]]:g} is not on the table's grid {[float(r) for r in grid]}")
    return [int(i) for i in nearest]


def row_plan(lm: LoadedModel, table: LossTable, row: dict[str, Any]) -> RatePlan:
    """The DP plan of one front row: the row's own rates, budget and predicted loss.

    Args:
        lm: the dense LoadedModel the table was built for (its geometry counts parameters).
        table: the LossTable behind the front.
        row: one row of `front.front_rows` for ``table``.
    Returns:
        A validated RatePlan (allocator ``dp``) that removes exactly ``row["removed"]``.
    Raises:
        PlanError: the model's geometry counts a different removal than the table's cells
            (the table was measured on another geometry).
    """
    plan = make_plan(
        lm,
        row["attention_rates"],
        row["mlp_rates"],
        table.spec.criterion,
        table.spec.channel_multiple,
        allocator="dp",
        budget=float(row["budget"]),
        predicted_loss=float(row["predicted_loss"]),
        table_key=table.key,
    )
    if int(plan.params["removed"]) != int(row["removed"]):
        raise PlanError(
            f"the model's geometry removes {plan.params['removed']:,} parameters for this front row, "
            f"the table says {int(row['removed']):,}: the table was measured on another geometry"
        )
    return plan


def uniform_line(
    lm: LoadedModel, table: LossTable, constraints: Constraints, top: float, step: float = UNIFORM_STEP, extra: Sequence[float] = ()
) -> list[dict[str, Any]]:
    """Exact uniform plans along the budget axis, scored by the table like the baselines.

    Args:
        lm: the dense LoadedModel (geometry only: no forward pass).
        table: the LossTable.
        constraints: problem.Constraints (locks and the max rate hold for uniform too).
        top: the largest budget to try (the front's top, say).
        step: budget spacing of the plans.
        extra: more budgets to include (those of baseline markers, so they lie on the line).
    Returns:
        Rows ``budget``, ``removed_fraction`` (of prunable), ``predicted_loss``, sorted by
        removed fraction; budgets uniform cannot reach under the constraints are left out.
    """
    budgets = sorted({round(float(b), 6) for b in np.arange(0.0, top + 1e-9, step)} | {round(float(b), 6) for b in extra if 0 <= b <= top})
    rows = []
    for budget in budgets:
        try:
            plan = plan_from_table(lm, table, budget, "uniform", constraints)
            if plan.predicted_loss is None:
                raise InvariantError("a plan made from a table has no predicted loss")
        except BudgetError as exc:
            log.debug("uniform line stops at %.3f: %s", budget, exc)
            continue
        rows.append(
            {
                "budget": budget,
                "removed_fraction": float(plan.params["removed_fraction_of_prunable"]),
                "predicted_loss": float(plan.predicted_loss),
            }
        )
    return sorted(rows, key=lambda r: r["removed_fraction"])


def front_row_at(front: Sequence[dict[str, Any]], budget: float) -> dict[str, Any] | None:
    """The optimum of `front.front_rows` for a budget: the first row removing at least it (None past the top)."""
    index = int(np.searchsorted(np.array([row["budget"] for row in front]), budget - 1e-12))
    return front[index] if index < len(front) else None


def baseline_budgets(top_budget: float, n: int = 5, low: float = 0.1, high: float = 0.6) -> list[float]:
    """A few budgets at which to compute baseline plans: ``n`` from ``low`` to ``high`` (or 95% of the reachable top)."""
    return [round(float(b), 3) for b in np.linspace(low, min(high, top_budget * 0.95), n) if b <= top_budget]
