"""Allocators side by side: every allocator at every budget, pruned for real and measured.

Plans are made first (so an unreachable budget fails before any pruning); importance
scores and the dense model's numbers are computed once, and every plan is measured on the
same calibration and held-out windows, so differences between allocators are paired.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from gap_engine.core.config import DEFAULT_HELDOUT_SPLIT, WindowSpec
from gap_engine.core.errors import PlanError
from gap_engine.core.progress import NO_HOOKS, Hooks
from gap_engine.data.windows import calibration_windows, heldout_windows
from gap_engine.evaluate.metrics import mean_nll
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.stages import objective_increase, obs_windows, pruned_as_saved, pruned_by
from gap_engine.plan.allocator_registry import ALLOCATORS
from gap_engine.plan.allocators import ReachableBudget, check_reach, plan_from_table
from gap_engine.plan.evo import EvoSettings, evolve
from gap_engine.plan.problem import Constraints
from gap_engine.plan.step import plan_criterion, table_model_type, takes
from gap_engine.prune.compensation_pass import calibration_tokens, check_calibration
from gap_engine.prune.compensations import NO_COMPENSATION, CompensationSettings, default_for, fitted_after_cut
from gap_engine.prune.criteria import CRITERIA, is_sequential
from gap_engine.prune.importance import ImportanceScores, compute_importance
from gap_engine.tables.artefact import LossTable


@dataclass
class Reference:
    """The dense model's numbers on the comparison windows (computed once)."""

    calib_loss: float  # mean NLL on the calibration windows
    perplexity: dict[str, float]  # held-out source -> perplexity


@dataclass
class Outcome:
    """One plan, pruned for real, beside what the table predicted."""

    allocator: str  # how the budget was spread
    budget: float  # requested fraction of prunable parameters
    removed: int  # prunable parameters removed
    removed_fraction: float  # of the prunable parameters
    params_after: int  # parameters of the pruned model
    predicted_loss: float | None  # the table's summed loss
    calib_loss_increase: float  # true mean NLL increase on the calibration windows
    perplexity: dict[str, float]  # held-out source -> perplexity of the pruned model
    dense_perplexity: dict[str, float]  # the same for the dense model
    dense_calib_loss: float  # dense mean NLL on the calibration windows
    extras: dict = field(default_factory=dict)  # allocator-specific numbers (evo: the DP seed's)
    objective: str = "nll"  # the table's objective, which predicted_loss and calib_objective_increase are in
    calib_objective_increase: float | None = (
        None  # the measured increase of that objective on the calibration windows (what predicted_loss predicts)
    )
    predicted_basis: str | None = None  # what the prediction sums: "measured", "estimated" or "mixed" table cells
    compensation: str = "none"  # what the kept units got after the cut (prune.compensations)
    bias_params: int = 0  # parameters the compensation's biases added (params_after counts them; removed does not)
    criterion: str = ""  # what chose the units: the plan's own, or the one its allocator spec named (dp:obs)
    obs_windows: int | None = None  # calibration windows a sequential criterion (obs) read; None: none did
    fit_windows: int | None = None  # calibration windows a compensation after the cut was fitted on; None: none was
    fit_weighting: str = "tokens"  # how that fit counted its tokens (CompensationSettings.weighting)

    def row(self) -> dict:
        """Flat dict for CSV output."""
        out = {k: v for k, v in asdict(self).items() if k not in ("perplexity", "dense_perplexity", "extras")}
        for source, ppl in self.perplexity.items():
            out[f"ppl_{source}"] = ppl
            out[f"dense_ppl_{source}"] = self.dense_perplexity[source]
        out.update(self.extras)
        return out

    @classmethod
    def from_row(cls, row: Mapping[str, str]) -> Outcome:
        """The Outcome a CSV row written from ``row()`` holds (floats as written; empty cells dropped).

        Scalar fields are parsed by their declared type, so a field added to the class is read
        back without touching this; unknown columns are the extras."""
        parse = {f.name: {"int": int, "int | None": int, "str": str, "str | None": str}.get(str(f.type), float) for f in fields(cls)}
        values: dict = {"predicted_loss": None}
        perplexity, dense, extras = {}, {}, {}
        for key, text in row.items():
            if text in ("", None):
                continue
            if key.startswith("dense_ppl_"):
                dense[key[len("dense_ppl_") :]] = float(text)
            elif key.startswith("ppl_"):
                perplexity[key[len("ppl_") :]] = float(text)
            elif key in parse:
                values[key] = parse[key](text)
            else:
                extras[key] = int(text) if text.lstrip("-").isdigit() else float(text)
        return cls(**values, perplexity=perplexity, dense_perplexity=dense, extras=extras)


