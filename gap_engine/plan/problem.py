"""The allocation problem: a loss table under constraints, as the DP and the baselines see it.

A *slot* is what gets one rate: a component (a layer's attention or MLP), or a whole layer
when attention and MLP are coupled. Budgets are fractions of the *prunable* parameters (all
attention and MLP projections). `predicted_loss` reads any plan, on the grid or off it,
from the table.

When the prune that follows adds biases (bias compensation), a budget pays for them: an
option's cost is the parameters it removes less the bias its cut adds (``bias_charges``: a
component's first cut costs its output projection's bias, ``units.ComponentGeometry.bias_params_at``),
so a plan removes at least the budget *net*, and the DP stays exact in whole parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

import numpy as np

from gap_engine.core.config import DEFAULT_MAX_RATE
from gap_engine.core.errors import BudgetError, TableError
from gap_engine.core.knapsack import constraint_mask
from gap_engine.core.validate import check_number
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.units import ComponentGeometry, block_geometries
from gap_engine.prune.compensations import adds_biases
from gap_engine.tables.artefact import LossTable

RATE_TOL = 1e-9  # rates closer than this are the same rate
PARTS = {"attn": ("attn",), "mlp": ("mlp",), "block": ("attn", "mlp")}  # slot kind -> components it spans

# One option index per slot: a list, or the integer array a solver returns.
Choice: TypeAlias = Sequence[int] | np.ndarray


# ---- constraints -----------------------------------------------------------------------
@dataclass(frozen=True)
class Constraints:
    """What a plan must respect besides the budget (the same for every method)."""

    locked: Mapping[int, float] = field(
        default_factory=dict
    )  # layer -> rate of both its components; negative counts from the end; overrides min/max
    min_rate: float = 0.0  # lowest rate of every unlocked component
    max_rate: float = DEFAULT_MAX_RATE  # highest rate of every unlocked component
    coupled: bool = False  # a layer's attention and MLP share one rate (always so with a block-mode table)

    @classmethod
    def from_dict(cls, raw: Mapping[Any, Any] | None) -> Constraints:
        """Constraints from their JSON form (layer keys as strings), as the app and the history store them."""
        raw = raw or {}
        return cls(
            locked={int(k): float(v) for k, v in (raw.get("locked") or {}).items()},
            min_rate=float(raw.get("min_rate", 0.0)),
            max_rate=float(raw.get("max_rate", DEFAULT_MAX_RATE)),
            coupled=bool(raw.get("coupled", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form read by `from_dict`."""
        return {
            "locked": {str(k): float(v) for k, v in dict(self.locked).items()},
            "min_rate": self.min_rate,
            "max_rate": self.max_rate,
            "coupled": self.coupled,
        }

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
        if self.min_rate > self.max_rate + RATE_TOL:
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
            if index in out and abs(out[index] - rate) > RATE_TOL:
                raise BudgetError(f"layer {index} is locked twice, at rates {out[index]:g} and {rate:g}")
            out[index] = float(rate)
        return out


def check_budget_fraction(budget: object) -> float:
    """``budget`` as a float in [0, 1), or BudgetError saying what a budget is."""
    fraction = check_number(budget, "budget", BudgetError)
    if not 0.0 <= fraction < 1.0:
        raise BudgetError(f"budget {fraction:g} is outside [0, 1): it is the fraction of prunable parameters to remove")
    return fraction


# ---- the planning problem: slots over the table's grid ---------------------------------
@dataclass(frozen=True)
class PlanningProblem:
    """A table under constraints, as the planner sees it. A slot is what gets one rate:
    a component, or a whole layer when coupled."""

    slots: tuple[tuple[int, str], ...]  # (layer, "attn" | "mlp" | "block") per slot, in layer order
    rate_grid: np.ndarray  # (R,) the table's rates
    costs: np.ndarray  # (S, R) int64 parameters each option removes, less the biases it adds when they are charged
    losses: np.ndarray  # (S, R) float64 predicted loss increase of each option
    allowed: np.ndarray  # (S, R) bool options the constraints allow
    locked: dict[int, float]  # slot index -> locked rate
    num_layers: int  # L
    dense_prunable: int  # prunable parameters of the dense model

    @property
    def coupled(self) -> bool:
        return len(self.slots) == self.num_layers

    def rates(self, choice: Choice) -> tuple[list[float], list[float]]:
        """(attention_rates, mlp_rates) per layer for one option index per slot."""
        return slot_rates(self.slots, [float(self.rate_grid[int(r)]) for r in choice], self.num_layers)

    def removed(self, choice: Choice) -> int:
        return int(self.costs[np.arange(len(self.slots)), np.asarray(choice, dtype=np.intp)].sum())

    def loss(self, choice: Choice) -> float:
        total = 0.0
        for s, r in enumerate(choice):  # summed in slot order, like the DP
            total += float(self.losses[s, int(r)])
        return total

    def reach(self) -> tuple[int, int]:
        """(least, most) parameters a plan on this grid removes under the constraints."""
        low = np.where(self.allowed, self.costs, np.iinfo(np.int64).max).min(axis=1).sum()
        high = np.where(self.allowed, self.costs, -1).max(axis=1).sum()
        return int(low), int(high)


