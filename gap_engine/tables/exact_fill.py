"""The ``exact`` estimator's table filler: the dense pass, then every distinct cell measured.

Who measures the cells is chosen here: a given ``ledger.CellFiller`` (Ray workers,
``tables.distributed.RayCells``), else this process, block by block for a streamed model
(``tables.streaming``) or with the whole model on its device (``tables.exact``). It lives
apart from both so that neither has to import the other.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gap_engine.core.device import is_streamed
from gap_engine.core.progress import CELLS, DENSE_PASS, Hooks
from gap_engine.tables.exact import measure_exact
from gap_engine.tables.ledger import CellFiller, CellRequest, FilledCells
from gap_engine.tables.streaming import measure_exact_streamed


def fill_exact(request: CellRequest, cells: CellFiller | None = None) -> FilledCells:
    """Every cell measured (``ledger.TableFiller``): the dense pass is entered as a stage, and
    the cells stage starts with the filler's first progress report."""
    measure: CellFiller = cells or (measure_exact_streamed if is_streamed(request.lm) else measure_exact)
    request.hooks.enter(DENSE_PASS)
    objective, dense, stats = measure(replace(request, hooks=cells_start(request.hooks)))
    return FilledCells(objective, dense, stats, np.ones(objective.shape, dtype=bool), None)


def cells_start(hooks: Hooks) -> Hooks:
    """``hooks`` whose progress announces the cells stage at its first call: ``measure_exact``
    reports (cells already measured, cells, None) once, as its dense pass ends."""
    started: list[bool] = []

    def report(done: int, total: int, eta: float | None = None) -> None:
        if not started:
            started.append(True)
            hooks.enter(CELLS)
        hooks.report(done, total, eta)

    return hooks.replaced(progress=report)