def heldout_sets(tokenizer, windows: WindowSpec, splits: Sequence[str] = (DEFAULT_HELDOUT_SPLIT,)) -> dict[str, torch.Tensor]:
    """Held-out windows of every source named in ``windows.data`` (never overlapping calibration
    text), from each held-out split in ``splits`` (``report``: results; ``selection``: choices).

    Returns:
        label -> (N, T) windows; the label is the source alone for one split, ``source/split``
        for several (``heldout_label``).
    """
    return {
        heldout_label(source, split, len(splits)): heldout_windows(tokenizer, windows.for_source(source), split)
        for split in splits
        for source in windows.sources()
    }


def heldout_label(source: str, split: str, n_splits: int = 1) -> str:
    """The name a set of held-out windows goes by in columns and tables: ``source`` or ``source/split``."""
    return source if n_splits == 1 else f"{source}/{split}"


def reference_numbers(lm: LoadedModel, calib: torch.Tensor, heldout: Mapping[str, torch.Tensor], batch_size: int) -> Reference:
    return Reference(
        calib_loss=mean_nll(lm, calib, batch_size),
        perplexity={source: math.exp(mean_nll(lm, w, batch_size)) for source, w in heldout.items()},
    )


def measure_plan(
    dense: LoadedModel,
    plan: RatePlan,
    calib_spec: WindowSpec,
    calib: torch.Tensor,
    heldout: Mapping[str, torch.Tensor],
    scores: ImportanceScores | None,
    reference: Reference,
    table: LossTable | None = None,
    extra: Callable[[LoadedModel], dict] | None = None,
    compensation: CompensationSettings = NO_COMPENSATION,
    obs_samples: int | None = None,
) -> Outcome:
    """Prune a copy of the dense model with ``plan`` and measure it beside the table's prediction.

    The copy is what a checkpoint of the plan would hold (``stages.pruned_as_saved``: rounded to
    the default storage dtype), so its numbers are those the explorer's run and ``gap eval`` report.

    Args:
        dense: the dense LoadedModel (not modified; a copy is pruned).
        plan: the plan (its predicted_loss is reported beside the truth).
        calib_spec, calib: the calibration windows' settings and their (N, T) token ids.
        heldout: source -> (N, T) held-out windows for perplexity.
        scores: the dense model's importance scores of ``plan.criterion`` on ``calib`` (None:
            computed, or none for a sequential criterion, which prunes on ``calib_spec``'s windows).
        reference: the dense numbers on the same windows.
        table: the loss table behind the prediction: its objective is measured on ``calib``
            too, and the prediction's basis (measured or estimated cells) is recorded.
        extra: more numbers of the pruned model (e.g. task accuracy), kept in ``extras``.
        compensation: what the kept units get after the cut, fitted on ``calib_spec``.
        obs_samples: calibration windows a sequential criterion (``obs``) reads (None: ``stages.obs_windows``' default).
    """
    pruned, result = pruned_as_saved(dense, plan, calib_spec, scores=scores, compensation=compensation, obs_samples=obs_samples)
    batch_size = calib_spec.batch_size
    calib_loss = mean_nll(pruned, calib, batch_size)
    perplexity = {source: math.exp(mean_nll(pruned, w, batch_size)) for source, w in heldout.items()}
    objective = table.spec.objective if table is not None else "nll"
    measured = calib_loss - reference.calib_loss
    if objective != "nll":
        measured = objective_increase(pruned, dense, calib, objective, batch_size)
    return Outcome(
        allocator=plan.allocator,
        budget=plan.budget if plan.budget is not None else plan.params["removed_fraction_of_prunable"],
        removed=int(plan.params["removed"]),
        removed_fraction=float(plan.params["removed_fraction_of_prunable"]),
        params_after=result.params_after,
        predicted_loss=plan.predicted_loss,
        calib_loss_increase=calib_loss - reference.calib_loss,
        perplexity=perplexity,
        dense_perplexity=dict(reference.perplexity),
        dense_calib_loss=reference.calib_loss,
        objective=objective,
        calib_objective_increase=measured,
        predicted_basis=None if table is None else table.basis(table.cells_for(plan.attention_rates, plan.mlp_rates)),
        extras=extra(pruned) if extra is not None else {},
        compensation=compensation.mode,
        bias_params=int((result.compensation or {}).get("bias_params", 0)),
        criterion=plan.criterion,
        obs_windows=obs_windows(calib_spec, obs_samples).n_samples if is_sequential(plan.criterion) else None,
        fit_windows=((result.compensation or {}).get("windows") or {}).get("n_samples"),
        fit_weighting=str((result.compensation or {}).get("weighting", "tokens")),
    )


