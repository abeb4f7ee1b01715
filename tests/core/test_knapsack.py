"""Tests of gap_engine.core.knapsack: the DP equals brute force for every budget, and constraints hold."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import brute_force, loop_front, uniform_choice

from gap_engine.core.errors import BudgetError
from gap_engine.core.knapsack import ParetoFront, constraint_mask, solve_budget, solve_front, undominated

FAST = settings(max_examples=150, deadline=None)


@st.composite
def instances(draw, max_comp=5, max_opt=4, max_cost=6, masked=True):
    """(costs, losses, allowed): small integer costs, losses of either sign, >= 1 allowed per row."""
    n_comp = draw(st.integers(1, max_comp))
    n_opt = draw(st.integers(1, max_opt))
    costs = np.array(draw(st.lists(st.integers(0, max_cost), min_size=n_comp * n_opt, max_size=n_comp * n_opt))).reshape(n_comp, n_opt)
    # Few distinct values so ties happen; both signs so negative losses are exercised.
    loss_values = st.one_of(st.integers(-3, 3).map(float), st.floats(-5.0, 5.0, allow_nan=False))
    losses = np.array(draw(st.lists(loss_values, min_size=n_comp * n_opt, max_size=n_comp * n_opt))).reshape(n_comp, n_opt)
    if masked:
        allowed = np.array(draw(st.lists(st.booleans(), min_size=n_comp * n_opt, max_size=n_comp * n_opt))).reshape(n_comp, n_opt)
        allowed[np.arange(n_comp), draw(st.lists(st.integers(0, n_opt - 1), min_size=n_comp, max_size=n_comp))] = True
    else:
        allowed = np.ones((n_comp, n_opt), dtype=bool)
    return costs, losses, allowed


def max_removable(costs, allowed):
    return int(np.where(allowed, costs, -1).max(axis=1).sum())


def chosen_cost(costs, choice):
    return int(costs[np.arange(costs.shape[0]), choice].sum())


def chosen_loss(losses, choice):
    total = 0.0
    for c, r in enumerate(choice):
        total += float(losses[c, r])
    return total


def same_loss(a, b):
    return (math.isinf(a) and math.isinf(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


# --- exactness against brute force -------------------------------------------------------


@FAST
@given(instances())
@pytest.mark.slow
def test_front_equals_brute_force_at_every_budget(instance):
    costs, losses, allowed = instance
    front = solve_front(costs, losses, allowed, n_buckets=64)  # 64 >= any total here: no rounding
    assert front.bucket_size == 1.0
    assert len(front.budgets) == max_removable(costs, allowed) + 1
    for b in front.budgets:
        expected, _ = brute_force(costs, losses, allowed, b)
        assert same_loss(front.best_loss[b], expected), (b, front.best_loss[b], expected)
        choice = front.choices[b]
        if math.isinf(expected):
            assert (choice == -1).all() and front.removed[b] == -1
            continue
        assert allowed[np.arange(len(choice)), choice].all()
        assert front.removed[b] == chosen_cost(costs, choice) >= b
        assert same_loss(chosen_loss(losses, choice), front.best_loss[b])


@FAST
@given(instances())
@pytest.mark.slow
def test_best_loss_is_non_decreasing_in_budget(instance):
    costs, losses, allowed = instance
    best = solve_front(costs, losses, allowed, n_buckets=64).best_loss
    assert np.isfinite(best[0])
    assert (best[1:] >= best[:-1]).all()


@FAST
@given(instances())
@pytest.mark.slow
def test_plan_at_and_solve_budget_equal_brute_force(instance):
    costs, losses, allowed = instance
    front = solve_front(costs, losses, allowed, n_buckets=64)
    top = front.reachable_max()
    assert top == max_removable(costs, allowed)
    for request in [-3, 0, *range(1, top + 1)]:
        expected, _ = brute_force(costs, losses, allowed, request)
        for choice in (front.plan_at(request), solve_budget(costs, losses, allowed, removed_params=request)):
            assert chosen_cost(costs, choice) >= request
            assert allowed[np.arange(len(choice)), choice].all()
            assert same_loss(chosen_loss(losses, choice), expected)


@FAST
@given(instances(max_cost=1000), st.integers(1, 12))
@pytest.mark.slow
def test_coarse_buckets_still_meet_the_exact_budget(instance, n_buckets):
    costs, losses, allowed = instance
    front = solve_front(costs, losses, allowed, n_buckets=n_buckets)
    size = front.bucket_size
    n_comp = costs.shape[0]
    assert len(front.budgets) <= n_buckets + 1
    bucketed = np.minimum((costs + int(size) // 2) // int(size), front.budgets[-1])
    for b in front.budgets:
        # Exact with respect to the bucketed costs: brute force on them agrees.
        expected, _ = brute_force(bucketed, losses, allowed, b)
        assert same_loss(front.best_loss[b], expected)
        if math.isinf(expected):
            continue
        choice = front.choices[b]
        assert front.removed[b] == chosen_cost(costs, choice)
        assert bucketed[np.arange(n_comp), choice].sum() >= b
        # Without the cap at B, rounding moves each cost by at most half a bucket.
        uncapped = ((costs + int(size) // 2) // int(size))[np.arange(n_comp), choice].sum()
        assert abs(front.removed[b] - uncapped * size) <= n_comp * size / 2
    assert front.reachable_max() >= max_removable(costs, allowed) - n_comp * size
    top = front.reachable_max()
    for request in np.linspace(0, top, 9).round():
        assert chosen_cost(costs, front.plan_at(request)) >= request
        assert chosen_cost(costs, solve_budget(costs, losses, allowed, removed_params=request, n_buckets=n_buckets)) >= request
    with pytest.raises(BudgetError):
        front.plan_at(top + 1)


def test_solve_budget_near_the_top_tells_apart_costs_in_one_bucket():
    # At 2 buckets both 8 and 11 round to the same bucket; only 11 meets a budget of 10.
    costs = np.array([[0, 0], [8, 11]])
    losses = np.zeros((2, 2))
    assert list(solve_budget(costs, losses, removed_params=10, n_buckets=2)) == [0, 1]
    # The front has no such mirror: at bucket size 5, 8 and 10 share the top bucket.
    costs = np.array([[0, 0], [8, 10]])
    front = solve_front(costs, losses, n_buckets=2)
    assert front.bucket_size == 5.0 and front.reachable_max() == 8
    with pytest.raises(BudgetError, match="reach 8 of 10; use solve_budget"):
        front.plan_at(9)
    assert list(solve_budget(costs, losses, removed_params=9, n_buckets=2)) == [0, 1]


@FAST
@given(instances(max_cost=1000), st.integers(1, 40), st.data())
@pytest.mark.slow
def test_solve_budget_in_the_upper_half_is_exact_within_n_buckets_of_the_top(instance, n_buckets, data):
    costs, losses, allowed = instance
    top = max_removable(costs, allowed)
    request = data.draw(st.integers(max(top // 2 + 1, top - n_buckets), max(top, 1)))
    if request > top:
        with pytest.raises(BudgetError, match=f"at most {top:,}"):
            solve_budget(costs, losses, allowed, removed_params=request, n_buckets=n_buckets)
        return
    expected, _ = brute_force(costs, losses, allowed, request)
    choice = solve_budget(costs, losses, allowed, removed_params=request, n_buckets=n_buckets)
    assert chosen_cost(costs, choice) >= request
    assert allowed[np.arange(len(choice)), choice].all()
    assert same_loss(chosen_loss(losses, choice), expected)


# --- the vectorised DP against the plain loop (tests/reference.py) ---------------------------


def assert_same_front(front, before):
    assert front.bucket_size == float(before["bucket_size"])
    assert np.array_equal(front.best_loss, before["best_loss"])
    assert np.array_equal(front.choices, before["choices"])
    assert np.array_equal(front.removed, before["removed"])


@FAST
@given(instances(max_comp=6, max_opt=6, max_cost=1000), st.integers(1, 80))
@pytest.mark.slow
def test_front_is_identical_to_the_loop_it_replaced(instance, n_buckets):
    costs, losses, allowed = instance
    assert_same_front(solve_front(costs, losses, allowed, n_buckets=n_buckets), loop_front(costs, losses, allowed, n_buckets))


@pytest.mark.parametrize("seed", range(3))
def test_front_is_identical_to_the_loop_on_a_larger_table_full_of_ties(seed):
    # 40 components x 12 rates: costs repeat within a row (rates that round to one bucket)
    # and losses are small integers, so equal candidates are everywhere.
    rng = np.random.default_rng(seed)
    costs = np.sort(rng.integers(0, 6, (40, 12)), axis=1) * rng.integers(1, 4000, (40, 1))
    losses = rng.integers(-2, 4, (40, 12)).astype(float)
    allowed = rng.random((40, 12)) < 0.8
    allowed[:, 0] = True
    for n_buckets in (7, 300, 2048):
        assert_same_front(solve_front(costs, losses, allowed, n_buckets=n_buckets), loop_front(costs, losses, allowed, n_buckets))


def test_undominated_drops_later_options_that_remove_no_more_for_no_less():
    bucketed = np.array([[0, 5, 5, 5, 7, 6]])
    losses = np.array([[0.0, 2.0, 2.0, 1.0, 3.0, 4.0]])
    allowed = np.array([[True, True, True, True, True, True]])
    # Option 2 ties option 1 (same bucket, same loss) and option 5 removes less than 4
    # for more loss; option 3 shares 1's bucket but is cheaper, so both stay.
    assert undominated(bucketed, losses, allowed).tolist() == [[True, True, False, True, True, False]]
    # Packing reads slack: less of it is better, so the order reverses.
    assert undominated(bucketed, losses, allowed, at_least=False).tolist() == [[True, False, False, False, False, False]]
    # A disallowed option dominates nothing, and stays out.
    allowed[0, 1] = False
    assert undominated(bucketed, losses, allowed).tolist() == [[True, False, True, True, True, False]]


# --- budgets out of reach ------------------------------------------------------------------


def test_unreachable_budget_names_the_reachable_max():
    costs = np.array([[0, 1000, 2000], [0, 1500, 3000]])
    losses = np.array([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    front = solve_front(costs, losses)
    assert front.reachable_max() == 5000
    with pytest.raises(BudgetError, match="at most 5,000"):
        front.plan_at(5001)
    with pytest.raises(BudgetError, match="at most 5,000"):
        solve_budget(costs, losses, removed_params=5001)
    allowed = np.array([[True, True, False], [True, True, True]])
    with pytest.raises(BudgetError, match="at most 4,000"):
        solve_front(costs, losses, allowed).plan_at(4500)
    with pytest.raises(BudgetError, match="finite"):
        front.plan_at(float("nan"))


# --- losses, ties, determinism ------------------------------------------------------------------


def test_negative_losses_are_minimised_not_clamped():
    costs = np.array([[0, 2, 4], [0, 2, 4]])
    losses = np.array([[0.0, -1.0, 0.5], [0.0, 0.3, -2.0]])
    front = solve_front(costs, losses)
    assert front.best_loss[0] == pytest.approx(-3.0)
    assert list(front.choices[0]) == [1, 2]
    assert front.removed[0] == 6
    # Asking for less than the free optimum removes still returns the free optimum.
    assert list(front.plan_at(3)) == [1, 2]
    assert front.best_loss[8] == pytest.approx(-1.5)


def test_ties_prefer_the_smaller_rate_and_are_deterministic():
    costs = np.array([[0, 1, 2], [0, 1, 2]])
    losses = np.zeros((2, 3))
    front = solve_front(costs, losses)
    assert list(front.choices[0]) == [0, 0]
    assert chosen_cost(costs, front.choices[2]) == 2
    again = solve_front(costs, losses)
    assert np.array_equal(front.choices, again.choices)
    assert np.array_equal(front.best_loss, again.best_loss)


def test_front_arrays_are_read_only():
    front = solve_front(np.array([[0, 3]]), np.array([[0.0, 1.0]]))
    assert isinstance(front, ParetoFront)
    with pytest.raises(ValueError):
        front.choices[0, 0] = 1


def test_disallowed_entries_may_hold_nan_but_allowed_may_not():
    costs = np.array([[0, 2], [0, 2]])
    losses = np.array([[0.0, np.nan], [0.0, 1.0]])
    allowed = np.array([[True, False], [True, True]])
    assert list(solve_budget(costs, losses, allowed, removed_params=2)) == [0, 1]
    with pytest.raises(BudgetError, match="component 0 option 1"):
        solve_front(costs, losses)


def test_malformed_tables_raise_budget_error():
    with pytest.raises(BudgetError, match="shape"):
        solve_front(np.zeros((2, 3), int), np.zeros((2, 2)))
    with pytest.raises(BudgetError, match="negative cost"):
        solve_front(np.array([[0, -1]]), np.zeros((1, 2)))
    with pytest.raises(BudgetError, match="whole numbers"):
        solve_front(np.array([[0, 1.5]]), np.zeros((1, 2)))


def test_component_without_allowed_option_is_named():
    allowed = np.array([[True, True], [False, False], [True, False]])
    with pytest.raises(BudgetError, match="component 1 "):
        solve_front(np.ones((3, 2), int), np.zeros((3, 2)), allowed)


# --- constraints ---------------------------------------------------------------------------

GRID = np.array([0.0, 0.25, 0.5, 0.75])


@FAST
@given(
    instances(max_comp=5, max_opt=4, masked=False),
    st.data(),
)
@pytest.mark.slow
def test_locks_and_rate_bounds_are_respected(instance, data):
    costs, losses, _ = instance
    n_comp, n_opt = costs.shape
    grid = GRID[:n_opt]
    locked = {c: float(grid[data.draw(st.integers(0, n_opt - 1))]) for c in data.draw(st.sets(st.integers(0, n_comp - 1)))}
    free_lo = data.draw(st.integers(0, n_opt - 1))
    free_hi = data.draw(st.integers(free_lo, n_opt - 1))
    min_rate = np.full(n_comp, grid[free_lo])
    max_rate = np.full(n_comp, grid[free_hi])
    for c, rate in locked.items():  # keep locks consistent with the bounds
        min_rate[c], max_rate[c] = min(rate, min_rate[c]), max(rate, max_rate[c])
    allowed = constraint_mask(grid, n_comp, locked=locked, min_rate=min_rate, max_rate=max_rate)
    front = solve_front(costs, losses, allowed, n_buckets=64)
    for b in np.flatnonzero(np.isfinite(front.best_loss)):
        rates = grid[front.choices[b]]
        assert ((rates >= min_rate) & (rates <= max_rate)).all()
        for c, rate in locked.items():
            assert rates[c] == rate
        expected, _ = brute_force(costs, losses, allowed, b)
        assert same_loss(front.best_loss[b], expected)


def test_constraint_mask_shapes_and_bounds():
    mask = constraint_mask(GRID, 3, locked={1: 0.5}, min_rate=0.25, max_rate=np.array([0.75, 0.75, 0.25]))
    assert mask.tolist() == [
        [False, True, True, True],
        [False, False, True, False],
        [False, True, False, False],
    ]
    assert constraint_mask(GRID, 2).all()
    # A rate from JSON or a sum of floats still hits the grid.
    assert constraint_mask(GRID, 1, locked={0: 0.1 + 0.15})[0].tolist() == [False, True, False, False]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_rate=0.5, max_rate=0.25), "component 0: min rate 0.5 is above max rate 0.25"),
        (dict(locked={1: 0.3}), "component 1 is locked at rate 0.3, which is not on the rate grid"),
        (dict(locked={0: 0.75}, max_rate=0.5), "component 0 is locked at rate 0.75, outside"),
        (dict(locked={0: 0.0}, min_rate=0.25), "component 0 is locked at rate 0, outside"),
        (dict(locked={5: 0.25}), "locked component 5 is out of range"),
        (dict(min_rate=0.3, max_rate=0.4), "component 0 has no grid rate within"),
        (dict(min_rate=[0.0, 0.9]), "component 1 has no grid rate within"),
        (dict(max_rate=[0.5, 0.5, 0.5]), "one entry per component"),
    ],
)
def test_contradictory_constraints_raise_one_line(kwargs, message):
    with pytest.raises(BudgetError, match=message) as caught:
        constraint_mask(GRID, 2, **kwargs)
    assert "\n" not in str(caught.value)


# --- uniform baseline -------------------------------------------------------------------------


@FAST
@given(instances(masked=False), st.integers(-2, 40))
@pytest.mark.slow
def test_uniform_choice_is_the_smallest_grid_rate_that_meets_the_budget(instance, request):
    costs, _, _ = instance
    n_comp, n_opt = costs.shape
    grid = GRID[:n_opt]
    totals = costs.sum(axis=0)
    meets = np.flatnonzero(totals >= request)
    if meets.size == 0:
        with pytest.raises(BudgetError, match=f"at most {totals.max():,}"):
            uniform_choice(costs, grid, request)
        return
    choice = uniform_choice(costs, grid, request)
    assert (choice == meets[0]).all() and choice.shape == (n_comp,)
    assert chosen_cost(costs, choice) >= request


def test_uniform_choice_orders_by_rate_not_index():
    costs = np.array([[4, 0, 2], [4, 0, 2]])
    grid = np.array([0.5, 0.0, 0.25])
    assert list(uniform_choice(costs, grid, 3)) == [2, 2]
    assert list(uniform_choice(costs, grid, 0)) == [1, 1]


def test_dp_never_loses_to_uniform():
    rng = np.random.default_rng(0)
    costs = np.tile(np.arange(4) * 100, (6, 1))
    losses = np.sort(rng.random((6, 4)), axis=1) * rng.random((6, 1)) * 10
    for request in (0, 600, 1200, 1800):
        uniform = uniform_choice(costs, GRID, request)
        planned = solve_budget(costs, losses, removed_params=request)
        assert chosen_cost(costs, planned) >= request
        assert chosen_loss(losses, planned) <= chosen_loss(losses, uniform) + 1e-12
