"""The stages strung together: load -> windows -> scores -> table -> plan -> prune -> measure.

Every surface (CLI, background jobs, benchmarks) calls these instead of re-spelling the
sequence. Each function takes the settings of its stage and the same optional
``hooks`` as the engine (``core.progress.Hooks``); the stage modules
themselves never call each other's entry points.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from gap_engine.core.config import DEFAULT_N_BUCKETS, DEFAULT_SAVE_DTYPE, WindowSpec, obs_window_count
from gap_engine.core.device import DeviceSpec
from gap_engine.core.errors import CompensationError, ModelLoadError, TableError
from gap_engine.core.interrupt import cancel_checks, run_unless_cancelled
from gap_engine.core.progress import (
    CELLS,
    DENSE_PASS,
    GRADIENT_PASS,
    LOAD_MODEL,
    NO_HOOKS,
    READ_TEXT,
    SCORE_UNITS,
    Hooks,
    StageTimer,
    reporting,
)
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches, calibration_fingerprint, calibration_windows
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import RatePlan
from gap_engine.model.storage import round_to_storage
from gap_engine.plan.allocators import ReachableBudget, needs_windows, plan_from_table
from gap_engine.plan.evo import EvoSettings
from gap_engine.plan.problem import Constraints
from gap_engine.prune.compensation_pass import calibration_tokens, check_calibration, prune_compensated
from gap_engine.prune.compensations import NO_COMPENSATION, CompensationSettings
from gap_engine.prune.criteria import CRITERIA, is_sequential, reads_windows
from gap_engine.prune.importance import ImportanceScores, compute_importance
from gap_engine.prune.surgery import PruneResult, apply_plan
from gap_engine.tables.artefact import LossTable, TableSpec, table_key
from gap_engine.tables.build import check_cells_filler, measure_table
from gap_engine.tables.cache import PartialCells, get_table, lock, put_table
from gap_engine.tables.cells import objective_positions, objective_sum
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.ledger import CellFiller

log = logging.getLogger(__name__)


# ---- windows and scores ------------------------------------------------------------------
def importance_for(
    lm: LoadedModel,
    criterion: str,
    windows: WindowSpec,
    hooks: Hooks = NO_HOOKS,
) -> ImportanceScores:
    """Importance scores of the dense model on calibration windows (none are read for magnitude)."""
    ids = calibration_windows(lm.tokenizer, windows) if reads_windows(criterion) else None
    return compute_importance(lm, ids, criterion, windows.batch_size, hooks)


# ---- the loss table ------------------------------------------------------------------------
def loss_table(
    lm: LoadedModel,
    spec: TableSpec,
    hooks: Hooks = NO_HOOKS,
    use_cache: bool = True,
    cells: CellFiller | None = None,
) -> LossTable:
    """The loss table of ``lm`` under ``spec``, from the cache when it is there.

    A build holds the cache entry's inter-process lock, so a second process asking for the
    same table waits and then reads the finished one. Measured cells are saved as the build
    goes; a cancelled or killed build resumes from them.

    Args:
        lm: the dense model (an exact build masks its weights cell by cell, restoring them).
        spec: what to measure.
        hooks: progress (done, total, eta_seconds) after every cell or batch, never on a
            cache hit; cancel polled at every decoder block (``interrupt``), and reading
            the text stops being waited for at once; each stage entered as it starts
            (``table_stages``, after loading), their times going into the cache entry's metadata.
        use_cache: False neither reads nor writes the cache (nor partial cells).
        cells: who measures exact cells (a ``tables.ledger.CellFiller``, e.g. ``tables.distributed.RayCells``); default: this process.
    Raises:
        TableError: a bad spec, or Ray workers asked for a table that no cell measures.
        CompensationError: cells refitted from fewer calibration tokens than a refit has inputs
            (``compensation_pass.check_calibration``, the rule prune and compare apply), before any text is read.
        CancelledError: cancelled. DataError: unusable text source.
    """
    spec.validate()
    check_calibration(lm, calibration_tokens(spec.windows), CompensationSettings(mode=spec.compensation))
    check_cells_filler(spec, cells)  # before the text is read; measure_table asks again for its direct callers
    timer = StageTimer(hooks.stage)
    hooks = hooks.replaced(stage=timer)
    hooks.enter(READ_TEXT)
    log.info("reading the calibration text %s", spec.windows.data)
    data_fingerprint = run_unless_cancelled(
        lambda: calibration_fingerprint(spec.windows),
        hooks,
        "loss table build cancelled while reading the text",
        "gap-read-text",
    )
    key = table_key(lm, spec, data_fingerprint)

    def measure(partial):
        # An exact build masks the weights cell by cell: never those of a model other threads run.
        owned = run_unless_cancelled(lm.private, hooks, "loss table build cancelled while copying the model")
        windows = run_unless_cancelled(
            lambda: calibration_windows(lm.tokenizer, spec.windows), hooks, "loss table build cancelled while reading the text"
        )
        if cells is not None:  # Ray workers poll cancel between layers; hooks on the blocks would not pickle
            return measure_table(owned, spec, windows, hooks, partial, key, data_fingerprint, cells=cells)
        with cancel_checks(owned, hooks, f"loss table build cancelled during the {spec.estimator} measurement"):
            return measure_table(owned, spec, windows, hooks, partial, key, data_fingerprint, cells=cells)

    if not use_cache:
        return measure(None)
    with lock(key):
        cached = get_table(key, verify=lambda table: check_cached_table(table, lm, spec, data_fingerprint))
        if cached is not None:
            log.info("loss table %s read from the cache", key)
            return cached
        table = measure(PartialCells(key))
        put_table(table, stage_seconds=timer.finish())
        return table


def check_cached_table(table: LossTable, lm: LoadedModel, spec: TableSpec, data_fingerprint: str) -> None:
    """TableError unless a cached table is the one a build of ``spec`` on ``lm`` would make: the
    model's name, layers, fingerprint and geometry, the text's fingerprint and the spec's
    summary (what the cache key hashes, read back from the table itself)."""
    table.check_model(lm)
    if table.model != lm.name:
        raise TableError(f"it was built for {table.model!r}, not {lm.name!r}")
    if table.data_fingerprint != data_fingerprint:
        raise TableError(f"it was measured on text {table.data_fingerprint[:16]}, not {data_fingerprint[:16]}")
    if table.spec.summary() != spec.summary():
        raise TableError("it was built with other settings")


def table_stages(spec: TableSpec) -> tuple[str, ...]:
    """The stages of a table job in order, from loading the model (``core.progress`` names)."""
    measured = (GRADIENT_PASS,) if ESTIMATORS[spec.estimator].reads_gradients else (DENSE_PASS, CELLS)
    return (LOAD_MODEL, READ_TEXT, SCORE_UNITS) + measured


# ---- the plan ------------------------------------------------------------------------------
def plan_for(
    lm: LoadedModel,
    table: LossTable,
    budget: float,
    allocator: str = "dp",
    constraints: Constraints = Constraints(),
    scores: ImportanceScores | None = None,
    evo: EvoSettings = EvoSettings(),
    n_buckets: int = DEFAULT_N_BUCKETS,
    smoothed: bool = True,
    compensation: str | None = None,
    reachable: ReachableBudget | None = None,
) -> RatePlan:
    """`allocators.plan_from_table` with the table's own calibration windows read when the allocator
    needs them (``compensation``: what the prune that follows applies; its biases are charged to the budget;
    ``reachable``: what `allocators.check_reach` returned for the budget, planned on as it is)."""
    windows = calibration_windows(lm.tokenizer, table.spec.windows) if needs_windows(allocator) else None
    return plan_from_table(lm, table, budget, allocator, constraints, windows, scores, evo, n_buckets, smoothed, compensation, reachable)


# ---- pruning ------------------------------------------------------------------------------
def pruned_by(plan: RatePlan, criterion: str | None) -> RatePlan:
    """``plan``'s rates (and recorded attention shapes) with ``criterion`` choosing the units instead
    of the plan's own (None: the plan as it is). The criterion decides which units go, whoever
    chose how many: any allocator's plan may be pruned by ``obs`` (SlimGPT's structured OBS), and
    the plan a checkpoint, a run and a model card record then names it.

    Raises:
        PlanError: a criterion that is not registered.
    """
    if criterion is None or criterion == plan.criterion:
        return plan
    return dataclasses.replace(plan, criterion=criterion, params=dict(plan.params)).validate()


def obs_windows(windows: WindowSpec, samples: int | None) -> WindowSpec:
    """The windows a sequential criterion (``obs``) chooses units and updates weights on: the
    calibration windows' source, length and seed, ``samples`` of them (None: ``config.obs_window_count``'s
    default, 4x the calibration's up to a cap). Its cost is one Gram matrix per projection per
    block, so it can read more than a table's cells do."""
    count = obs_window_count(windows.n_samples, samples)
    return windows if count == windows.n_samples else dataclasses.replace(windows, n_samples=count).validate()


