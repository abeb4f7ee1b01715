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
r_c = P_c(b), then b <- max(b - q[c, r_c], 0), for all budgets at once [choices].

Time is O(C * R * B). Each component is a few numpy passes over a (k, n) table of
candidates (options by budgets), not a Python loop over options, because at a 70B model's
shape (160 components x 32 rates x 8,192 buckets) one call per option cost more in call
overhead than in arithmetic. Two exact savings shrink the table: F_{c+1}(b) is finite
exactly up to n - 1 = the summed largest bucketed costs of components 0..c (the
all-largest choice covers any smaller b), so only those n columns are computed; and an
option that an earlier option dominates (`undominated`: rates rounding to the same bucket,
the larger no better) can never be P_c, ties included, so it gets no row. Memory is the
(C, B+1) pointer table and one (R, B+1) candidate table.

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


def undominated(bucketed: np.ndarray, losses: np.ndarray, allowed: np.ndarray, at_least: bool = True) -> np.ndarray:
    """The allowed options that no earlier option dominates.

    Covering (``at_least``), option r of component c is dropped when an earlier allowed
    option r' < r removes at least as many buckets for no more loss (q[c, r'] >= q[c, r]
    and l[c, r'] <= l[c, r]): two rates that round to the same bucket, the larger no
    better. Packing, ``bucketed`` is the slack p, and r' must keep no more of it
    (p[c, r'] <= p[c, r]). Dropping r changes nothing, not even a tie: F_c is
    non-decreasing in b (G_c non-increasing in j) and rounded addition is monotone, so
    r's candidate is nowhere below r''s, and r' comes first.

    Returns:
        (C, R) bool, ``allowed`` without the dominated options.
    """
    n_opt = bucketed.shape[1]
    gain = bucketed if at_least else -bucketed  # (C, R) larger is better
    loss = np.where(allowed, losses, np.inf)  # (C, R); disallowed entries may be NaN
    earlier = np.tri(n_opt, n_opt, -1, dtype=bool)  # (R, R) [r, r'] = r' < r
    by = allowed[:, None, :] & earlier[None, :, :] & (gain[:, None, :] >= gain[:, :, None]) & (loss[:, None, :] <= loss[:, :, None])
    kept: np.ndarray = allowed & ~by.any(axis=2)  # (C, R); by[c, r, r']: r' dominates r
    return kept


