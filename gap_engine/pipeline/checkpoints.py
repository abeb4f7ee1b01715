"""Pruning a model into a saved checkpoint, and evaluating one: what ``gap prune`` and
``gap eval`` run.

Two ways to a pruned checkpoint: a given plan (a plan file, or one uniform rate) applied
once (``prune_to_checkpoint``), or GAP's DP to a budget in rounds, each planned on a table of
the model the rounds before left (``prune_rounds_to_checkpoint``). ``evaluate_model`` is the
held-out evaluation with the lm-eval task accuracy of the model and of its dense original
beside it. The CLI only parses flags, loads and prints; the stages are strung together here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gap_engine.core.config import DEFAULT_SAVE_DTYPE, WindowSpec
from gap_engine.core.errors import InvariantError
from gap_engine.core.progress import NO_HOOKS, Hooks
from gap_engine.evaluate.metrics import EvalReport, EvalSettings, evaluate
from gap_engine.evaluate.tasks import PreparedTasks, model_and_dense_scores
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.iterative import IterativeResult, iterative_prune
from gap_engine.pipeline.stages import obs_windows, pruned_as_saved
from gap_engine.prune.compensations import NO_COMPENSATION, CompensationSettings
from gap_engine.prune.criteria import is_sequential
from gap_engine.tables.artefact import LossTable, TableSpec


@dataclass(frozen=True)
class PrunedCheckpoint:
    """What ``gap prune --plan/--uniform`` wrote: the net change of the parameter count beside the cut's."""

    out: str  # the checkpoint folder
    params_before: int  # the dense model's parameters
    params_after: int  # the checkpoint's, the compensation's biases included
    removed_fraction_of_prunable: float  # what the cut removed (the plan's ``removed``), of the prunable parameters
    removed_fraction_of_total: float  # the same, of all parameters
    compensation: str = "none"  # what the kept units got after the cut
    removed: int = 0  # parameters the cut removed (the plan's ``removed``)
    bias_params: int = 0  # parameters the compensation's biases added back
    dense_prunable: int = 1  # the dense model's prunable parameters
    criterion: str = "wanda"  # what chose the units (the saved plan's criterion)
    obs_windows: int | None = None  # calibration windows a sequential criterion (obs) read; None: none did
    fit_windows: int | None = None  # calibration windows the compensation after the cut was fitted on; None: none was
    fit_weighting: str = "tokens"  # how that fit counted its tokens (CompensationSettings.weighting)

    @property
    def net_removed(self) -> int:
        """The net change: parameters gone once the biases are counted (``params_before - params_after``)."""
        return self.params_before - self.params_after

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": self.out,
            "params_before": self.params_before,
            "params_after": self.params_after,
            "removed": self.removed,
            "bias_params": self.bias_params,
            "net_removed": self.net_removed,
            "removed_fraction_of_prunable": self.removed_fraction_of_prunable,
            "net_removed_fraction_of_prunable": self.net_removed / self.dense_prunable,
            "removed_fraction_of_total": self.removed_fraction_of_total,
            "compensation": self.compensation,
            "criterion": self.criterion,
        } | {
            name: n
            for name, n in (
                ("obs_windows", self.obs_windows),
                ("fit_windows", self.fit_windows),
                ("fit_weighting", None if self.fit_weighting == "tokens" else self.fit_weighting),
            )
            if n is not None
        }


def prune_to_checkpoint(
    lm: LoadedModel,
    plan: RatePlan,
    windows: WindowSpec,
    out: str | Path,
    save_dtype: str = DEFAULT_SAVE_DTYPE,
    hooks: Hooks = NO_HOOKS,
    compensation: CompensationSettings = NO_COMPENSATION,
    obs_samples: int | None = None,
) -> PrunedCheckpoint:
    """Prune ``lm`` by ``plan`` (units chosen on ``windows``) and save it to ``out``.

    ``lm`` itself is pruned (``stages.pruned_as_saved`` with ``keep_dense=False``: the command
    loaded it for this alone), as the explorer's runs and ``gap compare`` prune their copies.

    Args:
        save_dtype: the checkpoint's storage dtype.
        hooks: the importance scores' progress and cancel (and the compensation's blocks).
        compensation: what the kept units get after the cut, fitted on ``windows``.
        obs_samples: calibration windows a sequential criterion (``obs``) reads (None: ``stages.obs_windows``' default).
    """
    pruned, result = pruned_as_saved(
        lm, plan, windows, save_dtype=save_dtype, keep_dense=False, hooks=hooks, compensation=compensation, obs_samples=obs_samples
    )
    save_pruned(pruned, result.plan, result.kept_indices(), out, dtype=save_dtype)
    return PrunedCheckpoint(
        out=str(out),
        params_before=result.params_before,
        params_after=result.params_after,
        removed_fraction_of_prunable=result.plan.params["removed_fraction_of_prunable"],
        removed_fraction_of_total=result.plan.params["removed_fraction_of_total"],
        compensation=compensation.mode,
        removed=int(result.plan.params["removed"]),
        bias_params=int((result.compensation or {}).get("bias_params", 0)),
        dense_prunable=int(result.plan.params["dense_prunable"]),
        criterion=result.plan.criterion,
        obs_windows=obs_windows(windows, obs_samples).n_samples if is_sequential(result.plan.criterion) else None,
        fit_windows=((result.compensation or {}).get("windows") or {}).get("n_samples"),
        fit_weighting=str((result.compensation or {}).get("weighting", "tokens")),
    )


def prune_rounds_to_checkpoint(
    lm: LoadedModel,
    spec: TableSpec,
    budget: float,
    rounds: int,
    out: str | Path,
    save_dtype: str = DEFAULT_SAVE_DTYPE,
    hooks: Hooks = NO_HOOKS,
    first_table: LossTable | None = None,
    compensation: CompensationSettings = NO_COMPENSATION,
    criterion: str | None = None,
    obs_samples: int | None = None,
) -> IterativeResult:
    """GAP's DP to ``budget`` in ``rounds`` rounds (``iterative.iterative_prune``, which takes
    ``first_table``) on a copy of ``lm``, the result saved to ``out`` in ``save_dtype``; returns the rounds' record.
    ``compensation`` follows the last round's cut (one round only: see ``iterative_prune``); ``criterion``
    chooses the units of every round (None: the table's), ``obs_samples`` sizes ``obs``'s windows."""
    result = iterative_prune(
        lm,
        spec,
        budget,
        rounds,
        hooks=hooks,
        first_table=first_table,
        compensation=compensation,
        criterion=criterion,
        obs_samples=obs_samples,
    )
    if result.plan is None:
        raise InvariantError("iterative_prune recorded no plan")
    save_pruned(result.model, result.plan, result.kept, out, dtype=save_dtype)
    return result


def evaluate_model(
    lm: LoadedModel,
    dense: LoadedModel | None,
    settings: EvalSettings,
    tasks: PreparedTasks | None = None,
    hooks: Hooks = NO_HOOKS,
) -> EvalReport:
    """The held-out report of ``lm`` against ``dense`` (None: alone), with the accuracy of the
    prepared lm-eval ``tasks`` for both when given.

    Args:
        hooks: evaluate's steps, and the task stage, said as messages.
    """
    report = evaluate(lm, dense, settings, hooks)
    if tasks is not None:
        hooks.say(f"task accuracy on {', '.join(tasks.tasks)} (lm-eval)")
        scores, dense_scores = model_and_dense_scores(lm, dense, tasks)
        report.task_accuracy = {name: score.to_dict() for name, score in scores.items()}
        report.dense_task_accuracy = {name: score.to_dict() for name, score in dense_scores.items()}
    return report
