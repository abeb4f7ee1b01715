"""The explorer's runs: baseline plans for the chart, and prune -> measure -> evaluate -> record.

Each function here is what one background job of the app does, from a loaded dense model
to a typed result (`PruneEvalResult`; ``recovery.RecoveryResult`` for a recovery); the job
layer only adds the model pool, progress and cancel.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import BudgetError, GapError
from gap_engine.core.interrupt import cancel_checks, run_unless_cancelled
from gap_engine.core.progress import (
    COMPENSATE,
    GENERATE,
    HELD_OUT,
    LOAD_MODEL,
    MEASURE,
    NO_HOOKS,
    PLAN,
    PRUNE,
    SAVE,
    SCORE_UNITS,
    TASKS,
    THROUGHPUT,
    Hooks,
    StageFn,
    StageTimer,
)
from gap_engine.data.windows import calibration_windows
from gap_engine.evaluate import history
from gap_engine.evaluate.metrics import EvalSettings, evaluate
from gap_engine.evaluate.tasks import PreparedTasks, task_report
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.stages import objective_increase, obs_windows, plan_for, pruned_as_saved, pruned_by
from gap_engine.plan.allocator_registry import ALLOCATORS, needs_windows
from gap_engine.plan.front_view import net_removed_fraction
from gap_engine.plan.problem import Constraints
from gap_engine.prune.compensations import NO_COMPENSATION, CompensationSettings
from gap_engine.prune.criteria import is_sequential
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.surgery import PruneResult
from gap_engine.tables.artefact import LossTable


@dataclass
class PruneEvalResult:
    """What one prune -> measure -> evaluate -> record run gives back (`prune_and_evaluate`)."""

    run_id: int  # its row in the run history
    plan: dict  # the plan pruned with (RatePlan.to_dict())
    plan_hash: str  # its content hash (RatePlan.content_hash), also in the record's params
    report: dict  # held-out evaluation (EvalReport.to_dict())
    predicted_loss: float | None  # the table's summed prediction of the objective increase
    predicted_basis: str | None  # how the predicted cells were filled (LossTable.basis); None without a table
    actual_loss: float | None  # the measured objective increase on the calibration windows
    objective: str  # the table's objective (nll without a table)
    checkpoint: str | None  # the saved pruned checkpoint; None: not saved
    seconds: float  # wall time of the run
    stage_seconds: dict[str, float]  # wall time per stage (`prune_eval_stages` names)
    params_before: int  # parameters of the dense model
    params_after: int  # parameters of the pruned copy
    compensation: dict | None = None  # what the kept units got after the cut (PruneResult.compensation); None: surgery alone

    @property
    def task_accuracy(self) -> dict[str, dict]:
        """lm-eval task -> TaskScore.to_dict() of the pruned model ({}: run without tasks)."""
        return dict(self.report.get("task_accuracy") or {})

    @property
    def dense_task_accuracy(self) -> dict[str, dict]:
        """The same for the dense model (cached per model + task + limit, so measured once)."""
        return dict(self.report.get("dense_task_accuracy") or {})

    def to_dict(self) -> dict:
        """JSON-ready."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: history.RunRecord, table: LossTable | None = None) -> PruneEvalResult:
        """The result of a finished run as its history row keeps it, so a page reloaded after
        the job's result was gone (a new session) shows the same panel; ``table``: the run's loss
        table, for the basis of its prediction (None: not stated)."""
        params = record.params or {}
        report = {
            "model": record.model,
            "params": record.pruned_params,
            "dense": {"params": record.dense_params, "perplexity": dict(record.dense_perplexity)},
            "perplexity": dict(record.perplexity),
            "kl_to_dense": dict(record.kl),
            "top1_agreement": dict(record.top1),
            "throughput": params.get("throughput"),
            "generations": list(record.generations),
            "settings": params.get("eval") or {},
            "task_accuracy": dict((record.tasks or {}).get("model") or {}),
            "dense_task_accuracy": dict((record.tasks or {}).get("dense") or {}),
        }
        plan = RatePlan.from_dict(dict(record.plan))
        basis = None
        if table is not None and record.table_key == table.key:
            basis = table.basis(table.cells_for(plan.attention_rates, plan.mlp_rates))
        return cls(
            run_id=int(record.id or 0),
            plan=dict(record.plan),
            plan_hash=str(params.get("plan_hash") or plan.content_hash()),
            report=report,
            predicted_loss=record.predicted_loss,
            predicted_basis=basis,
            actual_loss=record.actual_loss,
            objective=str(params.get("objective") or "nll"),
            checkpoint=record.checkpoint,
            seconds=float(record.seconds or 0.0),
            stage_seconds=dict(params.get("stage_seconds") or {}),
            params_before=int(record.dense_params or 0),
            params_after=int(record.pruned_params or 0),
            compensation=params.get("compensation") if isinstance(params.get("compensation"), dict) else None,
        )