def allocator_spec(spec: str) -> tuple[str, str | None]:
    """(allocator, criterion or None) of ``ALLOCATOR`` or ``ALLOCATOR:CRITERION``: the allocator's
    plan with its units chosen by ``CRITERION`` instead of its own (``dp:obs``: GAP's DP rates,
    pruned and updated by SlimGPT's OBS), so one comparison can hold both.

    Raises:
        PlanError: an unknown allocator or criterion.
    """
    allocator, separator, criterion = spec.strip().partition(":")
    if allocator not in ALLOCATORS:
        raise PlanError(f"unknown allocator '{allocator}'; choose from {', '.join(ALLOCATORS)} (optionally :CRITERION, e.g. dp:obs)")
    if not separator:
        return allocator, None
    if criterion not in CRITERIA:
        raise PlanError(f"unknown criterion '{criterion}' in '{spec.strip()}' (ALLOCATOR:CRITERION); choose from {', '.join(CRITERIA)}")
    return allocator, criterion


def shipped_compensation(
    table: LossTable,
    allocator: str,
    criterion: str | None,
    compensation: CompensationSettings | None,
    samples: int | None = None,
    weighting: str | None = None,
) -> CompensationSettings:
    """What the kept units of a `compare` row get: ``compensation`` where the row's step takes it, else the
    step's own default (``prune.compensations.default_for``). None (not asked for): every row its own
    default, so a row pruned by a sequential criterion (OBS, whose update is its compensation) gets none
    and the others their model family's default (``prune.compensations.family_default``); a refit asked
    for gives OBS rows none (OBS takes no refit). Every row that fits a compensation after the cut fits it on
    ``samples`` windows (None: ``compensation``'s own count, else the table's); OBS fits its update and any bias
    on its own windows. Every row that fits anything weighs its tokens as ``weighting`` says (None: as
    ``compensation`` or the default does; ``CompensationSettings.weighting``), OBS's bias included."""
    mode = None if compensation is None else compensation.mode
    step = criterion or plan_criterion(allocator, table, mode)
    shipped = compensation if compensation is not None and takes(step, mode) else default_for(step, table_model_type(table))
    if weighting is not None and shipped.active:
        shipped = dataclasses.replace(shipped, weighting=weighting)
    if not fitted_after_cut(step, shipped.mode):
        return dataclasses.replace(shipped, samples=None)
    return dataclasses.replace(shipped, samples=samples if samples is not None else shipped.samples)


def check_rows(
    lm: LoadedModel,
    table: LossTable,
    budgets: Sequence[float],
    allocators: Sequence[str],
    constraints: Constraints,
    compensation: CompensationSettings | None,
) -> dict[tuple[float, str], ReachableBudget]:
    """Every row of `compare` checked within reach for what it ships, before anything slow.

    Returns:
        (budget, allocator as given) -> what `allocators.check_reach` checked, for `compare` to plan on.
    Raises:
        BudgetError: the first budget out of reach of an allocator (budgets in order, then allocators).
    """
    rows = {}
    for budget in budgets:
        for spec in allocators:
            allocator, criterion = allocator_spec(spec)
            shipped = shipped_compensation(table, allocator, criterion, compensation)
            rows[budget, spec] = check_reach(lm, table, budget, allocator, constraints, shipped.mode)
    return rows


