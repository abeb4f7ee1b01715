"""The exact multiple-choice knapsack behind GAP's planner: one rate per component, least summed loss.

This is the allocation step of GAP: given a loss table (the predicted loss increase of
each component at each rate on the grid) and the parameters each rate removes, choose one
option per component so the parameters removed meet one global budget and the summed
predicted loss is least. It is a multiple-choice knapsack problem (MCKP) in its covering
form ("remove at least b"), solved exactly over integer cost buckets by dynamic
programming, as in SPDY's ``dp()`` and EvoPress's ``DPSolver``. One pass gives the optimum
for every budget at once (the Pareto front of removed parameters against loss).

The module is pure: numpy arrays in, numpy arrays out; no torch, no I/O. It sits in the
foundation layer because two stages solve it: the refine estimator (tables.refine) and the
allocators (plan).

Notation (array names in brackets)
----------------------------------
    C, R        components (c = 0..C-1) and options per component (r = 0..R-1).
                Options are ordered by rate (r = 0 is the smallest rate).
    w[c, r]     parameters option r of component c removes, an integer >= 0  [costs]
    l[c, r]     predicted loss increase of that option, any finite float       [losses]
    A[c, r]     whether the option may be chosen (rate constraints)           [allowed]
    W           sum over c of the largest allowed w[c, r]: the most removable
    s           bucket size, ceil(W / n_buckets) parameters                   [bucket_size]
    B           ceil(W / s) <= n_buckets, the largest budget in buckets
    q[c, r]     bucketed cost, min(round(w[c, r] / s), B)

    F_0(b)      = 0 if b == 0 else +inf
    F_{c+1}(b)  = min over allowed r of  F_c(max(b - q[c, r], 0)) + l[c, r]      b = 0..B
    P_c(b)      = the r attaining that minimum (the smallest r on ties), -1 if none:
                  the option of component c in the best choice for c' <= c at budget b

F_C(b) is the least summed loss of a choice whose bucketed cost is at least b
[best_loss]. The clamp ``max(., 0)`` is what makes it "at least": it is the same as an
exact-cost table with costs capped at B followed by a suffix minimum over budgets, without
the extra pass. F_C is non-decreasing in b whatever the sign of the losses, since the set of
feasible choices only shrinks as b grows; negative losses (noise in a measured table) need
no special care because every component picks exactly one option. The choice for budget b
is read back through the pointer tables from the last component down, starting at b:
r_c = P_c(b), then b <- max(b - q[c, r_c], 0), for all budgets at once [choices]. Time is O(C * R * B), vectorised over b; memory is the
(C, B+1) pointer table.

Rounding
--------
The optimum is exact with respect to the bucketed costs q. Each rounding moves a cost by
at most s/2, so the parameters a choice really removes [removed, computed from w] differ
from s times its bucketed cost by at most C * s / 2. When s == 1 (W <= n_buckets) nothing
is rounded and the front is exact. ``ParetoFront.plan_at`` checks the exact ``removed``,
not the bucket: it returns the least-loss row of the front whose exact removal meets the
request, moving past ``ceil(request / s)`` when rounding fell short. Near the very top
there is no higher bucket to move to: options whose costs round to the same bucket are
told apart by loss only, so the front's largest removal [reachable_max] can fall short of
W by at most C * s, and `plan_at` says so. `solve_budget` has no such gap: for budgets in
the upper half it solves the mirror problem on the slack below each component's largest
cost, rounded up, which always finds a plan for any budget <= W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gap_engine.core.config import DEFAULT_N_BUCKETS
from gap_engine.core.errors import BudgetError, InvariantError

# Rates closer than this are the same grid point (grids come from linspace and JSON).
_RATE_ATOL = 1e-9


@dataclass(frozen=True)
class ParetoFront:
    """The optimum choice for every removed-cost bucket b = 0..B (arrays are read-only)."""

    bucket_size: float  # parameters per cost bucket (the granularity; costs were rounded to it)
    budgets: np.ndarray  # (B+1,) int: removed-cost bucket b = 0..B  (b * bucket_size parameters)
    best_loss: np.ndarray  # (B+1,) float: least summed loss with removed cost >= b buckets; +inf where unreachable
    choices: np.ndarray  # (B+1, C) int16/int32: option per component for the optimum at b; -1 rows where unreachable
    removed: np.ndarray  # (B+1,) int64: exact parameters removed by that optimum (from un-rounded costs); -1 where unreachable
    max_removable: int = -1  # W: sum of each component's largest allowed cost (-1: not recorded)

    def bucket_at(self, removed_params: float) -> int:
        """Row of the front that `plan_at` uses for a budget.

        Args:
            removed_params: parameters that must be removed (at least).
        Returns:
            The smallest b whose optimum removes at least ``removed_params`` exact
            parameters; since ``best_loss`` is non-decreasing in b it has the least loss
            of all rows that meet the budget.
        Raises:
            BudgetError: the budget is not a number, or more than any plan removes.
        """
        if not math.isfinite(removed_params):
            raise BudgetError(f"budget must be a finite number of parameters, got {removed_params!r}")
        meets = np.isfinite(self.best_loss) & (self.removed >= removed_params)
        if not meets.any():
            top = self.reachable_max()
            if removed_params <= self.max_removable:
                raise BudgetError(
                    f"cannot remove {removed_params:,.0f} parameters at bucket size {self.bucket_size:,.0f}: "
                    f"plans on this front reach {top:,} of {self.max_removable:,}; use solve_budget or more buckets"
                )
            raise BudgetError(
                f"cannot remove {removed_params:,.0f} parameters: at most "
                f"{max(top, self.max_removable):,} can be removed under these constraints"
            )
        return int(np.argmax(meets))

    def plan_at(self, removed_params: float) -> np.ndarray:
        """Option indices for a budget.

        Args:
            removed_params: parameters that must be removed (at least).
        Returns:
            (C,) intp option index per component; its exact removal is >= removed_params.
        Raises:
            BudgetError: beyond reach (the message names the reachable maximum).
        """
        return np.array(self.choices[self.bucket_at(removed_params)], dtype=np.intp)

    def reachable_max(self) -> int:
        """The most parameters (exact) that any plan on this front removes."""
        reachable = np.isfinite(self.best_loss)
        return int(self.removed[reachable].max())


def check_inputs(costs: np.ndarray, losses: np.ndarray, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and normalise the tables: int64 costs, float64 losses, bool mask, all (C, R)."""
    costs_arr = np.asarray(costs)
    losses_arr = np.asarray(losses, dtype=np.float64)
    if costs_arr.ndim != 2 or costs_arr.shape[0] < 1 or costs_arr.shape[1] < 1:
        raise BudgetError(f"costs must be a non-empty (components, options) table, got shape {costs_arr.shape}")
    if losses_arr.shape != costs_arr.shape:
        raise BudgetError(f"losses shape {losses_arr.shape} does not match costs shape {costs_arr.shape}")
    if costs_arr.dtype.kind not in "iub":
        if not np.all(np.isfinite(costs_arr)) or not np.all(costs_arr == np.round(costs_arr)):
            raise BudgetError("costs must be whole numbers of parameters")
    costs_int = costs_arr.astype(np.int64)
    if (costs_int < 0).any():
        c, r = np.argwhere(costs_int < 0)[0]
        raise BudgetError(f"component {c} option {r} has a negative cost {costs_int[c, r]}")
    if allowed is None:
        mask = np.ones(costs_arr.shape, dtype=bool)
    else:
        mask = np.asarray(allowed, dtype=bool)
        if mask.shape != costs_arr.shape:
            raise BudgetError(f"allowed shape {mask.shape} does not match costs shape {costs_arr.shape}")
    empty = ~mask.any(axis=1)
    if empty.any():
        raise BudgetError(f"component {int(np.argmax(empty))} has no allowed rate under the constraints")
    bad = mask & ~np.isfinite(losses_arr)
    if bad.any():
        c, r = np.argwhere(bad)[0]
        raise BudgetError(f"component {c} option {r} has a non-finite loss {losses_arr[c, r]}")
    return costs_int, losses_arr, mask