def _dp_tables(bucketed: np.ndarray, losses: np.ndarray, allowed: np.ndarray, width: int, at_least: bool) -> tuple[np.ndarray, np.ndarray]:
    """The DP over budgets 0..width-1, vectorised over the options and the budgets.

    Args:
        bucketed: (C, R) int >= 0 costs in buckets.
        losses, allowed: (C, R) validated tables.
        width: B + 1.
        at_least: True for the covering form of the module docstring (F, cost >= b);
            False for the packing form G_{c+1}(j) = min_r G_c(j - p[c, r]) + l[c, r] with
            G_0 = 0 everywhere (cost <= j), used by `solve_budget` near the top.
    Returns:
        values (B+1,) F_C or G_C, +inf where unreachable; pointers (C, B+1), -1 where none.

    Per component, the k options kept by `undominated` are k shifted copies of the previous
    values plus their losses, one row each of a (k, n) candidate table; F_{c+1} is its
    column minimum and P_c the first row attaining it (the smallest r on ties, as the
    recurrence says). Covering values are finite exactly up to the summed largest costs so
    far (the all-largest choice reaches any budget below), so only those n columns are
    computed; the rest stay +inf with pointer -1.
    """
    n_comp, n_opt = bucketed.shape
    kept = undominated(bucketed, losses, allowed, at_least)
    kept &= bucketed < width  # packing: an option whose slack alone exceeds the capacity never fits
    ptr_dtype = np.int16 if n_opt <= np.iinfo(np.int16).max else np.int32
    pointers = np.full((n_comp, width), -1, dtype=ptr_dtype)  # (C, B+1) P_c(b)
    if at_least:
        reach = np.minimum(np.cumsum(np.where(kept, bucketed, 0).max(axis=1)), width - 1)  # (C,) last finite b of F_{c+1}
    else:
        reach = np.full(n_comp, width - 1)
    pad = int(np.where(kept, bucketed, 0).max())
    # prev[pad + b] = F_c(b); prev[:pad] stands for the budgets below 0: F_c(0) when
    # covering (the clamp max(b - q, 0)), +inf when packing (j - p < 0 does not fit).
    prev = np.full(pad + width, np.inf)
    if at_least:
        prev[: pad + 1] = 0.0  # F_0
    else:
        prev[pad:] = 0.0  # G_0
    nxt = prev.copy()
    cand_buffer = np.empty(n_opt * width)
    equal_buffer = np.empty(n_opt * width, dtype=bool)
    key_dtype = np.min_scalar_type(n_opt)
    key_buffer = np.empty(n_opt * width, dtype=key_dtype)
    for c in range(n_comp):
        opts = np.flatnonzero(kept[c])  # (k,) option indices, in rate order
        k, n = len(opts), int(reach[c]) + 1
        cand = cand_buffer[: k * n].reshape(k, n)  # (k, n) candidate of option opts[i] at budget b
        for i, (shift, loss) in enumerate(zip(bucketed[c, opts].tolist(), losses[c, opts].tolist())):
            np.add(prev[pad - shift : pad - shift + n], loss, cand[i])
        best = nxt[pad : pad + n]  # (n,) F_{c+1}(b)
        np.minimum.reduce(cand, axis=0, out=best)
        # The first row attaining the minimum has the smallest option index, so the
        # largest n_opt - r among the equal rows names it.
        equal = equal_buffer[: k * n].reshape(k, n)
        np.equal(cand, best, equal)
        countdown = (n_opt - opts).astype(key_dtype)[:, None]  # (k, 1)
        key = key_buffer[: k * n].reshape(k, n)
        np.multiply(equal.view(np.uint8), countdown, key)
        row = pointers[c, :n]
        np.subtract(n_opt, np.maximum.reduce(key, axis=0), row, casting="unsafe")
        if at_least:
            nxt[:pad] = best[0]
        else:
            row[np.isinf(best)] = -1  # no option fits; covering values below reach are all finite
        prev, nxt = nxt, prev
    return prev[pad:].copy(), pointers


def _read_back(bucketed: np.ndarray, costs: np.ndarray, pointers: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Choices (len(rows), C) for the given budget rows, following the pointers back, and
    the exact parameters (len(rows),) each removes."""
    n_comp = bucketed.shape[0]
    choices = np.empty((n_comp, len(rows)), dtype=pointers.dtype)  # (C, N): rows are cheap to fill; returned transposed
    removed = np.zeros(len(rows), dtype=np.int64)
    budget_left = np.array(rows, dtype=np.intp)
    for c in range(n_comp - 1, -1, -1):
        picked = choices[c]
        np.take(pointers[c], budget_left, out=picked)
        # Unreachable rows carry -1 pointers (take wraps); callers overwrite those rows.
        # Covering: max(b - q, 0). Packing: j - p, already >= 0 on reachable rows.
        budget_left -= bucketed[c].take(picked)
        np.maximum(budget_left, 0, out=budget_left)
        removed += costs[c].take(picked)
    return choices.T, removed


def _front(costs: np.ndarray, losses: np.ndarray, allowed: np.ndarray, bucket_size: int, n_budget: int) -> ParetoFront:
    """The covering DP over budgets 0..n_budget (buckets of bucket_size) on validated tables."""
    width = n_budget + 1
    # Round half up in integers; capping at n_budget keeps every shift inside the table.
    bucketed = np.minimum((costs + bucket_size // 2) // bucket_size, n_budget)  # (C, R)
    values, pointers = _dp_tables(bucketed, losses, allowed, width, at_least=True)
    reachable = np.isfinite(values)
    choices, removed = _read_back(bucketed, costs, pointers, np.arange(width))  # (B+1, C), (B+1,)
    choices[~reachable] = -1
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
    return np.array(_read_back(bucketed, costs, pointers, np.array([width - 1]))[0][0], dtype=np.intp)


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
