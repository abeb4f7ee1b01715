"""EvoPress-style evolutionary refinement of the DP plan (Sieberling et al., 2024).

Seeded with the DP plan, mutations move one grid step of rate from one slot to others at
equal budget, and candidates are scored by the *true* end-to-end calibration loss (their
units masked on the dense model, ``surgery.masked_plan``). It tests the DP's one
assumption, that per-component losses add up, and never returns a plan worse than its
seed on the scoring windows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from gap_engine.core.config import DEFAULT_N_BUCKETS
from gap_engine.core.progress import NO_HOOKS, Hooks, reporting, steps
from gap_engine.evaluate.metrics import mean_nll
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan
from gap_engine.plan.front import dp_choice, dp_solution, grid_plan
from gap_engine.plan.problem import Constraints, PlanningProblem, charged_counts, check_budget_fraction, planning_problem
from gap_engine.prune.importance import ImportanceScores
from gap_engine.prune.surgery import masked_plan
from gap_engine.tables.artefact import LossTable

log = logging.getLogger(__name__)


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
    lm: LoadedModel,
    table: LossTable,
    budget: float,
    windows: torch.Tensor,
    scores: ImportanceScores,
    constraints: Constraints = Constraints(),
    settings: EvoSettings = EvoSettings(),
    n_buckets: int = DEFAULT_N_BUCKETS,
    smoothed: bool = True,
    hooks: Hooks = NO_HOOKS,
    compensation: str | None = None,
    problem: PlanningProblem | None = None,
) -> EvoResult:
    """EvoPress-style refinement of the DP plan, scored by true calibration loss.

    Every candidate stays on the table's grid and removes at least the budget; it is
    scored by masking its units on ``lm`` (restored afterwards) and measuring the mean
    NLL on the calibration windows. A (1 + offspring) search keeps the best; the DP seed
    is only replaced by a candidate better by ``min_improvement``, so the result is never
    worse than the seed on these windows.

    Args:
        lm: the dense LoadedModel the table was built for (masked and restored).
        table, budget, constraints, n_buckets, smoothed: as for the DP.
        windows: (N, T) calibration token ids that score a candidate.
        scores: importance scores of the table's criterion (which units a rate removes).
        settings: search length and seed.
        hooks: progress told (generations done, generations total, None); cancel polled
            before every generation.
        compensation: what the prune that follows applies; one that adds biases has them
            charged to the budget (``problem.bias_charges``), as for the DP.
        problem: the planning problem `allocators.check_reach` built and checked ``budget`` on
            (its costs charged for ``compensation``); None: built and checked here.
    """
    table.check_model(lm)
    lm = lm.private()  # candidates are masked on it: never on a model other threads run
    if problem is None:
        budget = check_budget_fraction(budget)
        problem = planning_problem(table, constraints, smoothed, charged_counts(lm, compensation))
        seed_choice = dp_choice(problem, budget, n_buckets)
    else:
        seed_choice = dp_solution(problem, budget, n_buckets)
    target = budget * problem.dense_prunable
    if settings.n_samples is not None:
        windows = windows[: settings.n_samples]
    batch_size = table.spec.windows.batch_size
    dense_loss = mean_nll(lm, windows, batch_size)
    seen: dict[tuple[int, ...], float] = {}

    def true_increase(choice: np.ndarray) -> float:
        key = tuple(int(r) for r in choice)
        if key not in seen:
            attention, mlp = problem.rates(choice)
            with masked_plan(lm, attention, mlp, scores, table.spec.channel_multiple):
                seen[key] = mean_nll(lm, windows, batch_size) - dense_loss
        return seen[key]

    with reporting(hooks):
        best, history = _search(problem, seed_choice, target, true_increase, settings)
    result = EvoResult(
        plan=grid_plan(lm, table, problem, best, budget, "evo", compensation),
        seed_plan=grid_plan(lm, table, problem, seed_choice, budget, "dp", compensation),
        dense_loss=dense_loss,
        seed_predicted=problem.loss(seed_choice),
        seed_actual=true_increase(seed_choice),
        predicted=problem.loss(best),
        actual=true_increase(best),
        evaluations=len(seen),
        history=history,
    )
    log.info(
        "evo: DP predicted %.4f, DP actual %.4f, evo actual %.4f (%d plans scored)",
        result.seed_predicted,
        result.seed_actual,
        result.actual,
        result.evaluations,
    )
    return result


def _search(
    problem: PlanningProblem,
    seed_choice: np.ndarray,
    target: float,
    true_increase: Callable[[np.ndarray], float],
    settings: EvoSettings,
) -> tuple[np.ndarray, list[float]]:
    """The (1 + offspring) search: the best choice found and the best loss after each generation
    (the active stage is told generations done and its cancel polled before each)."""
    rng = np.random.default_rng(settings.seed)
    best, best_loss = seed_choice.copy(), true_increase(seed_choice)
    history = []
    for generation in steps(range(settings.generations), "evolutionary search", "generations"):
        candidates = [c for c in (_mutate(problem, best, target, rng) for _ in range(settings.offspring)) if c is not None]
        scored = [(true_increase(c), i) for i, c in enumerate(candidates)]
        if scored:
            loss, i = min(scored)
            if loss < best_loss - settings.min_improvement:
                best, best_loss = candidates[i], loss
        history.append(best_loss)
        log.info("evo generation %d/%d: best calibration loss increase %.5f", generation + 1, settings.generations, best_loss)
    return best, history
