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
from dataclasses import dataclass
from typing import Any

import numpy as np

from gap_engine.core.errors import BudgetError, InvariantError, PlanError
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan, make_plan
from gap_engine.model.units import ComponentGeometry, block_geometries, channels_for_rate
from gap_engine.plan.allocators import plan_from_table
from gap_engine.plan.problem import Constraints
from gap_engine.plan.step import plan_criterion
from gap_engine.prune.compensations import adds_biases
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


def row_plan(lm: LoadedModel, table: LossTable, row: dict[str, Any], compensation: str | None = None) -> RatePlan:
    """The DP plan of one front row: the row's own rates, budget and predicted loss.

    Args:
        lm: the dense LoadedModel the table was built for (its geometry counts parameters).
        table: the LossTable behind the front.
        row: one row of `front.front_rows` for ``table``.
        compensation: the compensation the front was charged for (a COMPENSATIONS name; the
            row's removal is then net of its biases), recorded in the plan so its counts
            include those biases; None: an uncharged front.
    Returns:
        A validated RatePlan (allocator ``dp``) whose removal net of its biases is exactly
        ``row["removed"]``.
    Raises:
        PlanError: the model's geometry counts a different removal than the table's cells
            (the table was measured on another geometry).
    """
    plan = make_plan(
        lm,
        row["attention_rates"],
        row["mlp_rates"],
        plan_criterion("dp", table, compensation),
        table.spec.channel_multiple,
        allocator="dp",
        budget=float(row["budget"]),
        predicted_loss=float(row["predicted_loss"]),
        table_key=table.key,
        compensation=compensation,
        biases=adds_biases(compensation),
    )
    net = int(plan.params["removed"]) - int(plan.params.get("bias_params", 0))
    if net != int(row["removed"]):
        raise PlanError(
            f"the model's geometry removes {net:,} parameters net of biases for this front row, "
            f"the table says {int(row['removed']):,}: the table was measured on another geometry"
        )
    return plan


def net_removed_fraction(plan: RatePlan) -> float:
    """What ``plan`` removes of the prunable parameters net of the biases it was counted for
    (the fraction a front row's ``budget`` is)."""
    params = plan.params
    return (int(params["removed"]) - int(params.get("bias_params", 0))) / int(params["dense_prunable"])


def uniform_line(
    lm: LoadedModel,
    table: LossTable,
    constraints: Constraints,
    top: float,
    step: float = UNIFORM_STEP,
    extra: Sequence[float] = (),
    compensation: str | None = None,
) -> list[dict[str, Any]]:
    """Exact uniform plans along the budget axis, scored by the table like the baselines.

    Args:
        lm: the dense LoadedModel (geometry only: no forward pass).
        table: the LossTable.
        constraints: problem.Constraints (locks and the max rate hold for uniform too).
        top: the largest budget to try (the front's top, say).
        step: budget spacing of the plans.
        extra: more budgets to include (those of baseline markers, so they lie on the line).
        compensation: the one the prune applies; one that adds biases has them paid from each
            budget, and ``removed_fraction`` is net of them, as a charged front's budgets are.
    Returns:
        Rows ``budget``, ``removed_fraction`` (of prunable), ``predicted_loss``, sorted by
        removed fraction; budgets uniform cannot reach under the constraints are left out.
    """
    budgets = sorted({round(float(b), 6) for b in np.arange(0.0, top + 1e-9, step)} | {round(float(b), 6) for b in extra if 0 <= b <= top})
    rows = []
    for budget in budgets:
        try:
            plan = plan_from_table(lm, table, budget, "uniform", constraints, compensation=compensation)
            if plan.predicted_loss is None:
                raise InvariantError("a plan made from a table has no predicted loss")
        except BudgetError as exc:
            log.debug("uniform line stops at %.3f: %s", budget, exc)
            continue
        rows.append(
            {
                "budget": budget,
                "removed_fraction": net_removed_fraction(plan),
                "predicted_loss": float(plan.predicted_loss),
            }
        )
    return sorted(rows, key=lambda r: r["removed_fraction"])


@dataclass(frozen=True)
class RemovedShares:
    """What the rates of a plan really remove, layer by layer: attention rates round to whole
    GQA shapes (a block keeps ``g`` KV groups of ``q`` query heads each) and MLP widths to
    multiples of the channel multiple, so a rate is a request, not what is cut (on SmolLM2,
    attention rate 0.625 removes 2/3 of the layer's attention and 0.125 removes none)."""

    attention: list[float]  # per layer: share of its attention parameters removed
    mlp: list[float]  # per layer: share of its MLP parameters removed
    attention_text: list[str]  # per layer: heads and KV groups kept, the share, the rate asked for
    mlp_text: list[str]  # per layer: channels kept, the share, the rate asked for


def removed_shares(
    counts: Sequence[ComponentGeometry], attention_rates: Sequence[float], mlp_rates: Sequence[float], multiple: int
) -> RemovedShares:
    """`RemovedShares` of one plan's rates on a model's blocks (``units.block_geometries``)."""
    out = RemovedShares([], [], [], [])
    for block, attention_rate, mlp_rate in zip(counts, attention_rates, mlp_rates):
        geometry = block.geometry
        shape = block.attention_shape_at(float(attention_rate))
        share = block.removed_at("attn", float(attention_rate)) / block.params_at("attn", 0.0)
        out.attention.append(share)
        out.attention_text.append(
            f"attention keeps {shape.n_heads} of {geometry.n_heads} query heads "
            f"({shape.kv_groups} of {geometry.n_kv_heads} KV groups): removes {share:.1%} (rate asked {float(attention_rate):g})"
        )
        channels = channels_for_rate(geometry.intermediate_size, float(mlp_rate), multiple)
        share = block.removed_at("mlp", float(mlp_rate), multiple) / block.params_at("mlp", 0.0, multiple)
        out.mlp.append(share)
        out.mlp_text.append(
            f"MLP keeps {channels:,} of {geometry.intermediate_size:,} channels: removes {share:.1%} (rate asked {float(mlp_rate):g})"
        )
    return out


