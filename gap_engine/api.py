"""GAP from Python: the method's stages as one call each, in the order of the paper.

    from gap_engine import api

    lm = api.load("smollm2-135m")
    table = api.loss_table(lm, "wiki-sample")        # each layer's loss at each rate: one curve per layer
    front = api.front(lm, table)                     # the DP's least-loss plan for every budget at once
    plan = api.plan(lm, front, budget=0.2)           # GAP's per-layer rates at 20%
    pruned = api.prune(lm, plan, table)              # heads and channels sliced out, the cut compensated
    report = api.evaluate(pruned, lm)                # held-out perplexity and KL to the dense model
    api.save(pruned, "runs/dp20")                    # a checkpoint plain transformers loads

Each function is a direct call into the stage that does the work (``pipeline.stages``, ``plan``,
``evaluate``, ``model.checkpoint``, ``export``), the same calls `gap` and the explorer make, so a
notebook, the command line and the app give one answer for one input. Bad input raises a
``GapError`` subclass whose message is one line. ``docs/python-api.md`` runs this example
end to end (``tests/api/test_api.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gap_engine.core.config import (
    BUILTIN_TEXT_NAMES,
    CLI_TABLE,
    DEFAULT_CRITERION,
    DEFAULT_N_BUCKETS,
    DEFAULT_SAVE_DTYPE,
    EVAL_WINDOWS,
    WindowSpec,
)
from gap_engine.core.device import DeviceSpec
from gap_engine.core.errors import BudgetError
from gap_engine.core.knapsack import ParetoFront, solve_front
from gap_engine.evaluate.metrics import EvalReport, EvalSettings
from gap_engine.evaluate.tasks import TaskSettings, prepare_tasks
from gap_engine.export.gguf import GgufSummary
from gap_engine.export.gguf import export_gguf as write_gguf_file
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.checkpoints import evaluate_model
from gap_engine.pipeline.stages import loss_table as build_table
from gap_engine.pipeline.stages import plan_for, pruned_as_saved
from gap_engine.plan.allocators import counted_compensation
from gap_engine.plan.front import front_rows
from gap_engine.plan.problem import Constraints, charged_counts, planning_problem
from gap_engine.plan.step import plan_criterion, table_model_type
from gap_engine.prune.compensations import CompensationSettings, default_for
from gap_engine.prune.surgery import PruneResult
from gap_engine.tables.artefact import LossTable, TableSpec, parse_rate_grid

__all__ = ["Front", "PrunedModel", "load", "loss_table", "front", "plan", "prune", "evaluate", "save", "export_gguf"]


def load(model: str, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """A built-in name (``smollm2-135m``, ``gemma3-270m``), a local folder, a ``.gguf`` file or a hub id.

    ``device``/``dtype``: where and in which precision it runs (default: the CPU in float32).
    """
    return load_model(model, DeviceSpec(device=device or "cpu", dtype=dtype or "auto") if device or dtype else None)


def loss_table(
    model: LoadedModel,
    text: str = CLI_TABLE.windows.data,
    *,
    samples: int = CLI_TABLE.windows.n_samples,
    seq_len: int = CLI_TABLE.windows.seq_len,
    estimator: str = CLI_TABLE.estimator,
    objective: str = CLI_TABLE.objective,
    criterion: str = DEFAULT_CRITERION,
    rates: Sequence[float] | None = None,
) -> LossTable:
    """How much the loss grows when one layer's heads or MLP channels are pruned at each rate.

    Args:
        model: the dense model.
        text: calibration text: a built-in name, a ``.txt``/``.jsonl`` file or a dataset spec, or several
            comma-separated (``"wiki-sample,news-sample"``): the windows are divided among them in order.
        samples, seq_len: calibration windows of that many tokens.
        estimator: ``fisher`` (default: a second-order estimate from one gradient pass), ``exact``
            (every cell measured with a pruned forward pass), ``taylor`` or ``refine``.
        objective: ``kl`` (to the dense model) or ``nll``.
        criterion: which heads and channels of a layer go at each rate (``wanda``, ``magnitude``, ...).
        rates: the candidate rates (default: 16 from 0 to 0.9375).
    Returns:
        The table, from the on-disk cache when this model, text and settings were measured before.
    """
    windows = WindowSpec(data=text, n_samples=samples, seq_len=seq_len)
    grid = CLI_TABLE.rate_grid if rates is None else parse_rate_grid(",".join(f"{r:g}" for r in rates))
    spec = TableSpec(windows=windows, criterion=criterion, rate_grid=grid, objective=objective, estimator=estimator)
    return build_table(model, spec.validate())


@dataclass(frozen=True)
class Front:
    """The DP's optimum for every budget: one row per distinct plan, by increasing removal."""

    table: LossTable  # what the losses are
    compensation: str  # the compensation whose biases each row's removal is counted net of
    constraints: Constraints  # locks, rate bounds, coupling the rows honour
    pareto: ParetoFront  # the solver's arrays (``core.knapsack``)
    rows: list[dict[str, Any]] = field(
        repr=False
    )  # budget, removed (net of biases), bias_params, predicted_loss, attention_rates, mlp_rates

    def at(self, budget: float) -> dict[str, Any]:
        """The least-loss row that removes at least ``budget`` of the prunable parameters."""
        for row in self.rows:
            if row["budget"] >= budget:
                return row
        raise BudgetError(f"no plan on this front removes {budget:.2%}; the most is {self.rows[-1]['budget']:.2%}")


