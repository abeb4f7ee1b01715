"""Refined loss tables: the gradient estimate, measured exactly where the plans go.

A full exact table measures every cell (about an hour for SmolLM2-135M on 16 x 256 tokens
on two CPU cores); the second-order estimate (``estimate``, fisher) takes one gradient
pass but misprices some cells badly: it calls the attention of several late layers nearly
free, and the DP then takes heads there. Refinement keeps the estimate where no plan goes
and measures exactly where plans do:

1. estimate every cell (fisher, on the table's own windows and importance scores);
2. solve the DP at every budget in view (``spec.refine_budgets``) on the current table:
   measured values where there are some, the estimate elsewhere, smoothed as the planner
   smooths it;
3. measure exactly every chosen cell not measured yet, with the ``refine_neighbours``
   nearest distinct cuts on each side of every chosen one (and, with
   ``refine_attention="all"``, every attention cell in the first round);
4. repeat 2-3 until every chosen cell is measured.

Every round measures at least one new cell, so it stops. Afterwards each budget's DP
plan on the refined table rests on measured cells only; and where a full exact table's
plan at a budget uses only cells measured here too, the two plans have the same exact
summed loss (on raw losses: each plan is optimal on a table that agrees with the exact
one on both plans' cells). Measured cells are saved as they go (``PartialStore``), so a
cancelled build resumes: it recomputes the estimate (the same windows and seed give the
same estimate) and replays the rounds, taking saved values instead of measuring again, so
it makes the same choices as a build that was never interrupted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from gap_engine.core.config import DEFAULT_MAX_RATE, DEFAULT_N_BUCKETS
from gap_engine.core.device import is_streamed
from gap_engine.core.errors import BudgetError
from gap_engine.core.knapsack import constraint_mask, solve_budget
from gap_engine.core.progress import GRADIENT_PASS, active
from gap_engine.tables.artefact import TableSpec, isotonic_smooth, removed_table
from gap_engine.tables.cells import cell_compensation, distinct_cuts, objective_positions, unit_cuts
from gap_engine.tables.estimate import estimate_cells
from gap_engine.tables.exact import dense_state, measure_ledger
from gap_engine.tables.ledger import BuildStats, Cell, CellLedger, CellObjectives, CellRequest, Owner, resumable
from gap_engine.tables.streaming import group_size

log = logging.getLogger(__name__)


def chosen_cells(
    removed: np.ndarray,
    losses: np.ndarray,
    budgets: Iterable[float],
    dense_prunable: int,
    max_rate: float = DEFAULT_MAX_RATE,
    rate_grid: Sequence[float] | None = None,
) -> set[tuple[int, int]]:
    """(component, rate index) of every cell the DP's plans use at the given budgets.

    Args:
        removed: (C, R) parameters each cell removes.
        losses: (C, R) the losses the planner sees.
        budgets: fractions of ``dense_prunable`` to remove; one beyond reach is skipped.
        max_rate, rate_grid: the planner's default rate cap over the table's grid.
    """
    allowed = None if rate_grid is None else constraint_mask(np.asarray(rate_grid), removed.shape[0], max_rate=max_rate)
    out: set[tuple[int, int]] = set()
    for budget in budgets:
        try:
            choice = solve_budget(removed, losses, allowed, removed_params=budget * dense_prunable, n_buckets=DEFAULT_N_BUCKETS)
        except BudgetError:
            log.info("refine: budget %.0f%% is beyond this table's reach; skipped", 100 * budget)
            continue
        out.update((c, int(r)) for c, r in enumerate(choice))
    return out


def neighbour_cells(cells: Iterable[Cell], owner: Owner, n_rates: int, steps: int) -> set[Cell]:
    """The cells measuring the ``steps`` nearest distinct cuts below and above each given cell's.

    Rates that round to the same units share one measured cell (``owner``); neighbours are
    counted in distinct cuts, so a step never lands on the same units again. The dense
    option (no cut) is never a cell to measure.
    """
    out: set[tuple[int, int]] = set()
    if steps < 1:
        return out
    for c, r in cells:
        row = [owner[c, q] for q in range(n_rates)]
        distinct = list(dict.fromkeys(row))  # cuts of the row in rate order; None (dense) first
        at = distinct.index(row[r])
        for other in distinct[max(0, at - steps) : at + steps + 1]:
            if other is not None:
                out.add(other)
    return out


def current_objective(dense: float, estimate: np.ndarray, owner: Owner, measured: dict[Cell, float]) -> np.ndarray:
    """(C, R) objectives: the measured value where a cell's cut was measured, dense + estimate elsewhere."""
    objective = dense + estimate
    for (c, r), source in owner.items():
        if source is None:
            objective[c, r] = dense
        elif source in measured:
            objective[c, r] = measured[source]
    return objective


@dataclass(frozen=True)
class RefineProblem:
    """What the rounds of a refinement decide on (no model: the measuring is a callback)."""

    estimate: np.ndarray  # (C, R) estimated increase over dense
    owner: Owner  # cell -> the cell that measures its cut (None: removes nothing)
    removed: np.ndarray  # (C, R) parameters each cell removes
    dense_prunable: int  # prunable parameters of the dense model
    kinds: tuple[str, ...]  # component kind per row ("attn", "mlp", "block")
    dense: float  # the dense objective measured cells are compared with