def compare(
    lm: LoadedModel,
    table: LossTable,
    budgets: Sequence[float],
    allocators: Sequence[str],
    heldout: Mapping[str, torch.Tensor],
    constraints: Constraints = Constraints(),
    evo: EvoSettings = EvoSettings(),
    hooks: Hooks = NO_HOOKS,
    extra: Callable[[LoadedModel], dict] | None = None,
    compensation: CompensationSettings | None = NO_COMPENSATION,
    obs_samples: int | None = None,
    checked: Mapping[tuple[float, str], ReachableBudget] | None = None,
    fit_samples: int | None = None,
    fit_weighting: str | None = None,
) -> list[Outcome]:
    """Every allocator at every budget, pruned for real and measured on the same windows.

    Args:
        lm: the dense model the table was built for.
        table: its loss table (its calibration windows score units and give the calibration loss).
        budgets: fractions of prunable parameters to remove.
        allocators: names from ALLOCATORS, each optionally ``:CRITERION`` (``allocator_spec``:
            ``dp:obs`` prunes DP's plan with SlimGPT's OBS instead of the table's criterion).
        heldout: source -> (N, T) held-out windows.
        constraints, evo: as for `allocators.plan_from_table`.
        hooks: its message is told one line per finished plan.
        extra: more numbers of each pruned model (task accuracy), as extra columns.
        compensation, fit_samples, fit_weighting: what each row's kept units get after the cut, its biases paid from
            each budget, fitted on ``fit_samples`` windows weighed as ``fit_weighting`` says (``shipped_compensation``).
        obs_samples: calibration windows a sequential criterion (``obs``) reads (None: ``stages.obs_windows``' default).
        checked: `check_rows` of these arguments, when the caller checked them first (None: checked here).
    """
    specs = [allocator_spec(a) for a in allocators]
    table.check_model(lm)
    calib_spec = table.spec.windows
    ships = {spec: shipped_compensation(table, a, c, compensation, fit_samples, fit_weighting) for spec, (a, c) in zip(allocators, specs)}
    for shipped in ships.values():  # before anything slow
        check_calibration(lm, calibration_tokens(calib_spec, shipped), shipped)
    windows = calibration_windows(lm.tokenizer, calib_spec)
    scores = compute_importance(lm, windows, table.spec.criterion, calib_spec.batch_size)
    by_criterion = {scores.criterion: scores}

    def scores_of(criterion: str) -> ImportanceScores | None:
        """Scores of a plan's criterion (a baseline may prune by its paper's own), computed once each."""
        if is_sequential(criterion):
            return None
        if criterion not in by_criterion:
            by_criterion[criterion] = compute_importance(lm, windows, criterion, calib_spec.batch_size)
        return by_criterion[criterion]

    if checked is None:  # fail fast on an unreachable budget, before the slow part
        checked = check_rows(lm, table, budgets, allocators, constraints, compensation)
    reference = reference_numbers(lm, windows, heldout, calib_spec.batch_size)
    outcomes = []
    for budget in budgets:
        for spec, (allocator, criterion) in zip(allocators, specs):
            started = time.perf_counter()
            own, reachable, extras = ships[spec], checked[budget, spec], {}
            if allocator == "evo":
                result = evolve(lm, table, budget, windows, scores, constraints, evo, compensation=own.mode, problem=reachable.problem)
                plan = result.plan
                extras = {
                    "dp_predicted": result.seed_predicted,
                    "dp_actual": result.seed_actual,
                    "evo_actual": result.actual,
                    "evo_evaluations": result.evaluations,
                }
            else:
                plan = plan_from_table(
                    lm, table, budget, allocator, constraints, windows, scores, compensation=own.mode, reachable=reachable
                )
            plan = pruned_by(plan, criterion)
            outcome = measure_plan(
                lm, plan, calib_spec, windows, heldout, scores_of(plan.criterion), reference, table, extra, own, obs_samples
            )
            outcome.extras = outcome.extras | extras | {"seconds": round(time.perf_counter() - started, 1)}
            outcomes.append(outcome)
            hooks.say(f"{spec.strip()} at {budget:.0%}: calibration loss {outcome.calib_loss_increase:+.4f}")
    return outcomes
