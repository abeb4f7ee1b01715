"""Loss tables: the measurement stage of GAP (EMNLP 2025).

``artefact`` defines the table and its settings, ``cells`` what one cell removes,
``exact`` measures every cell, ``estimate`` fills the table from one gradient pass.
``measure_table`` is the entry point on given windows; ``pipeline.loss_table`` adds the
calibration text and the on-disk cache.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..importance import compute_importance
from ..progress import CancelToken, ProgressFn
from .artefact import TABLE_FORMAT_VERSION, LossTable, TableSpec, isotonic_smooth, parse_rate_grid, removed_table, table_components, table_key
from .estimate import estimate_cells
from .exact import PartialStore, WindowCells, measure_exact, window_cells

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


def assemble_table(lm, spec: TableSpec, key: str, data_fingerprint: str, components, objective: np.ndarray, dense: float, seconds: float, stats: dict) -> LossTable:
    """A LossTable from (C, R) cell objectives: deltas over dense, smoothed rows, removed parameters."""
    removed, dense_prunable = removed_table(lm, components, spec.rate_grid, spec.channel_multiple)
    delta = objective - dense
    delta[:, 0] = 0.0
    objective[:, 0] = dense
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
        extras=stats,
    )


def measure_table(
    lm,
    spec: TableSpec,
    windows: torch.Tensor,
    progress: ProgressFn | None = None,
    cancel: CancelToken | None = None,
    partial: PartialStore | None = None,
    key: str = "",
    data_fingerprint: str = "",
) -> LossTable:
    """Build a table on given windows, with no cache (``pipeline.loss_table`` adds it).

    Args:
        lm: the dense LoadedModel (its weights are masked cell by cell and restored).
        spec: validated here.
        windows: (N, T) token ids; N and T should match the spec.
        progress: called as (done, total, eta_seconds): cells for ``exact``, calibration
            batches for the estimates; eta is None before the first timed step.
        cancel: polled before every cell or batch; when set, measured cells are saved and
            CancelledError is raised.
        partial: where measured cells are saved every few cells and read back on resume.
        key, data_fingerprint: recorded in the table.
    """
    spec.validate()
    started = time.perf_counter()
    components = table_components(lm.num_layers, spec.mode)
    scores = compute_importance(lm, windows, spec.criterion, batch_size=spec.windows.batch_size, cancel=cancel)
    if spec.estimator == "exact":
        objective, dense, stats = measure_exact(lm, spec, windows, scores, components, progress, cancel, partial)
    else:
        objective, dense, stats = estimate_cells(lm, spec, windows, scores, components, progress, cancel)
    table = assemble_table(lm, spec, key, data_fingerprint, components, objective, dense, time.perf_counter() - started, stats)
    log.info("loss table %s: %d x %d cells in %.1f s", key or "(uncached)", *table.delta.shape, table.build_seconds)
    return table
