"""Allocation: a loss table and one global budget in, a rate plan out (GAP, EMNLP 2025).

GAP's own allocator (``dp``) hands the table to the exact multiple-choice-knapsack DP of
``planner``: one grid rate per component, removing at least the budget with the least
summed table loss (``front``). The baselines it is compared against (``baselines``:
uniform, FLAP, OWL) and the evolutionary search (``evo``) share the same interface and
are held to the same budget and constraints (``problem``).

Units are whole heads (GQA-valid) and MLP channels in multiples of ``channel_multiple``,
so no allocator hits a budget exactly: ``dp`` and ``evo`` remove at least the budget on
the table's grid; the baselines are fitted to the budget, whole unit by whole unit, to remove at least
the budget and less than one further unit beyond it (``ladders``). A plan for a prune with
bias compensation removes its budget net of the biases that compensation adds
(``problem.bias_charges``), and records the compensation it was counted for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gap_engine.core.config import DEFAULT_N_BUCKETS
from gap_engine.core.errors import InvariantError, PlanError, TableError
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan, make_plan
from gap_engine.model.units import block_geometries
from gap_engine.plan.allocator_registry import ALLOCATORS, GRID_ALLOCATORS, needs_windows
from gap_engine.plan.baselines import Baseline, BaselineInputs
from gap_engine.plan.evo import EvoResult, EvoSettings, evolve
from gap_engine.plan.front import dp_front, dp_solution, front_csv, front_rows, grid_plan
from gap_engine.plan.ladders import Ladder, build_ladders, fit_to_budget, ladder_rates, ladder_reach
from gap_engine.plan.problem import (
    Constraints,
    PlanningProblem,
    charge_biases,
    charged_counts,
    check_budget_fraction,
    planning_problem,
    predicted_loss,
    reach_error,
    slot_rates,
)
from gap_engine.plan.step import plan_criterion
from gap_engine.prune.compensations import adds_biases
from gap_engine.prune.criteria import is_sequential
from gap_engine.prune.importance import ImportanceScores, compute_importance
from gap_engine.prune.sequential import OBS_COMPENSATIONS
from gap_engine.tables.artefact import LossTable

__all__ = [
    "ALLOCATORS",
    "Constraints",
    "EvoResult",
    "EvoSettings",
    "ReachableBudget",
    "check_reach",
    "dp_front",
    "evolve",
    "front_csv",
    "front_rows",
    "needs_windows",
    "plan_from_table",
]


def _check_allocator(allocator: str) -> None:
    ALLOCATORS.check(allocator)


@dataclass(frozen=True)
class ReachableBudget:
    """A budget `check_reach` found in [0, 1) and within an allocator's reach, with what it was
    checked on: `plan_from_table` given one plans on it as it is, neither building nor checking again."""

    budget: float  # fraction of prunable parameters to remove
    allocator: str  # the allocator it is within reach of
    compensation: str | None  # the compensation the costs are counted for (`counted_compensation`)
    problem: PlanningProblem  # the table under the constraints, that compensation's biases charged
    ladders: list[Ladder] | None  # every slot's unit ladder, for the off-grid allocators; None for the grid ones


def check_reach(
    lm: LoadedModel,
    table: LossTable,
    budget: float,
    allocator: str = "dp",
    constraints: Constraints = Constraints(),
    compensation: str | None = None,
    smoothed: bool = True,
    problem: PlanningProblem | None = None,
) -> ReachableBudget:
    """Raise what `plan_from_table` would raise for this budget, without its slow part.

    Args:
        problem: ``planning_problem(table, constraints, smoothed)`` when the caller built it already
            (before the model loaded, to refuse bad constraints early); the biases of
            ``compensation`` are charged to it here rather than the problem built again.
    Returns:
        The checked budget and the planning problem (and ladders) it was checked on, for
        `plan_from_table`.
    Raises:
        BudgetError: a budget outside [0, 1) or beyond the reach of ``allocator`` under
            ``constraints`` (the message gives the reachable range); contradictory constraints.
        PlanError: an unknown allocator.
    """
    _check_allocator(allocator)
    budget = check_budget_fraction(budget)
    compensation = counted_compensation(allocator, table, compensation)
    counts = charged_counts(lm, compensation)
    if problem is None:
        problem = planning_problem(table, constraints, smoothed, counts)
    elif counts is not None:
        problem = charge_biases(problem, counts, table.spec.channel_multiple)
    if allocator in GRID_ALLOCATORS:
        low, high = problem.reach()
        if budget * problem.dense_prunable > high:
            raise reach_error(allocator, budget, low, high, problem.dense_prunable)
        return ReachableBudget(budget, allocator, compensation, problem, None)
    biases = adds_biases(compensation)
    ladders = build_ladders(block_geometries(lm), problem.slots, problem.locked, constraints, table.spec.channel_multiple, biases)
    ladder_reach(allocator, budget, ladders, problem.dense_prunable)
    return ReachableBudget(budget, allocator, compensation, problem, ladders)


def counted_compensation(allocator: str, table: LossTable, compensation: str | None) -> str | None:
    """The compensation a plan of ``allocator`` is counted for: ``compensation``, or none when
    the plan's criterion updates the kept columns itself (``obs``) and ``compensation`` is not
    one that may follow that update (a bias may; a refit would redo it)."""
    if compensation is not None and is_sequential(plan_criterion(allocator, table, compensation)):
        return compensation if compensation in OBS_COMPENSATIONS else "none"
    return compensation


def plan_from_table(
    lm: LoadedModel,
    table: LossTable,
    budget: float,
    allocator: str = "dp",
    constraints: Constraints = Constraints(),
    windows: torch.Tensor | None = None,
    scores: ImportanceScores | None = None,
    evo: EvoSettings = EvoSettings(),
    n_buckets: int = DEFAULT_N_BUCKETS,
    smoothed: bool = True,
    compensation: str | None = None,
    reachable: ReachableBudget | None = None,
) -> RatePlan:
    """A rate plan for ``lm`` removing ``budget`` of its prunable parameters.

    Args:
        lm: the dense LoadedModel the table was built for (its geometry counts the
            parameters; flap/owl/evo also read its weights or run it).
        table: its loss table.
        budget: fraction of prunable parameters to remove, in [0, 1).
        allocator: one of ALLOCATORS (``allocator_registry``).
        constraints: locks, rate bounds, coupling (every allocator honours them).
        windows: (N, T) calibration token ids for the allocators that read data
            (`needs_windows`); the table's own windows keep unit choices as it measured.
        scores: importance scores of the table's criterion on ``windows`` (computed when None).
        evo: search settings of ``evo``.
        n_buckets: DP budget resolution.
        smoothed: plan on the smoothed table (else the raw deltas).
        compensation: what the prune that follows applies after the cut (a COMPENSATIONS name):
            one that adds biases (bias, bias+refit) has them paid from the budget, so the
            plan removes ``budget`` net of them (`counted_compensation`: none for ``obs``);
            None: not said, nothing charged or recorded.
        reachable: what `check_reach` returned for these arguments, so that a command checks
            its budget and builds its planning problem once (None: both done here).
    Returns:
        A validated RatePlan with allocator, budget, predicted_loss (summed table loss,
        linear between grid rates), table_key and compensation filled in; its criterion is
        ``step.plan_criterion``'s: the allocator's own (flap, slimgpt), DP's family step (obs on
        Llama), else the table's.
    Raises:
        BudgetError: a budget outside [0, 1) or beyond reach (the message gives the
            reachable range), or contradictory constraints.
        TableError: the table is for another model.
        PlanError: an unknown allocator, or one that needs windows and got none.
        InvariantError: a ``reachable`` checked for another budget or allocator.
    """
    _check_allocator(allocator)
    if reachable is not None and (reachable.budget, reachable.allocator) != (budget, allocator):
        raise InvariantError(
            f"a budget checked as {reachable.budget:g} for {reachable.allocator} was given for {budget:g} with {allocator}"
        )
    table.check_model(lm)
    if table.spec.channel_multiple < 1:
        raise TableError("loss table channel_multiple must be positive")
    if windows is None and needs_windows(allocator):
        raise PlanError(f"the {allocator} allocator reads calibration windows; none were given")
    if needs_windows(allocator):
        lm = lm.private()  # they hook or mask the model: never one that other threads run
    if reachable is None:
        reachable = check_reach(lm, table, budget, allocator, constraints, compensation, smoothed)
    budget, problem, compensation = reachable.budget, reachable.problem, reachable.compensation
    if allocator == "dp":
        return grid_plan(lm, table, problem, dp_solution(problem, budget, n_buckets), budget, "dp", compensation)
    if allocator == "evo":
        if windows is None:
            raise InvariantError("evo was given no calibration windows (checked above)")
        if scores is None:
            scores = compute_importance(lm, windows, table.spec.criterion, table.spec.windows.batch_size)
        return evolve(
            lm, table, budget, windows, scores, constraints, evo, n_buckets, smoothed, compensation=compensation, problem=problem
        ).plan
    if reachable.ladders is None:
        raise InvariantError(f"the off-grid allocator {allocator} was checked without its ladders")
    return _baseline_plan(lm, table, problem, reachable.ladders, budget, allocator, constraints, windows, scores, smoothed, compensation)


def _baseline_plan(
    lm: LoadedModel,
    table: LossTable,
    problem: PlanningProblem,
    ladders: list[Ladder],
    budget: float,
    allocator: str,
    constraints: Constraints,
    windows: torch.Tensor | None,
    scores: ImportanceScores | None,
    smoothed: bool,
    compensation: str | None,
) -> RatePlan:
    """An off-grid baseline's plan: its ladder steps, fitted to the budget whole unit by whole unit
    (``ladders``: `check_reach`'s, the budget within their reach)."""
    geoms = block_geometries(lm)
    multiple = table.spec.channel_multiple
    criterion = plan_criterion(allocator, table, compensation)
    inputs = BaselineInputs(
        lm=lm,
        criterion=criterion,
        geoms=geoms,
        slots=problem.slots,
        ladders=ladders,
        locked=problem.locked,
        constraints=constraints,
        target=budget * problem.dense_prunable,
        multiple=multiple,
        windows=windows,
        scores=scores if scores is not None and scores.criterion == criterion else None,
        batch_size=table.spec.windows.batch_size,
    )
    baseline: Baseline = ALLOCATORS.function(allocator)
    ladder_steps, wanted = baseline(inputs)
    ladder_steps = fit_to_budget(ladders, ladder_steps, inputs.target, wanted)
    attention, mlp = slot_rates(problem.slots, ladder_rates(ladders, ladder_steps), problem.num_layers)
    return make_plan(
        lm,
        attention,
        mlp,
        criterion,
        multiple,
        allocator=allocator,
        budget=budget,
        predicted_loss=predicted_loss(table, geoms, attention, mlp, smoothed),
        table_key=table.key,
        compensation=compensation,
        biases=adds_biases(compensation),
    )