def front(
    model: LoadedModel,
    table: LossTable,
    *,
    compensate: str | None = None,
    constraints: Constraints = Constraints(),
    n_buckets: int = DEFAULT_N_BUCKETS,
) -> Front:
    """GAP's exact multiple-choice knapsack solved for every budget at once (the explorer's slider).

    ``compensate``: the compensation the prune will apply (None: the default after the DP's step,
    ``bias`` (``bias+refit`` on Gemma 3), or none after OBS); one that adds biases has them paid from each budget, as `plan`
    and `prune` count them.
    """
    table.check_model(model)
    counted = counted_compensation("dp", table, compensate or _default_compensation("dp", table)) or "none"
    counts = charged_counts(model, counted)
    problem = planning_problem(table, constraints, True, counts)
    pareto = solve_front(problem.costs, problem.losses, problem.allowed, n_buckets)
    return Front(table, counted, constraints, pareto, front_rows(table, pareto, counts))


def plan(
    model: LoadedModel,
    table: LossTable | Front,
    budget: float,
    *,
    allocator: str = "dp",
    compensate: str | None = None,
    constraints: Constraints | None = None,
) -> RatePlan:
    """Per-layer rates that remove ``budget`` (a fraction of the attention and MLP projections'
    parameters) with the least summed table loss (``allocator="dp"``: GAP), or a baseline's
    (``uniform``, ``flap``, ``slimgpt``, ``owl``, ``evo``) under the same budget.

    ``compensate``/``constraints``: default to the front's when ``table`` is a `Front`, else to
    the default compensation after the plan's step (``bias``, ``bias+refit`` on Gemma 3; none after OBS, SlimGPT's update
    and the DP's step on Llama models: ``plan.step``) and no constraints.
    """
    if isinstance(table, Front):
        compensate = table.compensation if compensate is None else compensate
        constraints = table.constraints if constraints is None else constraints
        table = table.table
    return plan_for(
        model, table, budget, allocator, constraints or Constraints(), compensation=compensate or _default_compensation(allocator, table)
    )


def _default_compensation(allocator: str, table: LossTable) -> str:
    """The compensation a prune applies when none is asked for: the model family's (``bias``;
    ``bias+refit`` on Gemma 3), or none after a criterion that updates the kept columns itself
    (OBS: the DP's step on Llama, SlimGPT's)."""
    return default_for(plan_criterion(allocator, table), table_model_type(table)).mode


