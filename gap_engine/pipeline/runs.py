"""The explorer's runs: baseline plans for the chart, and prune -> measure -> evaluate -> record.

Each function here is what one background job of the app does, from a loaded dense model
to a JSON-ready result; the job layer only adds the model pool, progress and cancel.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from .. import history
from ..allocate import Constraints
from ..checkpoint import save_pruned
from ..config import WindowSpec
from ..data import calibration_windows
from ..errors import BudgetError, GapError
from ..evaluate import EvalSettings, evaluate
from ..importance import compute_importance
from ..models import LoadedModel
from ..plan import RatePlan
from ..progress import CancelToken, check_cancelled
from ..tables import LossTable
from .stages import objective_increase, plan_for, pruned_copy

StepFn = Callable[[str, int, int], None]  # (message, steps done, steps total)


def baseline_rows(
    lm: LoadedModel,
    table: LossTable,
    budgets: Sequence[float],
    allocators: Sequence[str],
    constraints: Constraints = Constraints(),
    step: StepFn | None = None,
    cancel: CancelToken | None = None,
) -> list[dict]:
    """Plans of the baseline allocators at a few budgets, for overlaying on the DP front.

    Args:
        lm: the dense model (FLAP and OWL hook it; pass a private copy when it is shared).
    Returns:
        One row per (allocator, budget): allocator, budget, removed_fraction of prunable
        parameters, predicted_loss, attention_rates, mlp_rates; a budget an allocator
        cannot reach gives a row with ``error`` instead.
    """
    table.check_model(lm)
    scores = None
    if "flap" in allocators:
        if step:
            step("importance scores for FLAP", 0, 0)
        windows = calibration_windows(lm.tokenizer, table.spec.windows)
        scores = compute_importance(lm, windows, table.spec.criterion, table.spec.windows.batch_size, cancel=cancel)
    rows = []
    pairs = [(a, float(b)) for a in allocators for b in budgets]
    for i, (allocator, budget) in enumerate(pairs):
        check_cancelled(cancel, f"baseline plans cancelled after {i} of {len(pairs)}")
        if step:
            step(f"{allocator} at {budget:.0%}", i, len(pairs))
        try:
            plan = plan_for(lm, table, budget, allocator, constraints, scores)
        except BudgetError as exc:
            rows.append({"allocator": allocator, "budget": budget, "error": str(exc)})
            continue
        rows.append(
            {
                "allocator": allocator,
                "budget": budget,
                "removed_fraction": float(plan.params["removed_fraction_of_prunable"]),
                "predicted_loss": plan.predicted_loss,
                "attention_rates": plan.attention_rates,
                "mlp_rates": plan.mlp_rates,
            }
        )
    if step:
        step("done", len(pairs), len(pairs))
    return rows


def _run_params(calib: WindowSpec, report: dict, objective: str, constraints: Constraints | None) -> dict:
    """The settings of a run as the history stores them."""
    return {
        "calibration": asdict(calib),
        "eval": report.get("settings", {}),
        "objective": objective,
        "constraints": None if constraints is None else constraints.to_dict(),
    }


def _chosen_plan(dense, table, budget, allocator, constraints, plan) -> RatePlan:
    """The given plan checked against the model, or the allocator's plan at the budget."""
    if plan is not None:
        plan.check_model(dense)
        return plan
    if table is None or budget is None:
        raise GapError("a run needs either a plan or a loss table and a budget")
    planner_lm = dense if allocator in ("dp", "uniform") else dense.copy()  # the others hook or mask the model
    return plan_for(planner_lm, table, budget, allocator, constraints or Constraints())


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
    step: StepFn | None = None,
    cancel: CancelToken | None = None,
) -> dict:
    """Plan (or take ``plan``), prune a copy of ``dense``, measure it, save it, record the run.

    Args:
        dense: the dense model (forward passes only; FLAP/OWL/evo plan on a private copy).
        eval_settings: held-out evaluation settings.
        table: the loss table (needed unless ``plan`` is given); its calibration windows
            score the units and give the measured ("actual") objective increase.
        budget, allocator, constraints: what `allocate.plan_from_table` gets.
        plan: a ready RatePlan (e.g. an uploaded one) instead of planning.
        checkpoint_dir: where to save the pruned checkpoint; None: not saved.
        history_path: the history database; None: the default under the cache root.
        step: told (message, stage index, stages) as each stage starts.
        cancel: polled between stages and by evaluation.
    Returns:
        A JSON-ready dict: run_id, plan, report, predicted_loss, predicted_basis (table.basis; None
        without a table), actual_loss, objective, checkpoint, seconds, params_before, params_after.
    """
    stages, started = 6, time.perf_counter()

    def at(message: str, index: int) -> None:
        check_cancelled(cancel, f"prune and evaluate cancelled while {message}")
        if step:
            step(message, index, stages)

    at("planning", 1)
    plan = _chosen_plan(dense, table, budget, allocator, constraints, plan)
    calib = table.spec.windows if table is not None else WindowSpec()
    at("pruning a copy (importance scores, surgery)", 2)
    pruned, result = pruned_copy(dense, plan, calib, cancel=cancel)
    at("measuring the loss increase on the calibration windows", 3)
    objective = table.spec.objective if table is not None else "nll"
    actual = objective_increase(pruned, dense, calibration_windows(dense.tokenizer, calib), objective, calib.batch_size)
    at("evaluating", 4)
    report = evaluate(pruned, dense, eval_settings, progress=lambda message: at(f"evaluating: {message}", 4)).to_dict()
    checkpoint = None
    if checkpoint_dir is not None:
        at("saving the checkpoint", 5)
        checkpoint = str(save_pruned(pruned, plan, result.kept_indices(), checkpoint_dir, eval_report=report))
    record = history.RunRecord.from_report(
        plan.to_dict(),
        report,
        allocator=plan.allocator,
        table_key=plan.table_key or (table.key if table is not None else None),
        budget=plan.budget,
        params=_run_params(calib, report, objective, constraints),
        predicted_loss=plan.predicted_loss,
        actual_loss=float(actual) if actual is not None and math.isfinite(actual) else None,
        checkpoint=checkpoint,
        seconds=time.perf_counter() - started,
    )
    run_id = history.record_run(record, history_path)
    if step:
        step("done", stages, stages)
    return {
        "run_id": run_id,
        "plan": plan.to_dict(),
        "report": report,
        "predicted_loss": plan.predicted_loss,
        "predicted_basis": None if table is None else table.basis(table.cells_for(plan.attention_rates, plan.mlp_rates)),
        "actual_loss": record.actual_loss,
        "objective": objective,
        "checkpoint": checkpoint,
        "seconds": record.seconds,
        "params_before": result.params_before,
        "params_after": result.params_after,
    }