def slot_rates(slots: Sequence[tuple[int, str]], rates: Iterable[float], num_layers: int) -> tuple[list[float], list[float]]:
    """Spread one rate per slot over (attention_rates, mlp_rates); layers without a slot stay 0."""
    attention, mlp = [0.0] * num_layers, [0.0] * num_layers
    for (layer, kind), rate in zip(slots, rates):
        if kind in ("attn", "block"):
            attention[layer] = float(rate)
        if kind in ("mlp", "block"):
            mlp[layer] = float(rate)
    return attention, mlp


def layer_slots(num_layers: int, coupled: bool) -> tuple[tuple[int, str], ...]:
    kinds = ("block",) if coupled else ("attn", "mlp")
    return tuple((layer, kind) for layer in range(num_layers) for kind in kinds)


def _table_rows(table: LossTable) -> dict[tuple[int, str], int]:
    rows = {(int(layer), str(kind)): i for i, (layer, kind) in enumerate(table.components)}
    kinds = ("block",) if table.spec.mode == "block" else ("attn", "mlp")
    missing = [(layer, kind) for layer in range(table.num_layers) for kind in kinds if (layer, kind) not in rows]
    if missing:
        raise TableError(f"loss table has no row for layer {missing[0][0]} {missing[0][1]}")
    return rows


def charged_counts(lm: LoadedModel, compensation: str | None) -> list[ComponentGeometry] | None:
    """The blocks' counting geometry when ``compensation`` adds biases, for the planner to charge
    them (`planning_problem`'s ``biases``); None for one that adds none."""
    return block_geometries(lm) if adds_biases(compensation) else None


def bias_charges(
    counts: Sequence[ComponentGeometry], slots: Sequence[tuple[int, str]], rate_grid: Sequence[float] | np.ndarray, multiple: int
) -> np.ndarray:
    """(S, R) int64: the bias parameters each option of each slot adds under bias compensation:
    each component the rate cuts gets one bias on its output projection (the first cut pays it)."""
    charges = np.zeros((len(slots), len(rate_grid)), dtype=np.int64)
    for s, (layer, kind) in enumerate(slots):
        for r, rate in enumerate(rate_grid):
            charges[s, r] = sum(counts[layer].bias_params_at(part, float(rate), multiple) for part in PARTS[kind])
    return charges


def planning_problem(
    table: LossTable,
    constraints: Constraints = Constraints(),
    smoothed: bool = True,
    biases: Sequence[ComponentGeometry] | None = None,
) -> PlanningProblem:
    """The planner's view of ``table`` under ``constraints``.

    A split table planned with ``coupled`` gets one slot per layer whose option r removes
    and costs the sum of the layer's attention and MLP cells at rate r. With ``biases`` (the
    model's counting geometry, `charged_counts`: the prune adds bias compensation) every
    option costs what it removes less the biases it adds (`bias_charges`).

    Raises:
        BudgetError: contradictory constraints (see `Constraints.resolved_locks`, and a
            locked rate must be on the table's grid).
        TableError: a table with missing rows.
    """
    num_layers = table.num_layers
    locked_layers = constraints.resolved_locks(num_layers)
    coupled = constraints.coupled or table.spec.mode == "block"
    slots = layer_slots(num_layers, coupled)
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
        def slot_name(match: re.Match[str]) -> str:
            layer, kind = slots[int(match.group(1))]
            return f"layer {layer} {kind}"

        raise BudgetError(re.sub(r"^component (\d+)", slot_name, str(exc))) from None
    problem = PlanningProblem(
        slots=slots,
        rate_grid=np.asarray(table.rate_grid, dtype=np.float64),
        costs=costs,
        losses=losses,
        allowed=allowed,
        locked=locked,
        num_layers=num_layers,
        dense_prunable=int(table.dense_prunable),
    )
    return problem if biases is None else charge_biases(problem, biases, table.spec.channel_multiple)


def charge_biases(problem: PlanningProblem, biases: Sequence[ComponentGeometry], multiple: int) -> PlanningProblem:
    """``problem`` with every option costing what it removes less the biases it adds (`bias_charges`),
    as `planning_problem` builds it when given ``biases``: a problem built before the model loaded
    (to refuse bad constraints early) is charged once the model's geometry is known."""
    return replace(problem, costs=problem.costs - bias_charges(biases, problem.slots, problem.rate_grid, multiple))


def reach_error(allocator: str, budget: float, low: int, high: int, dense: int) -> BudgetError:
    return BudgetError(
        f"budget {budget:.1%} is out of reach for {allocator}: under these constraints plans remove "
        f"{low / dense:.1%} to {high / dense:.1%} of the prunable parameters ({low:,} to {high:,})"
    )


# ---- predicted loss of any plan -----------------------------------------------------------
def _interp_row(removed_row: np.ndarray, loss_row: np.ndarray, removed: float) -> float:
    """Loss at ``removed`` parameters, linear between the row's cells (and past its last one)."""
    xp, first = np.unique(np.asarray(removed_row, dtype=np.float64), return_index=True)
    fp = np.asarray(loss_row, dtype=np.float64)[first]
    if len(xp) == 1 or removed <= xp[-1]:
        return float(np.interp(removed, xp, fp))
    slope = (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    return float(fp[-1] + slope * (removed - xp[-1]))


def predicted_loss(
    table: LossTable,
    geometries: Sequence[ComponentGeometry],
    attention_rates: Sequence[float],
    mlp_rates: Sequence[float],
    smoothed: bool = True,
) -> float:
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
        removed = sum(geometries[layer].removed_at(part, rates[part][layer], multiple) for part in PARTS[kind])
        total += _interp_row(table.removed[row], losses[row], removed)
    return total
