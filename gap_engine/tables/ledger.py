"""The bookkeeping of an exact build whose cells are measured in groups (streamed, or on Ray workers).

``CellLedger`` knows which distinct cells a table needs, which ones a killed or cancelled
build already saved (``PartialStore``, i.e. ``cache.PartialCells``), and records new ones as
they arrive in any order: saved every few cells or seconds, progress with an ETA weighted
by what each cell costs (the blocks it runs). The resident builder (``tables.exact``)
measures one cell at a time in its own loop; both write the same partial file, so a build
started one way resumes another way.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from gap_engine.core.progress import EtaClock, ProgressFn
from gap_engine.tables.cells import Cut
from gap_engine.tables.exact import PARTIAL_SAVE_CELLS, PARTIAL_SAVE_SECONDS, PartialStore

log = logging.getLogger(__name__)

Job = tuple[int, int, Cut]  # (component, rate index, cut) of one distinct cell


def block_costs(lm) -> tuple[int, float]:
    """(blocks, the LM head's cost in blocks): a cell at layer i costs blocks - i + head."""
    layers = lm.adapter.layers(lm.model)
    block_params = sum(p.numel() for p in layers[0].parameters())
    head = lm.adapter.lm_head(lm.model)
    return len(layers), head.in_features * head.out_features / max(block_params, 1)


class CellLedger:
    """Measured cells of one exact build: what is left, saved as it goes, progress and ETA."""

    def __init__(self, lm, jobs: list[Job], partial: PartialStore | None, progress: ProgressFn | None):
        self.jobs = jobs
        self.partial = partial
        self.progress = progress
        wanted = {(c, r) for c, r, _ in jobs}
        stored = partial.load() if partial is not None else {}
        self.measured: dict[tuple[int, int], float] = {cell: v for cell, v in stored.items() if cell in wanted}
        self.resumed = len(self.measured)
        if self.resumed:
            log.info("resuming a loss table build: %d of %d cells already measured", self.resumed, len(jobs))
        blocks, head = block_costs(lm)
        self.costs = [blocks - cut.layer + head for _, _, cut in jobs]
        self.todo = [k for k, (c, r, _) in enumerate(jobs) if (c, r) not in self.measured]
        self.clock = EtaClock([self.costs[k] for k in self.todo])
        self.last_save, self.unsaved = time.perf_counter(), 0
        if progress:
            progress(len(self.measured), len(jobs), None)

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
        if self.progress:
            self.progress(len(self.measured), len(self.jobs), eta)

    def flush(self) -> None:
        """Save what is measured now (nothing to do without a partial store)."""
        if self.partial is not None and self.unsaved:
            self.partial.save(self.measured)
        self.last_save, self.unsaved = time.perf_counter(), 0

    def missing(self) -> list[int]:
        """Jobs not measured yet."""
        return [k for k in self.todo if (self.jobs[k][0], self.jobs[k][1]) not in self.measured]

    def done_message(self) -> str:
        return f"{len(self.measured)} of {len(self.jobs)} cells"

    def table(self, owner: dict, shape: tuple[int, int], dense_objective: float) -> tuple[np.ndarray, dict]:
        """(C, R) objectives (cells sharing a cut read its value) and the build statistics."""
        objective = np.empty(shape, dtype=np.float64)
        for (c, r), source in owner.items():
            objective[c, r] = dense_objective if source is None else self.measured[source]
        stats = {"cells_measured": len(self.jobs) - self.resumed, "cells_resumed": self.resumed, "distinct_cells": len(self.jobs)}
        return objective, stats