def prune_with_plan(
    lm: LoadedModel,
    plan: RatePlan,
    windows: WindowSpec,
    hooks: Hooks = NO_HOOKS,
    scores: ImportanceScores | None = None,
    compensation: CompensationSettings = NO_COMPENSATION,
    obs_samples: int | None = None,
) -> PruneResult:
    """Score the dense model with the plan's criterion (unless given for it), then prune it in place,
    compensating the cut on the same windows (``compensation_pass``) unless ``compensation`` is none.

    A sequential criterion (``obs``) has no scores: it prunes block by block on
    ``obs_samples`` calibration windows (``obs_windows``; None: its default, 4x ``windows``' count up to a cap)
    (``prune.sequential``), its OBS update being its own compensation (``bias`` may follow it,
    fitted on the same windows; a refit may not)."""
    plan.validate()
    plan.check_model(lm)
    pruning = any(plan.attention_rates) or any(plan.mlp_rates)
    if pruning and is_sequential(plan.criterion):
        if compensation.samples is not None:
            raise CompensationError(
                f"criterion '{plan.criterion}' fits its update and any bias on its own windows: size them with its "
                "window count (obs_samples), not the compensation's"
            )
        read = obs_windows(windows, obs_samples)
        prune: Callable[..., PruneResult] = CRITERIA.function(plan.criterion)
        with reporting(hooks):
            result = prune(lm, plan, calibration_windows(lm.tokenizer, read), windows.batch_size, compensation=compensation)
        if result.compensation is not None:  # a bias on top of the update, fitted on the same windows: recorded as compensation_pass does
            result.compensation = result.compensation | {"windows": dataclasses.asdict(read)}
            if lm.pruned_from is not None:
                lm.pruned_from["compensation"] = result.compensation
        return result
    if scores is not None and scores.criterion != plan.criterion:
        scores = None  # another criterion's scores (a baseline that prunes by its paper's own)
    if scores is None and pruning:
        scores = importance_for(lm, plan.criterion, windows, hooks)
    if compensation.active:
        return prune_compensated(lm, plan, scores, windows, compensation, hooks)
    return apply_plan(lm, plan, scores)