def grid_shares(lm: LoadedModel, table: LossTable) -> list[RemovedShares]:
    """`removed_shares` of every grid rate, one per rate (index k: every layer at ``rate_grid[k]``),
    so a browser can look up what any front row removes from its grid indices."""
    counts = block_geometries(lm)
    return [
        removed_shares(counts, [float(rate)] * lm.num_layers, [float(rate)] * lm.num_layers, table.spec.channel_multiple)
        for rate in table.rate_grid
    ]


def front_row_at(front: Sequence[dict[str, Any]], budget: float) -> dict[str, Any] | None:
    """The optimum of `front.front_rows` for a budget: the first row removing at least it (None past the top)."""
    index = int(np.searchsorted(np.array([row["budget"] for row in front]), budget - 1e-12))
    return front[index] if index < len(front) else None


def baseline_budgets(top_budget: float, n: int = 5, low: float = 0.1, high: float = 0.6) -> list[float]:
    """A few budgets at which to compute baseline plans: ``n`` from ``low`` to ``high`` (or 95% of the reachable top)."""
    return [round(float(b), 3) for b in np.linspace(low, min(high, top_budget * 0.95), n) if b <= top_budget]


# ---- a plan's numbers, from the table alone ---------------------------------------------------
TOLERANCE = 1e-9  # rates closer than this to a grid rate are on it; sums may differ by float noise


def _row_bracket(grid: np.ndarray, rate: float) -> tuple[int, int | None]:
    """(lower, upper) grid indices around ``rate``: equal on the grid; upper None past the last rate."""
    upper = int(np.searchsorted(grid, rate - TOLERANCE))
    if upper < len(grid) and abs(grid[upper] - rate) <= TOLERANCE:
        return upper, upper
    return upper - 1, (upper if upper < len(grid) else None)


def plan_figures(table: LossTable, plan: RatePlan) -> dict[str, Any]:
    """The removal and predicted loss a report may print for ``plan``, recomputed or checked.

    Removal grows with the rate, and so do the smoothed losses, so the cells of the grid rates
    around each of the plan's rates bound what it removes and what the table predicts for it.
    On the grid both are the sums of the plan's own cells; off the grid the plan's recorded
    count and prediction are used only when they lie within those bounds.

    Returns:
        {"removed" (None: off the grid and recorded nowhere), "removed_range" (the fewest and
        most parameters the rates can remove), "budget" (removed, else the range's middle, over
        the table's prunable parameters), "predicted_loss" (None when the plan records none
        and it cannot be summed from the cells)}.
    Raises:
        PlanError: a recorded count or prediction outside what the plan's rates allow in this
            table, or counts for another model.
    """
    grid = np.asarray(table.rate_grid, dtype=np.float64)
    low = high = 0
    losses = {"smoothed": [0.0, 0.0], "raw": [0.0, 0.0]}
    exact = True
    for c, (layer, kind) in enumerate(table.components):
        rates = [plan.mlp_rates[layer]] if kind == "mlp" else [plan.attention_rates[layer]]
        if kind == "block":
            rates.append(plan.mlp_rates[layer])
        brackets = [_row_bracket(grid, float(rate)) for rate in rates]
        lower, upper = min(b[0] for b in brackets), max((b[1] for b in brackets), key=lambda u: len(grid) if u is None else u)
        exact &= lower == upper
        low += int(table.removed[c, lower])
        high += int(table.removed[c, upper]) if upper is not None else table.dense_prunable
        for name, values in (("smoothed", table.losses(True)), ("raw", table.delta)):
            cells = values[c, lower : (len(grid) if upper is None else upper + 1)]
            losses[name][0] += float(cells.min())
            losses[name][1] += float(cells.max()) if upper is not None else np.inf
    recorded = plan.params.get("removed")
    if recorded is not None and not low <= int(recorded) <= high:
        raise PlanError(
            f"the plan says it removes {int(recorded):,} parameters, but its rates remove "
            + (f"{low:,}" if low == high else f"{low:,} to {high:,}")
            + " in this loss table: the plan's numbers contradict its rates"
        )
    if plan.params.get("dense_prunable") not in (None, table.dense_prunable):
        raise PlanError(
            f"the plan counts {int(plan.params['dense_prunable']):,} prunable parameters, the loss table {table.dense_prunable:,}"
        )
    removed = low if exact else None if recorded is None else int(recorded)
    predicted = plan.predicted_loss
    if predicted is not None:
        slack = TOLERANCE * max(1.0, abs(predicted))
        if not any(lo - slack <= predicted <= hi + slack for lo, hi in losses.values()):
            raise PlanError(
                f"the plan predicts a loss increase of {predicted:g}, but its cells in this loss table sum to "
                f"{losses['smoothed'][0]:g}"
                + ("" if exact else f" to {losses['smoothed'][1]:g}")
                + ": the plan's numbers contradict its rates"
            )
    elif exact:
        predicted = losses["smoothed"][0]
    shown = removed if removed is not None else (low + high) / 2
    return {"removed": removed, "removed_range": (low, high), "budget": shown / table.dense_prunable, "predicted_loss": predicted}