@dataclass(frozen=True)
class BaselinePlan:
    """One baseline allocator's plan at one budget: a row of `baseline_rows`."""

    allocator: str
    budget: float  # the budget asked for (fraction of prunable parameters)
    removed_fraction: float | None = None  # of prunable parameters the plan removes; None when out of reach
    predicted_loss: float | None = None  # the plan's summed table loss; None when out of reach
    attention_rates: list[float] | None = None  # per layer; None when out of reach
    mlp_rates: list[float] | None = None  # per layer; None when out of reach
    error: str | None = None  # why the allocator cannot reach the budget (one line); None: planned

    @property
    def planned(self) -> bool:
        """Whether the allocator reached the budget (the row has a plan, not an error)."""
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready row: allocator, budget and either the plan's numbers or ``error``."""
        if self.error is not None:
            return {"allocator": self.allocator, "budget": self.budget, "error": self.error}
        return {
            "allocator": self.allocator,
            "budget": self.budget,
            "removed_fraction": self.removed_fraction,
            "predicted_loss": self.predicted_loss,
            "attention_rates": self.attention_rates,
            "mlp_rates": self.mlp_rates,
        }


def baseline_rows(
    lm: LoadedModel,
    table: LossTable,
    budgets: Sequence[float],
    allocators: Sequence[str],
    constraints: Constraints = Constraints(),
    hooks: Hooks = NO_HOOKS,
    compensation: str | None = None,
) -> list[BaselinePlan]:
    """Plans of the baseline allocators at a few budgets, for overlaying on the DP front.

    Args:
        lm: the dense model (FLAP and OWL hook it: a shared one is copied first).
        hooks: the stages (``baseline_stages``) entered after the load, each plan told as a message
            (the allocator and budget) with its progress (plans done, plans); cancel polled between plans.
        compensation: the one the prune applies (`plan_for`): one that adds biases has them
            paid from each budget, as the DP front beside them was charged.
    Returns:
        One BaselinePlan per (allocator, budget): removed_fraction of prunable parameters
        (net of the biases it was counted for), predicted_loss, attention_rates, mlp_rates;
        a budget an allocator cannot reach gives one with ``error`` instead.
    """
    table.check_model(lm)
    if any(needs_windows(allocator) for allocator in allocators):
        lm = lm.private()  # once for every plan: they hook or mask it
    scores = None
    if scores_first(allocators):
        hooks.enter(SCORE_UNITS)
        _step(hooks, "importance scores", 0, 0)
        windows = calibration_windows(lm.tokenizer, table.spec.windows)
        scores = compute_importance(lm, windows, table.spec.criterion, table.spec.windows.batch_size, Hooks(cancel=hooks.cancel))
    rows: list[BaselinePlan] = []
    hooks.enter(PLAN)
    pairs = [(a, float(b)) for a in allocators for b in budgets]
    for i, (allocator, budget) in enumerate(pairs):
        hooks.check_cancelled(f"baseline plans cancelled after {i} of {len(pairs)}")
        _step(hooks, f"{allocator} at {budget:.0%}", i, len(pairs))
        try:
            plan = plan_for(lm, table, budget, allocator, constraints, scores, compensation=compensation)
        except BudgetError as exc:
            rows.append(BaselinePlan(allocator, budget, error=str(exc)))
            continue
        rows.append(
            BaselinePlan(
                allocator,
                budget,
                removed_fraction=net_removed_fraction(plan),
                predicted_loss=plan.predicted_loss,
                attention_rates=plan.attention_rates,
                mlp_rates=plan.mlp_rates,
            )
        )
    _step(hooks, "done", len(pairs), len(pairs))
    return rows


