"""GAP's allocator: the exact DP over a loss table, for one budget or for every budget.

`dp_front` solves the whole Pareto front of removed parameters against summed table loss
in one pass (``knapsack.solve_front``); `front_rows` turns it into rows the explorer's
budget chart carries to the browser; `dp_choice` solves one budget on a finer grid
(``knapsack.solve_budget``); ``front_view`` turns the front into what the explorer shows.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from gap_engine.core.config import DEFAULT_N_BUCKETS
from gap_engine.core.errors import BudgetError
from gap_engine.core.knapsack import ParetoFront, solve_budget, solve_front
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan, make_plan
from gap_engine.model.units import ComponentGeometry, added_bias_params
from gap_engine.plan.problem import Choice, Constraints, PlanningProblem, layer_slots, planning_problem, reach_error, slot_rates
from gap_engine.plan.step import plan_criterion
from gap_engine.prune.compensations import adds_biases
from gap_engine.tables.artefact import LossTable


def dp_front(
    table: LossTable,
    constraints: Constraints = Constraints(),
    n_buckets: int = DEFAULT_N_BUCKETS,
    smoothed: bool = True,
    biases: Sequence[ComponentGeometry] | None = None,
) -> ParetoFront:
    """The optimum for every budget at once (the app's budget slider reads it via `front_rows`).

    Args:
        table: the loss table.
        constraints: locks, rate bounds, coupling.
        n_buckets: budget resolution of the DP.
        smoothed: plan on the table's smoothed losses (else on the raw deltas).
        biases: the blocks' counting geometry when the prune that follows adds bias
            compensation (`problem.charged_counts`): every budget then pays for the biases,
            and each row's removal is net of them, as `plan_from_table` counts a plan.
    Returns:
        The planner's ParetoFront; its ``choices`` index the table's rate grid per slot,
        one slot per component (2L columns) or per layer when coupled (L columns):
        `choice_rates` turns a row into per-layer rates.
    """
    problem = planning_problem(table, constraints, smoothed, biases)
    return solve_front(problem.costs, problem.losses, problem.allowed, n_buckets)


def choice_rates(table: LossTable, choice: Choice) -> tuple[list[float], list[float]]:
    """(attention_rates, mlp_rates) for a row of a `dp_front` (L columns: coupled; 2L: split)."""
    coupled = len(choice) == table.num_layers
    if not coupled and len(choice) != 2 * table.num_layers:
        raise BudgetError(
            f"a choice for {table.num_layers} layers has {table.num_layers} or {2 * table.num_layers} entries, got {len(choice)}"
        )
    slots = layer_slots(table.num_layers, coupled)
    return slot_rates(slots, [float(table.rate_grid[int(r)]) for r in choice], table.num_layers)


def front_rows(table: LossTable, front: ParetoFront, biases: Sequence[ComponentGeometry] | None = None) -> list[dict[str, Any]]:
    """The Pareto front as rows, one per distinct optimum, by increasing removal.

    Each row: ``budget`` (fraction of prunable parameters removed), ``removed``,
    ``predicted_loss`` (summed table loss), ``attention_rates`` and ``mlp_rates`` (per
    layer), and ``bias_params``: what bias compensation adds back when the front was solved
    with ``biases`` (the same geometry `dp_front` was given), else 0. ``removed`` and
    ``budget`` are then net of those biases: the cut removes ``removed + bias_params``.
    Removal strictly increases and loss never decreases from row to row; rows a
    previous row dominates (removes as much for no more loss) are left out, so for a
    budget b the first row with ``budget >= b`` is its optimum.
    """
    rows: list[dict[str, Any]] = []
    best_removed = -1
    for b in range(len(front.budgets)):
        removed = int(front.removed[b])
        if not np.isfinite(front.best_loss[b]) or removed <= best_removed:
            continue
        best_removed = removed
        attention, mlp = choice_rates(table, front.choices[b])
        added = added_bias_params(biases, attention, mlp, table.spec.channel_multiple) if biases is not None else 0
        rows.append(
            {
                "budget": removed / table.dense_prunable,
                "removed": removed,
                "bias_params": added,
                "predicted_loss": float(front.best_loss[b]),
                "attention_rates": attention,
                "mlp_rates": mlp,
            }
        )
    return rows


def front_csv(rows: list[dict[str, Any]]) -> str:
    """`front_rows` as CSV text: budget, removed, predicted_loss, attn_0.., mlp_0..."""
    if not rows:
        return "budget,removed,predicted_loss\n"
    n = len(rows[0]["attention_rates"])
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["budget", "removed", "predicted_loss"] + [f"attn_{i}" for i in range(n)] + [f"mlp_{i}" for i in range(n)])
    for row in rows:
        writer.writerow(
            [f"{row['budget']:.6f}", row["removed"], f"{row['predicted_loss']:.9g}"]
            + [f"{r:.6g}" for r in row["attention_rates"]]
            + [f"{r:.6g}" for r in row["mlp_rates"]]
        )
    return buffer.getvalue()


def dp_choice(problem: PlanningProblem, budget: float, n_buckets: int) -> np.ndarray:
    low, high = problem.reach()
    if budget * problem.dense_prunable > high:
        raise reach_error("dp", budget, low, high, problem.dense_prunable)
    return dp_solution(problem, budget, n_buckets)


def dp_solution(problem: PlanningProblem, budget: float, n_buckets: int) -> np.ndarray:
    """The option index per slot that removes at least ``budget`` with the least summed loss, for a
    budget already found within the problem's reach (`dp_choice` checks it; `allocators.check_reach`
    checks it once per command)."""
    return solve_budget(problem.costs, problem.losses, problem.allowed, removed_params=budget * problem.dense_prunable, n_buckets=n_buckets)


def grid_plan(
    lm: LoadedModel,
    table: LossTable,
    problem: PlanningProblem,
    choice: Choice,
    budget: float,
    allocator: str,
    compensation: str | None = None,
) -> RatePlan:
    """The plan of one option index per slot, with its summed table loss as the prediction
    (``compensation``: the one its costs were counted for, recorded in the plan)."""
    attention, mlp = problem.rates(choice)
    return make_plan(
        lm,
        attention,
        mlp,
        plan_criterion(allocator, table, compensation),
        table.spec.channel_multiple,
        allocator=allocator,
        budget=budget,
        predicted_loss=problem.loss(choice),
        table_key=table.key,
        compensation=compensation,
        biases=adds_biases(compensation),
    )