def _max_removable(costs: np.ndarray, allowed: np.ndarray) -> int:
    """Sum over components of the largest allowed cost."""
    return int(np.where(allowed, costs, -1).max(axis=1).sum())


def _dp_tables(bucketed: np.ndarray, losses: np.ndarray, allowed: np.ndarray, width: int, at_least: bool) -> tuple[np.ndarray, np.ndarray]:
    """The DP over budgets 0..width-1, vectorised over the budget axis.

    Args:
        bucketed: (C, R) int >= 0 costs in buckets.
        losses, allowed: (C, R) validated tables.
        width: B + 1.
        at_least: True for the covering form of the module docstring (F, cost >= b);
            False for the packing form G_{c+1}(j) = min_r G_c(j - p[c, r]) + l[c, r] with
            G_0 = 0 everywhere (cost <= j), used by `solve_budget` near the top.
    Returns:
        values (B+1,) F_C or G_C, +inf where unreachable; pointers (C, B+1), -1 where none.
    """
    n_comp, n_opt = bucketed.shape
    ptr_dtype = np.int16 if n_opt <= np.iinfo(np.int16).max else np.int32
    pointers = np.empty((n_comp, width), dtype=ptr_dtype)  # (C, B+1) P_c(b)
    if at_least:
        prev = np.full(width, np.inf)  # F_0
        prev[0] = 0.0
    else:
        prev = np.zeros(width)  # G_0
    best = np.empty(width)
    cand = np.empty(width)
    better = np.empty(width, dtype=bool)
    for c in range(n_comp):
        row = pointers[c]
        row.fill(-1)
        best.fill(np.inf)
        for r in np.flatnonzero(allowed[c]):
            shift = min(int(bucketed[c, r]), width)
            loss = losses[c, r]
            if at_least:
                cand[:shift] = prev[0] + loss  # max(b - q, 0) == 0
            elif shift == width:
                continue  # the option alone exceeds the capacity
            else:
                cand[:shift] = np.inf
            np.add(prev[: width - shift], loss, out=cand[shift:])
            # Strict '<' keeps the smaller rate on ties (options are visited in rate order).
            np.less(cand, best, out=better)
            np.copyto(best, cand, where=better)
            np.copyto(row, r, where=better)
        prev, best = best, prev
    return prev, pointers


