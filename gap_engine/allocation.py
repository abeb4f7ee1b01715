"""Allocation: a loss table and one global budget in, a rate plan out (GAP, EMNLP 2025).

This is the "solve" stage. GAP's own allocation (``dp``) hands the table to the exact
multiple-choice-knapsack DP of ``planner``: one grid rate per component, removing at least
the budget with the least summed table loss. The baselines it is compared against share
the same interface and are held to the same budget, so a comparison isolates *where* the
parameters are taken from (the within-layer criterion, i.e. *which* heads and channels
go, is the table's for every method):

- ``uniform``: one rate r for every component; r by bisection on the exact, unit-rounded
  parameter count, not limited to the grid.
- ``flap``: FLAP's adaptive structure search (An et al., AAAI 2024): unit scores are
  standardised within each layer (per unit type), the globally lowest units go first.
- ``owl``: OWL's outlier-weighted layerwise rates (Yin et al., ICML 2024): layers with
  more activation-weighted outliers (|W| * ||X|| above M times the layer mean) are pruned
  less, rates spread over +-lambda around the mean.
- ``evo``: EvoPress-style search (Sieberling et al., 2024) seeded with the DP plan:
  mutations move one grid step of rate from one component to others at equal budget, and
  candidates are scored by the *true* end-to-end calibration loss, which tests the DP's
  one assumption (that per-component losses add up).

Budgets are fractions of the *prunable* parameters (all attention and MLP projections).
Units are whole heads (GQA-valid) and MLP channels in multiples of ``channel_multiple``,
so no method can hit a budget exactly: ``dp`` removes at least the budget on the table's
grid; ``uniform``/``flap``/``owl`` are settled, whole unit by whole unit, to remove at least
the budget and less than one further unit beyond it.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from .errors import BudgetError, PlanError, TableError
from .evaluate import mean_nll
from .importance import ImportanceScores, compute_importance
from .pipeline import CalibrationSettings
from .plan import RatePlan, make_plan
from .planner import ParetoFront, constraint_mask, solve_budget, solve_front
from .surgery import apply_plan, layer_selection
from .tables import LossTable, masked_units
from .units import AttentionShape, ComponentGeometry, attention_params, block_geometries

log = logging.getLogger(__name__)

METHODS = ("dp", "uniform", "flap", "owl", "evo")
GRID_METHODS = ("dp", "evo")  # plans on the table's rate grid
OWL_OUTLIER_M = 5.0  # OWL's M: an entry is an outlier above M times its layer's mean score
OWL_LAMBDA = 0.08  # OWL's lambda: layer rates spread over [mean - lambda, mean + lambda]
_RATE_TOL = 1e-9
_PARTS = {"attn": ("attn",), "mlp": ("mlp",), "block": ("attn", "mlp")}


# ---- constraints -----------------------------------------------------------------------
@dataclass(frozen=True)
class Constraints:
    """What a plan must respect besides the budget (the same for every method)."""

    locked: Mapping[int, float] = field(default_factory=dict)  # layer -> rate of both its components; negative counts from the end; overrides min/max
    min_rate: float = 0.0  # lowest rate of every unlocked component
    max_rate: float = 0.95  # highest rate of every unlocked component
    coupled: bool = False  # a layer's attention and MLP share one rate (always so with a block-mode table)

    def resolved_locks(self, num_layers: int) -> dict[int, float]:
        """Locks with layer indices in 0..L-1.

        Raises:
            BudgetError: bad bounds, a layer out of range, a rate outside [0, 1), or one
                layer locked at two rates (as -1 and L-1, say).
        """
        for name in ("min_rate", "max_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise BudgetError(f"{name} must be a number in [0, 1), got {value!r}")
        if self.min_rate > self.max_rate + _RATE_TOL:
            raise BudgetError(f"min_rate {self.min_rate:g} is above max_rate {self.max_rate:g}")
        out: dict[int, float] = {}
        for layer, rate in dict(self.locked).items():
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
                raise BudgetError(f"locked layer {layer!r} is not an integer")
            index = int(layer) + num_layers if layer < 0 else int(layer)
            if not 0 <= index < num_layers:
                raise BudgetError(f"locked layer {layer} is out of range for a model with {num_layers} layers")
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
                raise BudgetError(f"layer {layer} is locked at rate {rate!r}, outside [0, 1)")
            if index in out and abs(out[index] - rate) > _RATE_TOL:
                raise BudgetError(f"layer {index} is locked twice, at rates {out[index]:g} and {rate:g}")
            out[index] = float(rate)
        return out


def _check_budget(budget) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise BudgetError(f"budget must be a number, got {budget!r}")
    if not 0.0 <= budget < 1.0:
        raise BudgetError(f"budget {budget:g} is outside [0, 1): it is the fraction of prunable parameters to remove")
    return float(budget)


# ---- the planning problem: slots over the table's grid ---------------------------------
@dataclass(frozen=True)
class PlanningProblem:
    """A table under constraints, as the planner sees it. A slot is what gets one rate:
    a component, or a whole layer when coupled."""

    slots: tuple[tuple[int, str], ...]  # (layer, "attn" | "mlp" | "block") per slot, in layer order
    rate_grid: np.ndarray  # (R,) the table's rates
    costs: np.ndarray  # (S, R) int64 parameters each option removes
    losses: np.ndarray  # (S, R) float64 predicted loss increase of each option
    allowed: np.ndarray  # (S, R) bool options the constraints allow
    locked: dict  # slot index -> locked rate
    num_layers: int  # L
    dense_prunable: int  # prunable parameters of the dense model

    @property
    def coupled(self) -> bool:
        return len(self.slots) == self.num_layers

    def rates(self, choice: Sequence[int]) -> tuple[list[float], list[float]]:
        """(attention_rates, mlp_rates) per layer for one option index per slot."""
        return slot_rates(self.slots, [float(self.rate_grid[int(r)]) for r in choice], self.num_layers)

    def removed(self, choice: Sequence[int]) -> int:
        return int(self.costs[np.arange(len(self.slots)), np.asarray(choice, dtype=np.intp)].sum())

    def loss(self, choice: Sequence[int]) -> float:
        total = 0.0
        for s, r in enumerate(choice):  # summed in slot order, like the DP
            total += float(self.losses[s, int(r)])
        return total

    def reach(self) -> tuple[int, int]:
        """(least, most) parameters a plan on this grid removes under the constraints."""
        low = np.where(self.allowed, self.costs, np.iinfo(np.int64).max).min(axis=1).sum()
        high = np.where(self.allowed, self.costs, -1).max(axis=1).sum()
        return int(low), int(high)


def slot_rates(slots, rates, num_layers: int) -> tuple[list[float], list[float]]:
    """Spread one rate per slot over (attention_rates, mlp_rates); layers without a slot stay 0."""
    attention, mlp = [0.0] * num_layers, [0.0] * num_layers
    for (layer, kind), rate in zip(slots, rates):
        if kind in ("attn", "block"):
            attention[layer] = float(rate)
        if kind in ("mlp", "block"):
            mlp[layer] = float(rate)
    return attention, mlp


def _slots(num_layers: int, coupled: bool) -> tuple[tuple[int, str], ...]:
    kinds = ("block",) if coupled else ("attn", "mlp")
    return tuple((layer, kind) for layer in range(num_layers) for kind in kinds)


def _table_rows(table: LossTable) -> dict[tuple[int, str], int]:
    rows = {(int(layer), str(kind)): i for i, (layer, kind) in enumerate(table.components)}
    kinds = ("block",) if table.spec.mode == "block" else ("attn", "mlp")
    missing = [(layer, kind) for layer in range(table.num_layers) for kind in kinds if (layer, kind) not in rows]
    if missing:
        raise TableError(f"loss table has no row for layer {missing[0][0]} {missing[0][1]}")
    return rows


def planning_problem(table: LossTable, constraints: Constraints = Constraints(), smoothed: bool = True) -> PlanningProblem:
    """The planner's view of ``table`` under ``constraints``.

    A split table planned with ``coupled`` gets one slot per layer whose option r removes
    and costs the sum of the layer's attention and MLP cells at rate r.

    Raises:
        BudgetError: contradictory constraints (see `Constraints.resolved_locks`, and a
            locked rate must be on the table's grid).
        TableError: a table with missing rows.
    """
    num_layers = table.num_layers
    locked_layers = constraints.resolved_locks(num_layers)
    coupled = constraints.coupled or table.spec.mode == "block"
    slots = _slots(num_layers, coupled)
    rows = _table_rows(table)
    table_losses = np.asarray(table.losses(smoothed), dtype=np.float64)
    table_removed = np.asarray(table.removed, dtype=np.int64)
    costs = np.zeros((len(slots), len(table.rate_grid)), dtype=np.int64)
    losses = np.zeros((len(slots), len(table.rate_grid)), dtype=np.float64)
    for s, (layer, kind) in enumerate(slots):
        sources = [rows[(layer, kind)]] if (layer, kind) in rows else [rows[(layer, "attn")], rows[(layer, "mlp")]]
        for row in sources:
            costs[s] += table_removed[row]
            losses[s] += table_losses[row]
    locked = {s: locked_layers[layer] for s, (layer, _) in enumerate(slots) if layer in locked_layers}
    low = np.full(len(slots), constraints.min_rate)
    high = np.full(len(slots), constraints.max_rate)
    for s in locked:  # a lock overrides the bounds
        low[s], high[s] = 0.0, 1.0
    try:
        allowed = constraint_mask(table.rate_grid, len(slots), locked, low, high)
    except BudgetError as exc:
        # The planner numbers components; name the layer instead.
        def slot_name(match):
            layer, kind = slots[int(match.group(1))]
            return f"layer {layer} {kind}"

        raise BudgetError(re.sub(r"^component (\d+)", slot_name, str(exc))) from None
    return PlanningProblem(
        slots=slots,
        rate_grid=np.asarray(table.rate_grid, dtype=np.float64),
        costs=costs,
        losses=losses,
        allowed=allowed,
        locked=locked,
        num_layers=num_layers,
        dense_prunable=int(table.dense_prunable),
    )


def _reach_error(method: str, budget: float, low: int, high: int, dense: int) -> BudgetError:
    return BudgetError(
        f"budget {budget:.1%} is out of reach for {method}: under these constraints plans remove "
        f"{low / dense:.1%} to {high / dense:.1%} of the prunable parameters ({low:,} to {high:,})"
    )


# ---- the DP: front and single budget ----------------------------------------------------
def dp_front(
    table: LossTable, constraints: Constraints = Constraints(), n_buckets: int = 4096, smoothed: bool = True
) -> ParetoFront:
    """The optimum for every budget at once (the app's budget slider reads it via `front_rows`).

    Args:
        table: the loss table.
        constraints: locks, rate bounds, coupling.
        n_buckets: budget resolution of the DP.
        smoothed: plan on the table's smoothed losses (else on the raw deltas).
    Returns:
        The planner's ParetoFront; its ``choices`` index the table's rate grid per slot,
        one slot per component (2L columns) or per layer when coupled (L columns):
        `choice_rates` turns a row into per-layer rates.
    """
    problem = planning_problem(table, constraints, smoothed)
    return solve_front(problem.costs, problem.losses, problem.allowed, n_buckets)


def choice_rates(table: LossTable, choice: Sequence[int]) -> tuple[list[float], list[float]]:
    """(attention_rates, mlp_rates) for a row of a `dp_front` (L columns: coupled; 2L: split)."""
    coupled = len(choice) == table.num_layers
    if not coupled and len(choice) != 2 * table.num_layers:
        raise BudgetError(f"a choice for {table.num_layers} layers has {table.num_layers} or {2 * table.num_layers} entries, got {len(choice)}")
    slots = _slots(table.num_layers, coupled)
    return slot_rates(slots, [float(table.rate_grid[int(r)]) for r in choice], table.num_layers)


def front_rows(table: LossTable, front: ParetoFront) -> list[dict]:
    """The Pareto front as rows, one per distinct optimum, by increasing removal.

    Each row: ``budget`` (fraction of prunable parameters removed), ``removed``,
    ``predicted_loss`` (summed table loss), ``attention_rates`` and ``mlp_rates`` (per
    layer). Removal strictly increases and loss never decreases from row to row; rows a
    previous row dominates (removes as much for no more loss) are left out, so for a
    budget b the first row with ``budget >= b`` is its optimum.
    """
    rows: list[dict] = []
    best_removed = -1
    for b in range(len(front.budgets)):
        removed = int(front.removed[b])
        if not np.isfinite(front.best_loss[b]) or removed <= best_removed:
            continue
        best_removed = removed
        attention, mlp = choice_rates(table, front.choices[b])
        rows.append(
            {
                "budget": removed / table.dense_prunable,
                "removed": removed,
                "predicted_loss": float(front.best_loss[b]),
                "attention_rates": attention,
                "mlp_rates": mlp,
            }
        )
    return rows


def front_csv(rows: list[dict]) -> str:
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


def _dp_choice(problem: PlanningProblem, budget: float, n_buckets: int) -> np.ndarray:
    low, high = problem.reach()
    target = budget * problem.dense_prunable
    if target > high:
        raise _reach_error("dp", budget, low, high, problem.dense_prunable)
    return solve_budget(problem.costs, problem.losses, problem.allowed, removed_params=target, n_buckets=n_buckets)


# ---- predicted loss of any plan -----------------------------------------------------------
def _interp_row(removed_row: np.ndarray, loss_row: np.ndarray, removed: float) -> float:
    """Loss at ``removed`` parameters, linear between the row's cells (and past its last one)."""
    xp, first = np.unique(np.asarray(removed_row, dtype=np.float64), return_index=True)
    fp = np.asarray(loss_row, dtype=np.float64)[first]
    if len(xp) == 1 or removed <= xp[-1]:
        return float(np.interp(removed, xp, fp))
    slope = (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    return float(fp[-1] + slope * (removed - xp[-1]))


def predicted_loss(table: LossTable, geometries: Sequence[ComponentGeometry], attention_rates, mlp_rates, smoothed: bool = True) -> float:
    """Summed table loss of a plan; between grid rates the table is read linearly.

    Each table row is read at the parameters the plan removes from that component (a
    block row: from the whole layer), so rates that round to the same units read the same
    cell, and an on-grid plan reads exactly its cells. Past the grid's last rate the row's
    last segment is extended.
    """
    losses = table.losses(smoothed)
    multiple = table.spec.channel_multiple
    rates = {"attn": attention_rates, "mlp": mlp_rates}
    total = 0.0
    for row, (layer, kind) in enumerate(table.components):
        removed = sum(geometries[layer].removed_at(part, rates[part][layer], multiple) for part in _PARTS[kind])
        total += _interp_row(table.removed[row], losses[row], removed)
    return total


# ---- ladders: every unit-exact rate of a slot, for the off-grid baselines ------------------
@dataclass(frozen=True)
class _Ladder:
    """The distinct unit-rounded shapes a slot may take, by increasing removal."""

    rates: np.ndarray  # (K,) a rate that rounds to each shape
    removed: np.ndarray  # (K,) int64 parameters removed, strictly increasing
    dense: int  # the slot's dense parameters


def _attention_fractions(geom: ComponentGeometry) -> list[float]:
    g = geom.geometry
    full = attention_params(g, geom.hidden, AttentionShape(g.n_kv_heads, g.group_size), geom.qkv_bias, geom.o_bias)
    return [
        1.0 - attention_params(g, geom.hidden, AttentionShape(kv, q), geom.qkv_bias, geom.o_bias) / full
        for kv in range(1, g.n_kv_heads + 1)
        for q in range(1, g.group_size + 1)
    ]


def _mlp_fractions(geom: ComponentGeometry, multiple: int) -> list[float]:
    width = geom.geometry.intermediate_size
    step = max(1, min(multiple, width))
    return [0.0] + [1.0 - kept / width for kept in range(step, width, step)]


def _ladders(geoms, slots, locked: dict, constraints: Constraints, multiple: int) -> list[_Ladder]:
    out = []
    for s, (layer, kind) in enumerate(slots):
        geom = geoms[layer]
        parts = _PARTS[kind]
        dense = sum(geom.params_at(part, 0.0, multiple) for part in parts)
        if s in locked:
            candidates = [locked[s]]
        else:
            candidates = {0.0}
            if "attn" in parts:
                candidates.update(_attention_fractions(geom))
            if "mlp" in parts:
                candidates.update(_mlp_fractions(geom, multiple))
            candidates = [
                r for r in candidates if constraints.min_rate - _RATE_TOL <= r <= constraints.max_rate + _RATE_TOL
            ]
        by_removed: dict[int, float] = {}
        for rate in sorted(candidates):
            removed = sum(geom.removed_at(part, rate, multiple) for part in parts)
            by_removed.setdefault(removed, rate)
        if not by_removed:
            raise BudgetError(
                f"layer {layer} {kind} has no unit-exact rate within [{constraints.min_rate:g}, {constraints.max_rate:g}]"
            )
        removed = np.array(sorted(by_removed), dtype=np.int64)
        out.append(_Ladder(np.array([by_removed[int(r)] for r in removed]), removed, dense))
    return out


def _nearest_rungs(ladders: list[_Ladder], wanted_removed: np.ndarray) -> np.ndarray:
    return np.array([int(np.argmin(np.abs(ladder.removed - w))) for ladder, w in zip(ladders, wanted_removed)], dtype=np.intp)


def _settle(ladders: list[_Ladder], rungs: np.ndarray, target: float, wanted_removed: np.ndarray | None = None) -> np.ndarray:
    """Move slots one rung at a time until the plan removes at least ``target`` and less
    than one further rung beyond it.

    Up: finest steps first (ties: the slot furthest below what it wanted), each slot once
    per pass. Down: the largest step that keeps the budget met (ties: furthest above what
    it wanted), each slot once per pass, until no step fits. The final surplus is smaller
    than every slot's next step down, e.g. one group of ``channel_multiple`` MLP channels.
    """
    rungs = rungs.copy()
    wanted = np.zeros(len(ladders)) if wanted_removed is None else np.asarray(wanted_removed, dtype=np.float64)
    removed = sum(int(l.removed[k]) for l, k in zip(ladders, rungs))

    def now(s):
        return int(ladders[s].removed[rungs[s]])

    while removed < target:
        ups = [
            (int(ladders[s].removed[rungs[s] + 1]) - now(s), -(wanted[s] - now(s)), s)
            for s in range(len(ladders))
            if rungs[s] + 1 < len(ladders[s].removed)
        ]
        if not ups:
            raise BudgetError(f"cannot remove {target:,.0f} parameters within these constraints")
        for step, _, s in sorted(ups):
            rungs[s] += 1
            removed += step
            if removed >= target:
                break
    lowered_any = True
    while lowered_any:
        lowered_any, moved = False, set()
        while True:
            downs = [
                (now(s) - int(ladders[s].removed[rungs[s] - 1]), now(s) - wanted[s], s)
                for s in range(len(ladders))
                if rungs[s] > 0 and s not in moved
            ]
            fitting = [d for d in downs if removed - d[0] >= target]
            if not fitting:
                break
            step, _, s = max(fitting)
            rungs[s] -= 1
            removed -= step
            moved.add(s)
            lowered_any = True
    return rungs


def _ladder_removed(ladders, rungs) -> int:
    return int(sum(int(l.removed[k]) for l, k in zip(ladders, rungs)))


def _ladder_rates(ladders, rungs) -> list[float]:
    return [float(l.rates[k]) for l, k in zip(ladders, rungs)]


def _ladder_reach(method: str, budget: float, ladders, dense: int) -> None:
    low = sum(int(l.removed[0]) for l in ladders)
    high = sum(int(l.removed[-1]) for l in ladders)
    if budget * dense > high:
        raise _reach_error(method, budget, low, high, dense)


def _rungs_at_rates(geoms, slots, ladders, rates, multiple) -> np.ndarray:
    """Rung of each slot that units rounding gives at the given rates (clamped to the ladder)."""
    wanted = np.array(
        [sum(geoms[layer].removed_at(p, float(r), multiple) for p in _PARTS[kind]) for (layer, kind), r in zip(slots, rates)],
        dtype=np.float64,
    )
    return _nearest_rungs(ladders, wanted)


# ---- baselines ---------------------------------------------------------------------------
def _smallest_meeting(meets, low: float, high: float, steps: int = 60) -> float:
    """Bisection: the smallest x in (low, high] with meets(x), given meets(high) and not meets(low)."""
    for _ in range(steps):
        mid = 0.5 * (low + high)
        if meets(mid):
            high = mid
        else:
            low = mid
    return high


def _uniform_rates(geoms, slots, ladders, locked, constraints, target, multiple) -> tuple[np.ndarray, float]:
    """The smallest common rate (bisection) whose unit-rounded plan removes the target."""

    def rungs_at(rate):
        rates = [locked.get(s, rate) for s in range(len(slots))]
        return _rungs_at_rates(geoms, slots, ladders, rates, multiple)

    low, high = constraints.min_rate, constraints.max_rate
    if _ladder_removed(ladders, rungs_at(high)) < target:
        return rungs_at(high), high
    if _ladder_removed(ladders, rungs_at(low)) >= target:
        return rungs_at(low), low
    high = _smallest_meeting(lambda rate: _ladder_removed(ladders, rungs_at(rate)) >= target, low, high)
    return rungs_at(high), high


def _standardised(scores: torch.Tensor) -> np.ndarray:
    values = scores.detach().double().cpu().numpy()
    std = values.std()
    return (values - values.mean()) / (std if std > 0 else 1.0)


def _flap_wanted(geoms, slots, ladders, locked, scores: ImportanceScores, target: float, max_rate: float) -> np.ndarray:
    """Per-slot parameters FLAP's global threshold removes (before unit rounding).

    Scores are z-scored within each layer and unit type; units then go globally, lowest
    first, until the target is met, a slot never past ``max_rate`` of its parameters. A
    head costs its q/o slice plus its share of its group's k/v; a channel its gate/up/down
    column, 3 * hidden.
    """
    z_parts, unit_params, unit_slot = [], [], []
    fixed = 0
    for s, (layer, kind) in enumerate(slots):
        if s in locked:
            fixed += int(ladders[s].removed[0])
            continue
        geom = geoms[layer]
        g = geom.geometry
        if kind in ("attn", "block"):
            z = _standardised(scores.layers[layer].head)  # (H,)
            per_head = 2 * geom.hidden * g.head_dim * (1.0 + 1.0 / g.group_size)
            z_parts.append(z)
            unit_params.append(np.full(len(z), per_head))
            unit_slot.append(np.full(len(z), s))
        if kind in ("mlp", "block"):
            z = _standardised(scores.layers[layer].channel)  # (I,)
            z_parts.append(z)
            unit_params.append(np.full(len(z), 3.0 * geom.hidden))
            unit_slot.append(np.full(len(z), s))
    wanted = np.zeros(len(slots))
    for s in locked:
        wanted[s] = ladders[s].removed[0]
    if not z_parts:
        return wanted
    z_all = np.concatenate(z_parts)
    params_all = np.concatenate(unit_params)
    slot_all = np.concatenate(unit_slot).astype(np.intp)
    cap = np.array([max_rate * ladder.dense for ladder in ladders])
    need = target - fixed
    for u in np.argsort(z_all, kind="stable"):
        if need <= 0:
            break
        s = slot_all[u]
        if wanted[s] + params_all[u] > cap[s] + 1e-6:
            continue
        wanted[s] += params_all[u]
        need -= params_all[u]
    return wanted


@torch.no_grad()
def outlier_ratios(lm, windows: torch.Tensor, m: float = OWL_OUTLIER_M, batch_size: int = 4) -> np.ndarray:
    """OWL's layerwise outlier ratio D_l: the share of a layer's |W| * ||X|| entries above
    ``m`` times their mean, over all seven projections of the layer.

    Args:
        lm: the dense LoadedModel.
        windows: (N, T) calibration token ids.
        m: the outlier multiple (OWL's M).
    Returns:
        (L,) float64 ratios in [0, 1].
    """
    layers = list(lm.adapter.layers(lm.model))
    sums: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def accumulate(key):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()  # (B*T, in)
            sums[key] = sums.get(key, 0) + (x * x).sum(0)

        return hook

    for i, layer in enumerate(layers):
        q, _, _, o = lm.adapter.attention_projections(layer)
        gate, _, down = lm.adapter.mlp_projections(layer)
        for name, linear in (("qkv", q), ("o", o), ("gate_up", gate), ("down", down)):
            handles.append(linear.register_forward_pre_hook(accumulate((i, name))))
    try:
        for start in range(0, windows.shape[0], batch_size):
            lm.model(input_ids=windows[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    ratios = np.zeros(len(layers))
    for i, layer in enumerate(layers):
        q, k, v, o = lm.adapter.attention_projections(layer)
        gate, up, down = lm.adapter.mlp_projections(layer)
        metrics = []
        for linears, key in (((q, k, v), "qkv"), ((o,), "o"), ((gate, up), "gate_up"), ((down,), "down")):
            norm = sums[(i, key)].sqrt()  # (in,)
            for linear in linears:
                metrics.append((linear.weight.detach().double().abs() * norm[None, :]).reshape(-1))  # (out*in,)
        metric = torch.cat(metrics)
        ratios[i] = float((metric > m * metric.mean()).double().mean())
    return ratios


def owl_offsets(ratios: np.ndarray, lam: float = OWL_LAMBDA) -> np.ndarray:
    """Per-layer rate offsets around the mean rate: more outliers, less pruning.

    The ratios are scaled to [0, 2*lambda] and centred; offset_l = mean - scaled_l.
    """
    ratios = np.asarray(ratios, dtype=np.float64)
    spread = ratios.max() - ratios.min()
    scaled = np.zeros_like(ratios) if spread <= 0 else (ratios - ratios.min()) / spread * (2.0 * lam)
    return scaled.mean() - scaled


def _owl_rates(geoms, slots, ladders, locked, constraints, offsets, target, multiple) -> np.ndarray:
    """Rungs at rates clip(t + offset_l) with the smallest shift t (bisection) that meets the target."""

    def rungs_at(shift):
        rates = [
            locked.get(s, float(np.clip(shift + offsets[layer], constraints.min_rate, constraints.max_rate)))
            for s, (layer, _) in enumerate(slots)
        ]
        return _rungs_at_rates(geoms, slots, ladders, rates, multiple)

    low, high = constraints.min_rate - offsets.max() - 1e-6, constraints.max_rate - offsets.min() + 1e-6
    if _ladder_removed(ladders, rungs_at(low)) >= target:
        return rungs_at(low)
    return rungs_at(_smallest_meeting(lambda shift: _ladder_removed(ladders, rungs_at(shift)) >= target, low, high))


# ---- evaluation by masking (for evo) ---------------------------------------------------------
@contextlib.contextmanager
def masked_plan(lm, attention_rates, mlp_rates, scores: ImportanceScores, channel_multiple: int):
    """Temporarily zero every unit a plan removes, on the dense model itself.

    Units are chosen exactly as surgery chooses them, and zeroing a head's ``o_proj``
    columns and a channel's ``down_proj`` column gives the sliced model's output (see
    ``tables.masked_units``); weights are restored exactly on exit.
    """
    layers = lm.adapter.layers(lm.model)
    with contextlib.ExitStack() as stack:
        for i, layer in enumerate(layers):
            if attention_rates[i] <= 0 and mlp_rates[i] <= 0:
                continue
            geom = lm.adapter.geometry(layer)
            _, kept_heads, kept_channels = layer_selection(
                lm.adapter, layer, scores.layers[i], attention_rates[i], mlp_rates[i], channel_multiple
            )
            heads = tuple(sorted(set(range(geom.n_heads)) - set(kept_heads)))
            channels = tuple(sorted(set(range(geom.intermediate_size)) - set(kept_channels)))
            stack.enter_context(masked_units(lm.adapter, layer, heads, channels))
        yield


@dataclass(frozen=True)
class EvoSettings:
    """How long the evolutionary refinement searches."""

    generations: int = 4  # rounds of mutation and selection
    offspring: int = 4  # candidates per round, each one mutation away from the best so far
    seed: int = 0  # seed of the mutations
    n_samples: int | None = None  # calibration windows that score a candidate (None: all of calib's)
    min_improvement: float = 1e-4  # nats per token a candidate must gain to replace the best


@dataclass
class EvoResult:
    """An evolved plan and what the search found about the additive-loss assumption."""

    plan: RatePlan  # the best plan found (the DP seed when nothing beat it)
    seed_plan: RatePlan  # the DP plan it started from
    dense_loss: float  # calibration NLL of the dense model on the scoring windows
    seed_predicted: float  # the table's summed loss of the seed
    seed_actual: float  # true calibration loss increase of the seed
    predicted: float  # the table's summed loss of the result
    actual: float  # true calibration loss increase of the result
    evaluations: int  # distinct plans scored end to end
    history: list[float] = field(default_factory=list)  # best actual increase after each generation

    @property
    def assumption_gap(self) -> float:
        """How far the summed-loss prediction was from the truth for the DP plan."""
        return self.seed_actual - self.seed_predicted

    @property
    def gain(self) -> float:
        """True calibration loss the search recovered over the DP plan (>= 0)."""
        return self.seed_actual - self.actual


def _neighbour(allowed_row: np.ndarray, r: int, direction: int) -> int | None:
    options = np.flatnonzero(allowed_row)
    later = options[options > r] if direction > 0 else options[options < r][::-1]
    return int(later[0]) if len(later) else None


def _mutate(problem: PlanningProblem, choice: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray | None:
    """Move rate between slots at equal budget, one grid step at a time.

    A random slot steps down one grid rate; random other slots step up one until the
    budget is met again; then random slots (not those just moved) step down while the
    budget still holds, so the candidate stays close to the budget. None when no slot
    can move.
    """
    n_slots = len(problem.slots)
    downs = [s for s in range(n_slots) if _neighbour(problem.allowed[s], int(choice[s]), -1) is not None]
    if not downs:
        return None
    new = choice.copy()
    first = int(rng.choice(downs))
    new[first] = _neighbour(problem.allowed[first], int(new[first]), -1)
    removed = problem.removed(new)
    moved = {first}
    while removed < target:
        ups = [s for s in range(n_slots) if s != first and _neighbour(problem.allowed[s], int(new[s]), +1) is not None]
        if not ups:
            return None
        up = int(rng.choice(ups))
        step_to = _neighbour(problem.allowed[up], int(new[up]), +1)
        removed += int(problem.costs[up, step_to] - problem.costs[up, new[up]])
        new[up] = step_to
        moved.add(up)
    for s in rng.permutation(n_slots):
        if int(s) in moved:
            continue
        down = _neighbour(problem.allowed[s], int(new[s]), -1)
        if down is not None and removed - int(problem.costs[s, new[s]] - problem.costs[s, down]) >= target:
            removed -= int(problem.costs[s, new[s]] - problem.costs[s, down])
            new[s] = down
    return None if np.array_equal(new, choice) else new


def evolve(
    lm,
    table: LossTable,
    budget: float,
    constraints: Constraints = Constraints(),
    calib: CalibrationSettings | None = None,
    scores: ImportanceScores | None = None,
    settings: EvoSettings = EvoSettings(),
    n_buckets: int = 4096,
    smoothed: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> EvoResult:
    """EvoPress-style refinement of the DP plan, scored by true calibration loss.

    Every candidate stays on the table's grid and removes at least the budget; it is
    scored by masking its units on ``lm`` (restored afterwards) and measuring the mean
    NLL on the calibration windows. A (1 + offspring) search keeps the best; the DP seed
    is only replaced by a candidate better by ``min_improvement``, so the result is never
    worse than the seed on these windows.
    """
    from .data import calibration_windows

    table.check_model(lm)
    budget = _check_budget(budget)
    calib = calib or calibration_for(table)
    problem = planning_problem(table, constraints, smoothed)
    target = budget * problem.dense_prunable
    seed_choice = _dp_choice(problem, budget, n_buckets)
    windows = calibration_windows(lm.tokenizer, calib.data, calib.n_samples, calib.seq_len, calib.seed)
    if scores is None:
        scores = compute_importance(lm, windows, table.spec.criterion, calib.batch_size)
    if settings.n_samples is not None:
        windows = windows[: settings.n_samples]
    multiple = table.spec.channel_multiple
    dense_loss = mean_nll(lm, windows, calib.batch_size)
    seen: dict[tuple, float] = {}

    def true_increase(choice: np.ndarray) -> float:
        key = tuple(int(r) for r in choice)
        if key not in seen:
            attention, mlp = problem.rates(choice)
            with masked_plan(lm, attention, mlp, scores, multiple):
                seen[key] = mean_nll(lm, windows, calib.batch_size) - dense_loss
        return seen[key]

    rng = np.random.default_rng(settings.seed)
    best, best_loss = seed_choice.copy(), true_increase(seed_choice)
    seed_actual = best_loss
    history = []
    for generation in range(settings.generations):
        candidates = [c for c in (_mutate(problem, best, target, rng) for _ in range(settings.offspring)) if c is not None]
        scored = [(true_increase(c), i) for i, c in enumerate(candidates)]
        if scored:
            loss, i = min(scored)
            if loss < best_loss - settings.min_improvement:
                best, best_loss = candidates[i], loss
        history.append(best_loss)
        log.info("evo generation %d/%d: best calibration loss increase %.5f", generation + 1, settings.generations, best_loss)
        if progress:
            progress(generation + 1, settings.generations)

    seed_plan = _grid_plan(lm, table, problem, seed_choice, budget, "dp")
    plan = _grid_plan(lm, table, problem, best, budget, "evo")
    result = EvoResult(
        plan=plan,
        seed_plan=seed_plan,
        dense_loss=dense_loss,
        seed_predicted=problem.loss(seed_choice),
        seed_actual=seed_actual,
        predicted=problem.loss(best),
        actual=best_loss,
        evaluations=len(seen),
        history=history,
    )
    log.info(
        "evo: DP predicted %.4f, DP actual %.4f, evo actual %.4f (%d plans scored)",
        result.seed_predicted, result.seed_actual, result.actual, result.evaluations,
    )
    return result


# ---- the entry point --------------------------------------------------------------------------
def calibration_for(table: LossTable) -> CalibrationSettings:
    """The table's own calibration windows (so unit choices match what it measured)."""
    spec = table.spec
    return CalibrationSettings(
        data=spec.data, n_samples=spec.n_samples, seq_len=spec.seq_len, seed=spec.seed, batch_size=spec.batch_size
    )


def check_budget(lm, table: LossTable, budget: float, method: str = "dp", constraints: Constraints = Constraints()) -> None:
    """Raise what `plan_from_table` would raise for this budget, without its slow part.

    Raises:
        BudgetError: a budget outside [0, 1) or beyond the reach of ``method`` under
            ``constraints`` (the message gives the reachable range); contradictory constraints.
        PlanError: an unknown method.
    """
    if method not in METHODS:
        raise PlanError(f"unknown allocation method '{method}'; choose one of {', '.join(METHODS)}")
    budget = _check_budget(budget)
    problem = planning_problem(table, constraints)
    if method in GRID_METHODS:
        low, high = problem.reach()
        if budget * problem.dense_prunable > high:
            raise _reach_error(method, budget, low, high, problem.dense_prunable)
        return
    ladders = _ladders(block_geometries(lm), problem.slots, problem.locked, constraints, table.spec.channel_multiple)
    _ladder_reach(method, budget, ladders, problem.dense_prunable)


def _grid_plan(lm, table: LossTable, problem: PlanningProblem, choice, budget: float, method: str) -> RatePlan:
    attention, mlp = problem.rates(choice)
    return make_plan(
        lm,
        attention,
        mlp,
        table.spec.criterion,
        table.spec.channel_multiple,
        method=method,
        budget=budget,
        predicted_loss=problem.loss(choice),
        table_key=table.key,
    )


def plan_from_table(
    lm,
    table: LossTable,
    budget: float,
    method: str = "dp",
    constraints: Constraints = Constraints(),
    scores: ImportanceScores | None = None,
    calib: CalibrationSettings | None = None,
    evo: EvoSettings = EvoSettings(),
    n_buckets: int = 4096,
    smoothed: bool = True,
) -> RatePlan:
    """A rate plan for ``lm`` removing ``budget`` of its prunable parameters.

    Args:
        lm: the dense LoadedModel the table was built for (its geometry counts the
            parameters; flap/owl/evo also read its weights or run it).
        table: its loss table.
        budget: fraction of prunable parameters to remove, in [0, 1).
        method: one of METHODS.
        constraints: locks, rate bounds, coupling (every method honours them).
        scores: importance scores of the table's criterion for flap/evo (computed on
            ``calib`` when None).
        calib: calibration windows for flap/owl/evo; None: the table's own.
        evo: search settings of ``evo``.
        n_buckets: DP budget resolution.
        smoothed: plan on the smoothed table (else the raw deltas).
    Returns:
        A validated RatePlan with method, budget, predicted_loss (summed table loss,
        linear between grid rates) and table_key filled in.
    Raises:
        BudgetError: a budget outside [0, 1) or beyond reach (the message gives the
            reachable range), or contradictory constraints.
        TableError: the table is for another model.
        PlanError: an unknown method.
    """
    if method not in METHODS:
        raise PlanError(f"unknown allocation method '{method}'; choose one of {', '.join(METHODS)}")
    budget = _check_budget(budget)
    table.check_model(lm)
    if table.spec.channel_multiple < 1:
        raise TableError("loss table channel_multiple must be positive")
    problem = planning_problem(table, constraints, smoothed)
    if method == "dp":
        return _grid_plan(lm, table, problem, _dp_choice(problem, budget, n_buckets), budget, "dp")
    if method == "evo":
        return evolve(lm, table, budget, constraints, calib, scores, evo, n_buckets, smoothed).plan

    geoms = block_geometries(lm)
    multiple = table.spec.channel_multiple
    ladders = _ladders(geoms, problem.slots, problem.locked, constraints, multiple)
    _ladder_reach(method, budget, ladders, problem.dense_prunable)
    target = budget * problem.dense_prunable
    wanted = None
    if method == "uniform":
        rungs, rate = _uniform_rates(geoms, problem.slots, ladders, problem.locked, constraints, target, multiple)
        log.info("uniform: common rate %.4f before unit settling", rate)
    else:
        from .data import calibration_windows

        calib = calib or calibration_for(table)
        if method == "owl" or scores is None:
            windows = calibration_windows(lm.tokenizer, calib.data, calib.n_samples, calib.seq_len, calib.seed)
        if method == "flap":
            if scores is None:
                scores = compute_importance(lm, windows, table.spec.criterion, calib.batch_size)
            wanted = _flap_wanted(geoms, problem.slots, ladders, problem.locked, scores, target, constraints.max_rate)
            rungs = _nearest_rungs(ladders, wanted)
        else:  # owl
            ratios = outlier_ratios(lm, windows, batch_size=calib.batch_size)
            offsets = owl_offsets(ratios)
            log.info("owl: outlier ratios %s", np.array2string(ratios, precision=4))
            rungs = _owl_rates(geoms, problem.slots, ladders, problem.locked, constraints, offsets, target, multiple)
    rungs = _settle(ladders, rungs, target, wanted)
    attention, mlp = slot_rates(problem.slots, _ladder_rates(ladders, rungs), problem.num_layers)
    return make_plan(
        lm,
        attention,
        mlp,
        table.spec.criterion,
        multiple,
        method=method,
        budget=budget,
        predicted_loss=predicted_loss(table, geoms, attention, mlp, smoothed),
        table_key=table.key,
    )


# ---- predicted against actual ------------------------------------------------------------------
@dataclass
class Reference:
    """The dense model's numbers on the comparison windows (computed once)."""

    calib_loss: float  # mean NLL on the calibration windows
    perplexity: dict[str, float]  # held-out source -> perplexity


@dataclass
class Outcome:
    """One plan, pruned for real, beside what the table predicted."""

    method: str  # allocation method
    budget: float  # requested fraction of prunable parameters
    removed: int  # prunable parameters removed
    removed_fraction: float  # of the prunable parameters
    params_after: int  # parameters of the pruned model
    predicted_loss: float | None  # the table's summed loss
    calib_loss_increase: float  # true mean NLL increase on the calibration windows
    perplexity: dict[str, float]  # held-out source -> perplexity of the pruned model
    dense_perplexity: dict[str, float]  # the same for the dense model
    dense_calib_loss: float  # dense mean NLL on the calibration windows
    extras: dict = field(default_factory=dict)  # method-specific numbers (evo: the DP seed's)

    def row(self) -> dict:
        """Flat dict for CSV output."""
        out = {k: v for k, v in asdict(self).items() if k not in ("perplexity", "dense_perplexity", "extras")}
        for source, ppl in self.perplexity.items():
            out[f"ppl_{source}"] = ppl
            out[f"dense_ppl_{source}"] = self.dense_perplexity[source]
        out.update(self.extras)
        return out


def heldout_sets(tokenizer, sources: Sequence[str], n_samples: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Held-out windows per source (never overlapping calibration text)."""
    from .data import heldout_windows

    return {source: heldout_windows(tokenizer, source, n_samples, seq_len, seed) for source in sources}


def reference_numbers(lm, calib_windows: torch.Tensor, heldout: Mapping[str, torch.Tensor], batch_size: int = 4) -> Reference:
    return Reference(
        calib_loss=mean_nll(lm, calib_windows, batch_size),
        perplexity={source: math.exp(mean_nll(lm, w, batch_size)) for source, w in heldout.items()},
    )


def predicted_vs_actual(
    lm_dense,
    plan: RatePlan,
    calib: CalibrationSettings,
    heldout: Mapping[str, torch.Tensor],
    scores: ImportanceScores | None = None,
    reference: Reference | None = None,
) -> Outcome:
    """Prune a copy of the dense model with ``plan`` and measure it.

    Args:
        lm_dense: the dense LoadedModel (not modified; a deep copy is pruned).
        plan: the plan (its predicted_loss is reported beside the truth).
        calib: calibration windows: importance scores and the calibration loss.
        heldout: source -> (N, T) held-out windows for perplexity.
        scores: the dense model's importance scores of ``plan.criterion`` on ``calib``
            (computed when None).
        reference: the dense numbers (computed when None).
    Returns:
        An Outcome: removed parameters, predicted and true calibration loss increase,
        held-out perplexities beside the dense ones.
    """
    from .data import calibration_windows

    windows = calibration_windows(lm_dense.tokenizer, calib.data, calib.n_samples, calib.seq_len, calib.seed)
    if scores is None:
        scores = compute_importance(lm_dense, windows, plan.criterion, calib.batch_size)
    if reference is None:
        reference = reference_numbers(lm_dense, windows, heldout, calib.batch_size)
    pruned = copy.copy(lm_dense)
    pruned.model = copy.deepcopy(lm_dense.model)
    result = apply_plan(pruned, plan, scores)
    try:
        calib_loss = mean_nll(pruned, windows, calib.batch_size)
        perplexity = {source: math.exp(mean_nll(pruned, w, calib.batch_size)) for source, w in heldout.items()}
    finally:
        del pruned
    return Outcome(
        method=plan.method,
        budget=plan.budget if plan.budget is not None else plan.params["removed_fraction_of_prunable"],
        removed=int(plan.params["removed"]),
        removed_fraction=float(plan.params["removed_fraction_of_prunable"]),
        params_after=result.params_after,
        predicted_loss=plan.predicted_loss,
        calib_loss_increase=calib_loss - reference.calib_loss,
        perplexity=perplexity,
        dense_perplexity=dict(reference.perplexity),
        dense_calib_loss=reference.calib_loss,
    )


def compare(
    lm,
    table: LossTable,
    budgets: Sequence[float],
    methods: Sequence[str],
    heldout: Mapping[str, torch.Tensor],
    constraints: Constraints = Constraints(),
    calib: CalibrationSettings | None = None,
    evo: EvoSettings = EvoSettings(),
    progress: Callable[[str], None] | None = None,
) -> list[Outcome]:
    """Every method at every budget, pruned for real and measured on the same windows.

    Plans are made first (so a bad budget fails before any pruning); importance scores
    and the dense numbers are computed once.
    """
    from .data import calibration_windows

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise PlanError(f"unknown allocation method '{unknown[0]}'; choose from {', '.join(METHODS)}")
    table.check_model(lm)
    calib = calib or calibration_for(table)
    windows = calibration_windows(lm.tokenizer, calib.data, calib.n_samples, calib.seq_len, calib.seed)
    scores = compute_importance(lm, windows, table.spec.criterion, calib.batch_size)
    for budget in budgets:  # fail fast on an unreachable budget, before the slow part
        for method in methods:
            check_budget(lm, table, budget, method, constraints)
    reference = reference_numbers(lm, windows, heldout, calib.batch_size)
    outcomes = []
    for budget in budgets:
        for method in methods:
            started = time.perf_counter()
            extras = {}
            if method == "evo":
                result = evolve(lm, table, budget, constraints, calib, scores, evo)
                plan = result.plan
                extras = {
                    "dp_predicted": result.seed_predicted,
                    "dp_actual": result.seed_actual,
                    "evo_actual": result.actual,
                    "evo_evaluations": result.evaluations,
                }
            else:
                plan = plan_from_table(lm, table, budget, method, constraints, scores, calib)
            outcome = predicted_vs_actual(lm, plan, calib, heldout, scores, reference)
            outcome.extras = extras | {"seconds": round(time.perf_counter() - started, 1)}
            outcomes.append(outcome)
            if progress:
                progress(f"{method} at {budget:.0%}: calibration loss +{outcome.calib_loss_increase:.4f}")
    return outcomes
