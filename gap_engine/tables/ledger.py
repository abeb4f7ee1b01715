"""What a table filler is given and returns, and the bookkeeping every way of measuring cells shares.

A filler (`CellFiller`) takes a `CellRequest` (the model, the spec, the calibration windows,
the unit scores, the table's components and the partial store) and returns `CellObjectives`:
(C, R) objectives, the dense objective, build statistics and which cells were measured.
Each estimator registers its own (``estimators.ESTIMATORS``); the exact one's cells may
instead be measured on Ray workers (``distributed.RayCells``), a filler of the same kind.
``exact.measure_exact``, ``distributed.RayCells`` and ``refine.refine_cells`` measure
through the same ledger.

``CellLedger`` knows which distinct cells a build needs, which ones a killed or cancelled
build already saved (``PartialStore``, i.e. ``cache.PartialCells``), and records new ones as
they arrive in any order: saved every few cells or seconds, progress with an ETA weighted
by what each cell costs (the blocks it runs) told to the stage the build runs under
(``core.progress.active``: ``build.measure_table`` opens it). Every path writes the same partial file, so a
build started one way resumes another way. A saved cell carries the key of the units it
removed (``cells.Cut.units_key``) and is reused only where the build removes the same units
now: the importance scores are computed again on resume, and a near-tie in their ranking
that flips (another device, streaming, another thread count) must not seal cells cut on
different units into one table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
import torch
from torch import nn

from gap_engine.core.progress import EtaClock, active
from gap_engine.model.loaded import LoadedModel
from gap_engine.prune.importance import ImportanceScores
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.cells import Cut

log = logging.getLogger(__name__)

# A resumable build writes its measured cells at least this often.
PARTIAL_SAVE_SECONDS = 10.0
PARTIAL_SAVE_CELLS = 16

Job = tuple[int, int, Cut]  # (component, rate index, cut) of one distinct cell
Cell = tuple[int, int]  # (component, rate index)
SavedCell = tuple[float, str]  # (objective, the units key of the cut it was measured on)
Owner = dict[Cell, Cell | None]  # cell -> the distinct cell whose value it reads (None: removes nothing, reads dense)
BuildStats = dict[str, Any]  # build statistics a table file keeps in its extras (a JSON object)


class PartialStore(Protocol):
    """Where a resumable build keeps its measured cells (see cache.PartialCells)."""

    def load(self) -> dict[Cell, SavedCell]: ...

    def save(self, cells: dict[Cell, SavedCell]) -> None: ...


def resumable(saved: dict[Cell, SavedCell], units: dict[Cell, str]) -> dict[Cell, float]:
    """The saved cells a build can reuse: those it wants (``units``: cell -> key of the units it
    removes now) that were measured on those same units."""
    reused = {cell: value for cell, (value, key) in saved.items() if units.get(cell) == key}
    changed = sum(1 for cell, (_, key) in saved.items() if cell in units and units[cell] != key)
    if changed:
        log.info("%d saved cells removed other units than this build does (scores ranked them anew): measured again", changed)
    return reused


@dataclass(frozen=True)
class CellRequest:
    """What a cell filler measures, and where it saves as it goes (progress and cancel: the
    active stage's)."""

    lm: LoadedModel  # the dense model (its weights are masked cell by cell and restored)
    spec: TableSpec  # the table's settings (objective, rate grid, channel multiple)
    windows: torch.Tensor  # (N, T) calibration token ids
    scores: ImportanceScores  # which units each rate removes
    components: list[tuple[int, str]]  # (layer, kind) per table row
    partial: PartialStore | None = None  # measured cells saved here and read back on resume


class CellObjectives(NamedTuple):
    """What every filler returns: the objective of each cell, the dense objective, and which
    cells were measured. A filler that measures every cell returns ``measured`` all True and
    ``estimate`` None; ``build.assemble_table`` records the last two in the table."""

    objective: np.ndarray  # (C, R) float64 objective per cell (cells sharing a cut share it)
    dense: float  # the dense model's objective (0 for kl)
    stats: BuildStats  # build statistics: cells measured, resumed, distinct; the filler's extras
    measured: np.ndarray  # (C, R) bool: measured (True) or estimated (False)
    estimate: np.ndarray | None  # (C, R) the gradient estimate of delta a refined table started from


# Fills every cell of a request's table, entering its stages on the active stage's hooks: each
# estimator's function (``estimators.ESTIMATORS``), or Ray workers measuring exact cells.
CellFiller = Callable[[CellRequest], CellObjectives]


def block_costs(lm: LoadedModel) -> tuple[int, float]:
    """(blocks, the LM head's cost in blocks): a cell at layer i costs blocks - i + head."""
    layers = lm.adapter.layers(lm.model)
    block_params = sum(p.numel() for p in layers[0].parameters())
    head = cast(nn.Linear, lm.adapter.lm_head(lm.model))
    return len(layers), head.in_features * head.out_features / max(block_params, 1)


class CellLedger:
    """Measured cells of one exact build (or one refine round): what is left, saved as it goes,
    progress and ETA.

    Args:
        jobs: the distinct cells wanted.
        partial: read back now (unless ``measured`` is given) and saved as cells arrive.
        The active stage (``core.progress.active``) is told (cells measured, cells, eta) now
        and after every new cell; its cancel is what the schedules poll.
        measured: the dict to record into, holding cells measured before (a refined table's
            earlier rounds: they count as done, and every save writes them too); None: a new
            one holding the wanted cells that ``partial`` already has, measured on the same units.
        units: cell -> units key of every cell ``measured`` may hold (saved beside its value);
            None: those of ``jobs``.
    """

    def __init__(
        self,
        lm: LoadedModel,
        jobs: list[Job],
        partial: PartialStore | None,
        measured: dict[Cell, float] | None = None,
        units: dict[Cell, str] | None = None,
    ):
        self.jobs = jobs
        self.partial = partial
        self.hooks = active()
        self.units = units if units is not None else {(c, r): cut.units_key for c, r, cut in jobs}
        wanted = {(c, r) for c, r, _ in jobs}
        if measured is None:
            stored = resumable(partial.load(), self.units) if partial is not None else {}
            measured = {cell: v for cell, v in stored.items() if cell in wanted}
            self.resumed = len(measured)
        else:
            self.resumed = 0
        self.measured = measured
        self.total = len(jobs) + sum(1 for cell in measured if cell not in wanted)
        if self.resumed:
            log.info("resuming a loss table build: %d of %d cells already measured", self.resumed, len(jobs))
        blocks, head = block_costs(lm)
        self.costs = [blocks - cut.layer + head for _, _, cut in jobs]
        self.todo = [k for k, (c, r, _) in enumerate(jobs) if (c, r) not in self.measured]
        self.clock = EtaClock([self.costs[k] for k in self.todo])
        self.last_save, self.unsaved = time.perf_counter(), 0
        self.hooks.report(len(self.measured), self.total, None)

    def record(self, k: int, value: float) -> None:
        """Cell ``jobs[k]`` measured ``value``: saved when enough is unsaved, progress told."""
        c, r, _ = self.jobs[k]
        if (c, r) in self.measured:
            return  # a retried group may return a cell twice; the first value stands
        self.measured[c, r] = value
        self.unsaved += 1
        eta = self.clock.step(self.costs[k])
        now = time.perf_counter()
        if self.partial is not None and (self.unsaved >= PARTIAL_SAVE_CELLS or now - self.last_save >= PARTIAL_SAVE_SECONDS):
            self.flush()
        self.hooks.report(len(self.measured), self.total, eta)

    def flush(self) -> None:
        """Save what is measured now (nothing to do without a partial store)."""
        if self.partial is not None and self.unsaved:
            self.partial.save({cell: (value, self.units[cell]) for cell, value in self.measured.items()})
        self.last_save, self.unsaved = time.perf_counter(), 0

    def missing(self) -> list[int]:
        """Jobs not measured yet."""
        return [k for k in self.todo if (self.jobs[k][0], self.jobs[k][1]) not in self.measured]

    def done_message(self) -> str:
        return f"{len(self.measured)} of {self.total} cells"

    def table(self, owner: Owner, shape: tuple[int, int], dense_objective: float) -> tuple[np.ndarray, BuildStats]:
        """(C, R) objectives (cells sharing a cut read its value) and the build statistics."""
        objective = np.empty(shape, dtype=np.float64)
        for (c, r), source in owner.items():
            objective[c, r] = dense_objective if source is None else self.measured[source]
        stats: BuildStats = {
            "cells_measured": len(self.jobs) - self.resumed,
            "cells_resumed": self.resumed,
            "distinct_cells": len(self.jobs),
        }
        return objective, stats