def _read_back(bucketed: np.ndarray, pointers: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Choices (len(rows), C) for the given budget rows, following the pointers back."""
    n_comp = bucketed.shape[0]
    choices = np.empty((len(rows), n_comp), dtype=pointers.dtype)
    budget_left = np.asarray(rows, dtype=np.int64).copy()
    for c in range(n_comp - 1, -1, -1):
        picked = pointers[c, budget_left]
        choices[:, c] = picked
        # Unreachable rows carry -1 pointers (indexing wraps); callers overwrite those rows.
        # Covering: max(b - q, 0). Packing: j - p, already >= 0 on reachable rows.
        budget_left = np.maximum(budget_left - bucketed[c, picked], 0)
    return choices


def _front(costs: np.ndarray, losses: np.ndarray, allowed: np.ndarray, bucket_size: int, n_budget: int) -> ParetoFront:
    """The covering DP over budgets 0..n_budget (buckets of bucket_size) on validated tables."""
    n_comp = costs.shape[0]
    width = n_budget + 1
    # Round half up in integers; capping at n_budget keeps every shift inside the table.
    bucketed = np.minimum((costs + bucket_size // 2) // bucket_size, n_budget)  # (C, R)
    values, pointers = _dp_tables(bucketed, losses, allowed, width, at_least=True)
    reachable = np.isfinite(values)
    choices = _read_back(bucketed, pointers, np.arange(width))  # (B+1, C)
    choices[~reachable] = -1
    removed = costs[np.arange(n_comp), choices].sum(axis=1)  # (B+1,)
    removed[~reachable] = -1
    arrays = dict(budgets=np.arange(width), best_loss=values, choices=choices, removed=removed)
    for arr in arrays.values():
        arr.setflags(write=False)
    return ParetoFront(bucket_size=float(bucket_size), max_removable=_max_removable(costs, allowed), **arrays)


def solve_front(
    costs: np.ndarray,
    losses: np.ndarray,
    allowed: np.ndarray | None = None,
    n_buckets: int = DEFAULT_N_BUCKETS,
) -> ParetoFront:
    """Least-loss choice for every global budget, in one DP pass.

    Args:
        costs: (C, R) int >= 0, parameters removed by option r of component c.
        losses: (C, R) float, predicted loss increase of each option (negative is fine).
        allowed: (C, R) bool mask of options that may be chosen (see `constraint_mask`);
            None allows all. Disallowed entries of losses may be anything, NaN included.
        n_buckets: resolution of the budget axis; the bucket size is
            ceil(max removable / n_buckets) parameters.
    Returns:
        The `ParetoFront` over budgets b = 0..B buckets.
    Raises:
        BudgetError: malformed tables, or a component with no allowed option.
    """
    if n_buckets < 1:
        raise BudgetError(f"n_buckets must be at least 1, got {n_buckets}")
    costs_int, losses_arr, mask = check_inputs(costs, losses, allowed)
    max_removable = _max_removable(costs_int, mask)
    bucket_size = max(1, -(-max_removable // n_buckets))
    n_budget = -(-max_removable // bucket_size)
    return _front(costs_int, losses_arr, mask, bucket_size, n_budget)


def _solve_from_top(costs: np.ndarray, losses: np.ndarray, allowed: np.ndarray, removed_params: float, n_buckets: int) -> np.ndarray:
    """One budget as a packing problem on the slack below each component's largest cost.

    With m_c the largest allowed cost of component c, removing at least the request is
    keeping the slack k = m_c - w[c, r] summed within K = W - request. Slack is rounded
    up to buckets of ceil(K / n_buckets), so a plan that fits in buckets fits exactly, and
    the all-largest plan (slack 0) always fits: this never fails for request <= W. It is
    exact when K <= n_buckets, and far finer than the covering grid near the top.
    """
    largest = np.where(allowed, costs, -1).max(axis=1, keepdims=True)  # (C, 1)
    slack = np.where(allowed, largest - costs, 0)  # (C, R) >= 0 where allowed
    capacity = int(largest.sum()) - math.ceil(removed_params)
    bucket_size = max(1, -(-capacity // n_buckets))
    width = capacity // bucket_size + 1
    bucketed = -(-slack // bucket_size)  # ceil: bucketed fit implies exact fit
    values, pointers = _dp_tables(bucketed, losses, allowed, width, at_least=False)
    if not np.isfinite(values[-1]):
        raise InvariantError("the all-largest plan does not fit the capacity it defines")
    return np.array(_read_back(bucketed, pointers, np.array([width - 1]))[0], dtype=np.intp)


def solve_budget(
    costs: np.ndarray,
    losses: np.ndarray,
    allowed: np.ndarray | None = None,
    *,
    removed_params: float,
    n_buckets: int = DEFAULT_N_BUCKETS,
) -> np.ndarray:
    """Least-loss choice for one budget.

    One budget gets a finer grid than `solve_front` gives it. Up to half of the most
    removable, the covering DP runs with buckets spanning the request (plus C/2 buckets
    past it to absorb rounding). Above that, or if rounding left the covering DP short,
    it solves the mirror problem on the slack below the top (`_solve_from_top`), which
    always finds a plan when one exists. Both are exact when their span fits in n_buckets.

    Args:
        costs, losses, allowed: as in `solve_front`.
        removed_params: parameters that must be removed (at least).
        n_buckets: resolution of the budget axis.
    Returns:
        (C,) intp option index per component; its exact removal is >= removed_params.
    Raises:
        BudgetError: malformed tables, or a budget above the most removable.
    """
    if n_buckets < 1:
        raise BudgetError(f"n_buckets must be at least 1, got {n_buckets}")
    if not math.isfinite(removed_params):
        raise BudgetError(f"budget must be a finite number of parameters, got {removed_params!r}")
    costs_int, losses_arr, mask = check_inputs(costs, losses, allowed)
    max_removable = _max_removable(costs_int, mask)
    if removed_params > max_removable:
        raise BudgetError(
            f"cannot remove {removed_params:,.0f} parameters: at most {max_removable:,} can be removed under these constraints"
        )
    if 2 * removed_params <= max_removable:
        target = max(0, math.ceil(removed_params))
        bucket_size = max(1, -(-target // n_buckets))
        n_budget = -(-target // bucket_size) + -(-costs_int.shape[0] // 2)
        front = _front(costs_int, losses_arr, mask, bucket_size, n_budget)
        try:
            return front.plan_at(removed_params)
        except BudgetError:
            pass  # rounding at the top of this grid; the slack form below cannot fail
    return _solve_from_top(costs_int, losses_arr, mask, removed_params, n_buckets)


def constraint_mask(
    rate_grid: np.ndarray,
    n_components: int,
    locked: dict[int, float] | None = None,
    min_rate: np.ndarray | float | None = None,
    max_rate: np.ndarray | float | None = None,
) -> np.ndarray:
    """Turn rate constraints into the `allowed` mask of the planner.

    Args:
        rate_grid: (R,) the rates of the options, in option order.
        n_components: C.
        locked: component -> the rate it must take; the rate must be on the grid.
        min_rate: scalar or (C,) lowest allowed rate per component; None for none.
        max_rate: scalar or (C,) highest allowed rate per component; None for none.
    Returns:
        (C, R) bool, True where the option may be chosen.
    Raises:
        BudgetError: a locked rate off the grid or outside its [min, max], a component
            out of range, min > max, or a component left with no rate on the grid.
    """
    grid = np.asarray(rate_grid, dtype=np.float64)
    if grid.ndim != 1 or grid.size < 1:
        raise BudgetError(f"rate_grid must be a non-empty 1-D array, got shape {grid.shape}")
    if n_components < 1:
        raise BudgetError(f"n_components must be at least 1, got {n_components}")

    def per_component(bound: np.ndarray | float | None, fill: float, name: str) -> np.ndarray:
        if bound is None:
            return np.full(n_components, fill)
        arr = np.asarray(bound, dtype=np.float64)
        if arr.ndim == 0:
            arr = np.full(n_components, float(arr))
        if arr.shape != (n_components,):
            raise BudgetError(f"{name} must be a scalar or have one entry per component ({n_components}), got shape {arr.shape}")
        if np.isnan(arr).any():
            raise BudgetError(f"{name} of component {int(np.argmax(np.isnan(arr)))} is NaN")
        return arr

    lo = per_component(min_rate, -np.inf, "min_rate")  # (C,)
    hi = per_component(max_rate, np.inf, "max_rate")  # (C,)
    inverted = lo > hi + _RATE_ATOL
    if inverted.any():
        c = int(np.argmax(inverted))
        raise BudgetError(f"component {c}: min rate {lo[c]:g} is above max rate {hi[c]:g}")

    mask = (grid[None, :] >= lo[:, None] - _RATE_ATOL) & (grid[None, :] <= hi[:, None] + _RATE_ATOL)  # (C, R)
    for comp, rate in (locked or {}).items():
        c = int(comp)
        if not 0 <= c < n_components:
            raise BudgetError(f"locked component {comp} is out of range (0..{n_components - 1})")
        on_grid = np.abs(grid - rate) <= _RATE_ATOL
        if not on_grid.any():
            raise BudgetError(f"component {c} is locked at rate {rate:g}, which is not on the rate grid")
        if rate < lo[c] - _RATE_ATOL or rate > hi[c] + _RATE_ATOL:
            raise BudgetError(f"component {c} is locked at rate {rate:g}, outside its allowed [{lo[c]:g}, {hi[c]:g}]")
        mask[c] = on_grid
    empty = ~mask.any(axis=1)
    if empty.any():
        c = int(np.argmax(empty))
        raise BudgetError(f"component {c} has no grid rate within [{lo[c]:g}, {hi[c]:g}]")
    return mask