def refinement_rounds(
    problem: RefineProblem, spec: TableSpec, measure: Callable[[list[Cell], dict[Cell, float]], None]
) -> tuple[dict[Cell, float], int]:
    """Run the rounds (steps 2-4 of the module docstring) until every chosen cell is measured.

    Args:
        problem: the estimate and the table's geometry.
        spec: budgets in view, neighbours, attention and the rate grid.
        measure: called with the cells to measure this round (sorted) and the dict of
            measured values, which it fills (cell -> objective per counted position).
    Returns:
        (cell -> measured objective, rounds run).
    """
    measured: dict[tuple[int, int], float] = {}
    cells = {source for source in problem.owner.values() if source is not None}
    first = {cell for cell in cells if problem.kinds[cell[0]] == "attn"} if spec.refine_attention == "all" else set()
    rounds = 0
    while True:
        losses = isotonic_smooth(current_objective(problem.dense, problem.estimate, problem.owner, measured) - problem.dense)
        chosen = chosen_cells(problem.removed, losses, spec.refine_budgets, problem.dense_prunable, rate_grid=spec.rate_grid)
        missing = {source for cell in chosen if (source := problem.owner[cell]) is not None} - measured.keys()
        wanted = missing | (first if rounds == 0 else set())
        if not wanted - measured.keys():
            return measured, rounds
        wanted |= neighbour_cells(chosen, problem.owner, len(spec.rate_grid), spec.refine_neighbours)
        rounds += 1
        todo = sorted(wanted - measured.keys())
        log.info("refine round %d: %d chosen cells unmeasured, measuring %d cells", rounds, len(missing), len(todo))
        measure(todo, measured)


def refine_cells(request: CellRequest) -> CellObjectives:
    """The ``refine`` estimator's filler (``ledger.CellFiller``): estimate, then measure exactly
    where the DP's plans go, until they rest on measured cells.

    Args:
        request: what to fill; the active stage enters the gradient pass and gets progress
            (done, total, eta) in it: the estimate's batches first, then cells measured and
            planned so far (the total grows when a round adds cells; one stage throughout). Each round's cells are
            measured through a ``ledger.CellLedger`` that holds every round's cells.
    Returns:
        every cell's objective, ``measured`` where measured and ``estimate`` the estimate of
        delta the build started from.
    """
    lm, spec, windows, scores, components = request.lm, request.spec, request.windows, request.scores, request.components
    partial = request.partial
    active().enter(GRADIENT_PASS)
    started = time.perf_counter()
    # the estimate knows nothing of compensation: only the measured cells include it
    est_objective, est_dense, _ = estimate_cells(lm, replace(spec, estimator="fisher", compensation="none"), windows, scores, components)
    estimate = est_objective - est_dense
    estimate[:, 0] = 0.0
    estimate_seconds = time.perf_counter() - started
    jobs, owner = distinct_cuts(unit_cuts(lm, scores, components, spec.rate_grid, spec.channel_multiple))
    job_of = {(c, r): (c, r, cut) for c, r, cut in jobs}
    units = {(c, r): cut.units_key for c, r, cut in jobs}
    removed, dense_prunable = removed_table(lm, components, spec.rate_grid, spec.channel_multiple)
    state = dense_state(lm, windows, spec.windows.batch_size, (spec.objective,))
    per_group = group_size(windows.numel(), lm) if is_streamed(lm) else 1  # streamed cells per visit of the blocks, sized once
    positions = objective_positions(windows, spec.objective, state.start)
    dense = state.objective_sum / positions if spec.objective == "nll" else 0.0
    # A resumed build replays the rounds: a round's cells come from ``stored`` when the
    # cancelled build had measured them, so the same choices follow as without the break.
    stored = resumable(partial.load(), units) if partial is not None else {}
    resumed = 0

    def measure(todo: list[Cell], measured: dict[Cell, float]) -> None:
        nonlocal resumed
        reused = {cell: stored[cell] for cell in todo if cell in stored}
        measured.update(reused)
        resumed += len(reused)
        jobs_left = [job_of[cell] for cell in todo if cell not in reused]
        ledger = CellLedger(lm, jobs_left, partial, measured, units)
        measure_ledger(lm, state, ledger, spec.objective, positions, cell_compensation(spec), per_group)

    problem = RefineProblem(estimate, owner, removed, dense_prunable, tuple(kind for _, kind in components), dense)
    measured, rounds = refinement_rounds(problem, spec, measure)
    objective = current_objective(dense, estimate, owner, measured)
    is_measured = np.array(
        [[owner[c, r] is None or owner[c, r] in measured for r in range(len(spec.rate_grid))] for c in range(len(components))]
    )
    stats: BuildStats = {
        "cells_measured": len(measured) - resumed,
        "cells_resumed": resumed,
        "distinct_cells": len(jobs),
        "refined_cells": len(measured),
        "refine_rounds": rounds,
        "estimate_seconds": round(estimate_seconds, 3),
    }
    log.info("refined table: %d of %d distinct cells measured in %d rounds", len(measured), len(jobs), rounds)
    return CellObjectives(objective, dense, stats, is_measured, estimate)