def baseline_stages(allocators: Sequence[str]) -> tuple[str, ...]:
    """The stages of a baseline-plans job in order, from loading the dense model (FLAP's: its units scored first)."""
    return (LOAD_MODEL, SCORE_UNITS, PLAN) if scores_first(allocators) else (LOAD_MODEL, PLAN)


def scores_first(allocators: Sequence[str]) -> bool:
    """Whether a baseline-plans job scores the units before its plans (an allocator's entry asks: FLAP's)."""
    return any(ALLOCATORS[allocator].scores_first for allocator in allocators)


def _step(hooks: Hooks, message: str, done: int, total: int) -> None:
    """A named step with its position among the steps (the message first: a job shows both)."""
    hooks.say(message)
    hooks.report(done, total, None)


def _run_params(
    calib: WindowSpec,
    report: dict,
    objective: str,
    constraints: Constraints | None,
    result: PruneResult,
    stage_seconds: dict[str, float],
    obs_samples: int | None,
) -> dict:
    """The settings of a run as the history stores them (``obs_windows``: those a sequential criterion read)."""
    params = {
        "calibration": asdict(calib),
        "eval": report.get("settings", {}),
        "objective": objective,
        "constraints": None if constraints is None else constraints.to_dict(),
        "throughput": report.get("throughput"),  # with every repeat, for the spread
        "stage_seconds": stage_seconds,
        "plan_hash": result.plan.content_hash(),
        "compensation": result.compensation,
    }
    if is_sequential(result.plan.criterion):
        params["obs_windows"] = asdict(obs_windows(calib, obs_samples))
    return params


def prune_eval_stages(eval_settings: EvalSettings, checkpoint: bool, tasks: bool = False, compensated: bool = False) -> tuple[str, ...]:
    """The stages of a prune-and-evaluate job in order, from loading the dense model
    (``tasks``: lm-eval task accuracy after the held-out evaluation; ``compensated``: the
    kept units refit after the cut)."""
    stages = [LOAD_MODEL, PLAN, PRUNE] + ([COMPENSATE] if compensated else []) + [MEASURE, HELD_OUT]
    stages += [THROUGHPUT] if eval_settings.throughput else []
    stages += [GENERATE] if eval_settings.generations else []
    stages += [TASKS] if tasks else []
    return tuple(stages + ([SAVE] if checkpoint else []))


def _chosen_plan(dense, table, budget, allocator, constraints, plan, compensation: str) -> RatePlan:
    """The given plan checked against the model, or the allocator's plan at the budget (the
    biases ``compensation`` adds paid from it)."""
    if plan is not None:
        plan.check_model(dense)
        return plan
    if table is None or budget is None:
        raise GapError("a run needs either a plan or a loss table and a budget")
    return plan_for(dense, table, budget, allocator, constraints or Constraints(), compensation=compensation)


_STOPPED = "prune and evaluate cancelled"


def _saved(pruned: LoadedModel, result: PruneResult, checkpoint_dir: str | Path | None, report: dict, at: StageFn) -> str | None:
    """The checkpoint folder ``pruned`` was saved to, its model card holding ``report`` (None: not saved)."""
    if checkpoint_dir is None:
        return None
    at(SAVE)
    return str(save_pruned(pruned, result.plan, result.kept_indices(), checkpoint_dir, eval_report=report))


def _measure_and_evaluate(dense, pruned, calib, objective, eval_settings, hooks: Hooks, at: StageFn, tasks=None) -> tuple[float, dict]:
    """The measured objective increase on the calibration windows, then the held-out report (with
    task accuracy when ``tasks`` are given); evaluate's own progress lines become stages through ``at``
    (``hooks``: only its cancel is read, polled at every block of both models)."""

    def evaluation_step(message: str) -> None:
        at(THROUGHPUT if message.startswith("throughput") else GENERATE if message.startswith("generating") else HELD_OUT)

    with cancel_checks(dense, hooks, _STOPPED), cancel_checks(pruned, hooks, _STOPPED):
        windows = run_unless_cancelled(lambda: calibration_windows(dense.tokenizer, calib), hooks, f"{_STOPPED} while reading the text")
        actual = objective_increase(pruned, dense, windows, objective, calib.batch_size)
        report = evaluate(pruned, dense, eval_settings, Hooks(message=evaluation_step)).to_dict()
        if tasks is not None:
            at(TASKS)
            report |= task_report(pruned, dense, tasks)
    return actual, report


