"""Loss tables: the measurement stage of GAP (EMNLP 2025).

``artefact`` defines the table and its settings, ``cells`` what one cell removes,
``exact`` measures every cell, ``estimate`` fills the table from one gradient pass, and
``refine`` starts from that estimate and measures exactly the cells the plans use. Each
estimator's registry entry (``estimators.ESTIMATORS``) names the filler that does its part,
so adding an estimator is one entry and its function.
``measure_table`` is the entry point on given windows; ``pipeline.loss_table`` adds the
calibration text and the on-disk cache.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from gap_engine.core.device import CPU_FP32, placement_of, resolve
from gap_engine.core.errors import TableError
from gap_engine.core.progress import NO_HOOKS, SCORE_UNITS, Hooks, reporting
from gap_engine.data.bos import text_start
from gap_engine.model.finite import NonFiniteMeasurement, check_finite, non_finite_cause
from gap_engine.model.loaded import LoadedModel
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import (
    TABLE_FORMAT_VERSION,
    LossTable,
    TableSpec,
    isotonic_smooth,
    parse_rate_grid,
    removed_table,
    table_components,
    table_key,
)
from gap_engine.tables.cells import objective_positions
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.exact import WindowCells, window_cells
from gap_engine.tables.ledger import CellFiller, CellObjectives, CellRequest, PartialStore

log = logging.getLogger(__name__)

__all__ = [
    "TABLE_FORMAT_VERSION",
    "LossTable",
    "PartialStore",
    "TableSpec",
    "WindowCells",
    "assemble_table",
    "isotonic_smooth",
    "measure_table",
    "parse_rate_grid",
    "table_key",
    "window_cells",
]


def assemble_table(
    lm: LoadedModel,
    spec: TableSpec,
    key: str,
    data_fingerprint: str,
    components: list[tuple[int, str]],
    cells: CellObjectives,
    seconds: float,
    tokens: np.ndarray | None = None,
    window_start: str = "text",
) -> LossTable:
    """A LossTable from what a filler returned: deltas over dense, smoothed rows, removed parameters.

    Args:
        cells: the (C, R) objectives, the dense objective, the build statistics, which cells
            were measured and the estimate a refined table started from.
        tokens: (C, R) token positions each value rests on (None: unknown).
        window_start: "bos" or "text", how the calibration windows started.
    """
    objective, dense = cells.objective, cells.dense
    removed, dense_prunable = removed_table(lm, components, spec.rate_grid, spec.channel_multiple)
    delta = objective - dense
    delta[:, 0] = 0.0
    objective[:, 0] = dense
    measured = cells.measured | (removed == 0)
    return LossTable(
        model=lm.name,
        model_fingerprint=lm.fingerprint,
        num_layers=lm.num_layers,
        spec=spec,
        data_fingerprint=data_fingerprint,
        components=components,
        rate_grid=np.asarray(spec.rate_grid, dtype=np.float64),
        delta=delta,
        removed=removed,
        dense_objective=float(dense),
        cell_objective=objective,
        smoothed=isotonic_smooth(delta),
        dense_prunable=dense_prunable,
        build_seconds=seconds,
        key=key,
        extras=cells.stats,
        window_start=window_start,
        measured=measured,
        cell_tokens=tokens,
        estimate=cells.estimate,
    )


def check_finite_cells(lm: LoadedModel, spec: TableSpec, components: list[tuple[int, str]], objective: np.ndarray, dense: float) -> None:
    """TableError naming the first cell (and the likeliest cause) when a measurement is not a number:
    a table of NaN cells would be written, cached and planned on as if measured."""
    check_finite(dense, f"the dense model's {spec.objective} on the calibration windows", lm.model, TableError)
    bad = np.argwhere(~np.isfinite(objective))
    if bad.size:
        c, r = (int(i) for i in bad[0])
        layer, kind = components[c]
        check_finite(
            float(objective[c, r]), f"the {spec.objective} of layer {layer} {kind} at rate {spec.rate_grid[r]:g}", lm.model, TableError
        )


def check_cells_filler(spec: TableSpec, cells: CellFiller | None) -> None:
    """TableError unless a given filler (Ray workers) can fill this table: exact cells, uncompensated."""
    if cells is not None and spec.estimator != "exact":
        raise TableError(f"Ray workers measure exact cells; the {spec.estimator} estimate is one gradient pass in one process")
    if cells is not None and spec.compensation != "none":
        raise TableError(f"Ray workers measure cells without compensation; measure a '{spec.compensation}' table in one process")


def measure_table(
    lm: LoadedModel,
    spec: TableSpec,
    windows: torch.Tensor,
    hooks: Hooks = NO_HOOKS,
    partial: PartialStore | None = None,
    key: str = "",
    data_fingerprint: str = "",
    cells: CellFiller | None = None,
) -> LossTable:
    """Build a table on given windows, with no cache (``pipeline.loss_table`` adds it).

    Args:
        lm: the dense LoadedModel (its weights are masked cell by cell and restored; a
            ``shared`` one is copied first).
        spec: validated here.
        windows: (N, T) token ids; N and T should match the spec.
        hooks: progress told (done, total, eta_seconds): cells for ``exact``, calibration
            batches for the estimates, batches and then cells for ``refine`` (its total
            grows as rounds add cells); eta is None before the first timed step. Cancel
            polled before every cell or batch; when set, measured cells are saved and
            CancelledError is raised. Each stage is entered as it starts (score units, then
            the dense pass and the cells, or the gradient pass; refine's cells count within it).
        partial: where measured cells are saved every few cells and read back on resume
            (exact and refine).
        key, data_fingerprint: recorded in the table.
        cells: who measures an exact table's cells instead of the estimator's own filler, a
            ``ledger.CellFiller`` (``tables.distributed.RayCells``); default: the estimator's
            (exact: this process, resident or streamed as the model is placed).
    """
    spec.validate()
    check_cells_filler(spec, cells)
    lm = lm.private()  # cells mask the weights: never those of a model other threads run
    started, cpu_started = time.perf_counter(), time.process_time()
    components = table_components(lm.num_layers, spec.mode)
    hooks.enter(SCORE_UNITS)
    scores = compute_importance(lm, windows, spec.criterion, batch_size=spec.windows.batch_size, hooks=Hooks(cancel=hooks.cancel))
    start = text_start(lm.tokenizer, windows)
    tokens = np.full((len(components), len(spec.rate_grid)), objective_positions(windows, spec.objective, start), dtype=np.int64)
    window_start = "bos" if start else "text"
    fill: CellFiller = cells or ESTIMATORS.function(spec.estimator)  # the filler enters its own stages
    try:
        with reporting(hooks):
            filled = fill(CellRequest(lm, spec, windows, scores, components, partial))
    except NonFiniteMeasurement as exc:
        raise TableError(f"{exc}: {non_finite_cause(lm.model)}") from None
    check_finite_cells(lm, spec, components, filled.objective, filled.dense)
    stats = dict(filled.stats)
    if placement_of(lm) != resolve(CPU_FP32):  # a CPU float32 table records no placement, so its extras match the cached ones'
        stats["placement"] = placement_of(lm).describe()
    stats["model_type"] = getattr(getattr(lm.model, "config", None), "model_type", None)  # plan.step: the family's default step
    if spec.compensation != "none":
        stats["compensation"] = spec.compensation  # what the measured cells include
    if ESTIMATORS[spec.estimator].reads_gradients:
        # the metadata says it: a gradient estimate is of the uncompensated model, whatever surgery does later
        stats["estimated_cells_compensation"] = "none"
    stats["cpu_seconds"] = round(
        time.process_time() - cpu_started, 3
    )  # this process, all threads: fairer than wall time on a shared machine
    seconds = time.perf_counter() - started
    table = assemble_table(lm, spec, key, data_fingerprint, components, filled._replace(stats=stats), seconds, tokens, window_start)
    log.info("loss table %s: %d x %d cells in %.1f s", key or "(uncached)", *table.delta.shape, table.build_seconds)
    return table