def pruned_as_saved(
    dense: LoadedModel,
    plan: RatePlan,
    windows: WindowSpec,
    *,
    scores: ImportanceScores | None = None,
    save_dtype: str = DEFAULT_SAVE_DTYPE,
    keep_dense: bool = True,
    hooks: Hooks = NO_HOOKS,
    compensation: CompensationSettings = NO_COMPENSATION,
    obs_samples: int | None = None,
) -> tuple[LoadedModel, PruneResult]:
    """The model a checkpoint of ``plan`` holds: pruned, its weights rounded to ``save_dtype``.

    The one way every surface prunes before it measures (the explorer's runs, ``gap compare``,
    ``gap prune``): what is measured is what is saved, so one plan reports one set of numbers
    wherever it is run, and ``gap eval`` of the saved checkpoint repeats them.

    Args:
        dense: the dense model; its units are scored here unless ``scores`` are given.
        plan: the plan to apply (checked against ``dense``).
        windows: the calibration windows that score the units.
        scores: importance scores of ``dense`` under ``plan.criterion`` (None: computed).
        save_dtype: the storage dtype (one of ``config.SAVE_DTYPES``); float32 leaves the weights as they are.
        keep_dense: True prunes a copy and leaves ``dense`` as it was; False prunes ``dense``
            itself, sparing the copy's memory (a caller that loaded it for this alone, as
            ``gap prune``), unless it is ``shared``: a model other threads run is never pruned.
        hooks: the importance scores' progress (and the ``compensate`` stage with its blocks);
            cancel polled while copying and at every decoder block while scoring.
        compensation: what the kept units get after the cut, fitted on ``windows``
            (``prune.compensation_pass``; none: surgery alone).
        obs_samples: how many calibration windows a sequential criterion (``obs``) reads
            (``obs_windows``; None: its default, 4x ``windows``' count up to a cap).
    Returns:
        (the pruned LoadedModel, fingerprinted as stored; surgery's PruneResult, whose
        ``plan`` carries the parameter counts recounted from the model's geometry).
    """
    pruned = dense
    if keep_dense or dense.shared:
        pruned = run_unless_cancelled(dense.copy, hooks, "pruning cancelled while copying the model")
    with cancel_checks(pruned, hooks, "pruning cancelled"):
        result = prune_with_plan(pruned, plan, windows, hooks, scores=scores, compensation=compensation, obs_samples=obs_samples)
    round_to_storage(pruned.model, save_dtype)
    pruned.refresh_fingerprint()
    return pruned, result