def prune_and_evaluate(
    dense: LoadedModel,
    eval_settings: EvalSettings,
    *,
    table: LossTable | None = None,
    budget: float | None = None,
    allocator: str = "dp",
    constraints: Constraints | None = None,
    plan: RatePlan | None = None,
    checkpoint_dir: str | Path | None = None,
    history_path: str | Path | None = None,
    hooks: Hooks = NO_HOOKS,
    tasks: PreparedTasks | None = None,
    compensation: CompensationSettings = NO_COMPENSATION,
    criterion: str | None = None,
    obs_samples: int | None = None,
) -> PruneEvalResult:
    """Plan (or take ``plan``), prune a copy of ``dense``, measure it, save it, record the run.
    Args:
        dense: the dense model (forward passes only; FLAP/OWL/evo plan on a private copy).
        eval_settings: held-out evaluation settings.
        table: the loss table (needed unless ``plan`` is given); its calibration windows
            score the units and give the measured ("actual") objective increase.
        budget, allocator, constraints: what `allocators.plan_from_table` gets; or ``plan``, a ready (uploaded) one.
        checkpoint_dir, history_path: where to save the checkpoint (None: not saved), the history (None: the default).
        hooks: each stage entered as it starts (`prune_eval_stages`); cancel polled per block and between stages.
        tasks: prepared lm-eval tasks whose accuracy (and dense's) joins report and history.
        compensation: what the kept units get after the cut, fitted on the table's calibration windows (its
            ``compensate`` stage entered when active; a budget pays for its biases); recorded in the run and the checkpoint.
        criterion, obs_samples: ``stages.pruned_by``'s criterion (None: the plan's own) and ``obs``'s window count; both recorded.
    """
    started, timer = time.perf_counter(), StageTimer(hooks.stage)

    def at(name: str) -> None:
        hooks.check_cancelled(f"prune and evaluate cancelled before the {name} stage")
        timer(name)

    at(PLAN)
    plan = pruned_by(_chosen_plan(dense, table, budget, allocator, constraints, plan, compensation.mode), criterion)
    calib = table.spec.windows if table is not None else WindowSpec()
    stage_hooks = Hooks(cancel=hooks.cancel, stage=at)
    at(PRUNE)
    # As stored, saved or not: Recover, `gap eval` and `gap compare` measure the stored weights.
    pruned, result = pruned_as_saved(dense, plan, calib, hooks=stage_hooks, compensation=compensation, obs_samples=obs_samples)
    plan = result.plan  # with the parameter counts recounted from the model (a hand-written plan may lack them)
    at(MEASURE)
    objective = table.spec.objective if table is not None else "nll"
    actual, report = _measure_and_evaluate(dense, pruned, calib, objective, eval_settings, hooks, at, tasks)
    checkpoint = _saved(pruned, result, checkpoint_dir, report, at)
    stage_seconds, seconds = timer.finish(), time.perf_counter() - started
    record = history.RunRecord.from_report(
        plan.to_dict(),
        report,
        allocator=plan.allocator,
        table_key=plan.table_key or (table.key if table is not None else None),
        budget=plan.budget,
        params=_run_params(calib, report, objective, constraints, result, stage_seconds, obs_samples),
        predicted_loss=plan.predicted_loss,
        actual_loss=float(actual) if actual is not None and math.isfinite(actual) else None,
        checkpoint=checkpoint,
        seconds=seconds,
    )
    run_id = history.record_run(record, Path(history_path) if history_path is not None else None)
    return PruneEvalResult(
        run_id=run_id,
        plan=plan.to_dict(),
        plan_hash=plan.content_hash(),
        report=report,
        predicted_loss=plan.predicted_loss,
        predicted_basis=None if table is None else table.basis(table.cells_for(plan.attention_rates, plan.mlp_rates)),
        actual_loss=record.actual_loss,
        objective=objective,
        checkpoint=checkpoint,
        seconds=seconds,
        stage_seconds=stage_seconds,
        params_before=result.params_before,
        params_after=result.params_after,
        compensation=result.compensation,
    )