@dataclass
class PrunedModel:
    """A pruned copy of a model: what a checkpoint of its plan holds, and how it was made."""

    model: LoadedModel  # the pruned model, weights rounded to ``save_dtype`` as a checkpoint stores them
    plan: RatePlan  # the plan, with its parameter counts recounted from the pruned geometry
    result: PruneResult  # what surgery kept, parameters before and after, the compensation's record
    save_dtype: str = DEFAULT_SAVE_DTYPE  # the precision it is stored in

    @property
    def params(self) -> int:
        """Parameters of the model as shipped, the compensation's biases included."""
        return self.result.params_after


def prune(
    model: LoadedModel,
    plan: RatePlan,
    table: LossTable | None = None,
    *,
    compensate: str | None = None,
    calibration: WindowSpec | None = None,
    obs_samples: int | None = None,
    fit_samples: int | None = None,
    weighting: str | None = None,
    save_dtype: str = DEFAULT_SAVE_DTYPE,
) -> PrunedModel:
    """A copy of ``model`` with the heads and channels ``plan`` removes sliced out, then the cut
    compensated block by block on calibration text (``compensate``: the plan's own, else the model
    family's default, ``bias`` (``bias+refit`` on Gemma 3), or none after OBS; ``refit``, ``bias+refit``, ``none``). ``model`` is left as it was.

    The units are chosen and the compensation fitted on ``calibration`` windows: the table's own
    when ``table`` is given, else 16 x 256 tokens of wiki-sample. A plan pruned by OBS (the DP's step
    on Llama) reads ``obs_samples`` windows of that text (None: 4x their count, at most 128); any other
    plan's compensation is fitted on ``fit_samples`` windows of it (None: the calibration windows, at least 64 on
    Gemma 3). ``weighting="output-norm"`` fits through the norms after o_proj and down_proj, each token counted by
    the inverse mean square of its dense output there (``CompensationSettings.weighting``); ``"tokens"``: alike;
    None: the model family's (output-norm on Gemma 3, tokens elsewhere).
    """
    windows = calibration or (table.spec.windows if table is not None else CLI_TABLE.windows)
    mode = compensate or plan.compensation or default_for(plan.criterion, model.model_type).mode
    compensation = CompensationSettings(mode=mode, samples=fit_samples, weighting=weighting).validate()
    pruned, result = pruned_as_saved(model, plan, windows, save_dtype=save_dtype, compensation=compensation, obs_samples=obs_samples)
    return PrunedModel(pruned, result.plan, result, save_dtype)


def evaluate(
    model: LoadedModel | PrunedModel,
    dense: LoadedModel | None = None,
    text: str | Sequence[str] = BUILTIN_TEXT_NAMES,
    *,
    samples: int = EVAL_WINDOWS.n_samples,
    seq_len: int = EVAL_WINDOWS.seq_len,
    tasks: Sequence[str] = (),
    task_limit: int | None = None,
    throughput: bool = False,
    generations: int = 0,
) -> EvalReport:
    """Held-out perplexity per text (on the report part, which no choice was made on), KL to and
    top-1 agreement with ``dense``, and lm-eval task accuracy of both for ``tasks``."""
    lm = model.model if isinstance(model, PrunedModel) else model
    sources = text if isinstance(text, str) else ",".join(text)
    settings = EvalSettings(WindowSpec(data=sources, n_samples=samples, seq_len=seq_len), throughput, generations)
    prepared = prepare_tasks(TaskSettings(tasks=tuple(tasks), limit=task_limit).validate()) if tasks else None
    return evaluate_model(lm, dense, settings, prepared)


def save(model: PrunedModel, folder: str | Path) -> Path:
    """The pruned model as a checkpoint folder: safetensors, its plan, the units it kept, a model card."""
    return save_pruned(model.model, model.plan, model.result.kept_indices(), folder, dtype=model.save_dtype)


def export_gguf(checkpoint: str | Path, out: str | Path, outtype: str = "q8_0") -> GgufSummary:
    """A saved checkpoint as one GGUF file for llama.cpp (``outtype`` ``q8_0`` or ``f16``)."""
    return write_gguf_file(checkpoint, out, outtype)