@torch.inference_mode()
def objective_increase(pruned: LoadedModel, dense: LoadedModel, windows: torch.Tensor, objective: str, batch_size: int) -> float:
    """The measured increase of a table objective: mean NLL difference, or mean KL(dense || pruned).

    Counted over the same positions as a table cell (``tables.cells``), so for a plan that
    prunes one component at a grid rate it equals that cell of an exact table on these windows.
    """
    start = text_start(dense.tokenizer, windows)
    total = 0.0
    for batch in batches(windows, batch_size):
        logits = pruned.model(input_ids=batch, use_cache=False).logits  # (B, T, V)
        dense_logits = dense.model(input_ids=batch, use_cache=False).logits  # (B, T, V)
        if objective == "kl":
            total += objective_sum(logits, batch, "kl", torch.log_softmax(dense_logits, dim=-1), start)
        else:
            total += objective_sum(logits, batch, "nll", None, start) - objective_sum(dense_logits, batch, "nll", None, start)
    return total / objective_positions(windows, objective, start)


def dense_reference(lm: LoadedModel, device: DeviceSpec | None = None, loader=None, warn: bool = True) -> LoadedModel | None:
    """The dense model a pruned checkpoint came from, when it can be loaded here (on ``device``,
    or by ``loader(name)``: e.g. spread over several devices, ``dispatch.load_dispatched``).
    ``warn=False``: why not is logged at info level only (a caller that says it in its own words)."""
    if not lm.pruned_from or not lm.pruned_from.get("model"):
        return None
    try:
        # The name comes from the checkpoint's files: loaded from local files only, never the network.
        dense = loader(lm.pruned_from["model"]) if loader is not None else load_model(lm.pruned_from["model"], device, hub=False)
    except ModelLoadError as exc:
        log.log(logging.WARNING if warn else logging.INFO, "dense reference %s is not available: %s", lm.pruned_from["model"], exc)
        return None
    if lm.pruned_from.get("fingerprint") and dense.fingerprint != lm.pruned_from["fingerprint"]:
        log.log(
            logging.WARNING if warn else logging.INFO,
            "dense reference %s has other weights than the ones pruned; not comparing",
            dense.name,
        )
        return None
    return dense
