"""Measured runs set side by side: which history runs compare, and their numbers with intervals.

Two runs compare when they pruned the same model and were evaluated on the same held-out
windows (text, window count and length, seed and split), so that window ``w`` of one is
window ``w`` of the other and a paired bootstrap (`intervals`) can judge their margin. The
history keeps each run's numbers per window (``params["per_window"]``, from
``EvalReport.per_window``); a run recorded before it did has its means alone, and is shown
without an interval, never with one made up.

Pure: history records in, numbers and intervals out (no torch, no I/O).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gap_engine.evaluate.history import RunRecord, fitted_as
from gap_engine.evaluate.intervals import Interval, mean_interval, perplexity_interval

# Budgets are equal when they agree as every page shows them: to two decimals of a percent.
BUDGET_TOLERANCE = 5e-5
MAX_WINDOWS = 100_000  # a stored per-window list longer than this is not one a run wrote


def windows_key(record: RunRecord) -> tuple[Any, ...] | None:
    """What makes two runs' held-out windows the same ones: the model, the text sources, the
    window count, length and seed, and the held-out split (None: the run recorded no settings)."""
    settings = (record.params or {}).get("eval")
    windows = settings.get("windows") if isinstance(settings, dict) else None
    if not isinstance(windows, dict):
        return None
    return (
        record.model,
        windows.get("data"),
        windows.get("n_samples"),
        windows.get("seq_len"),
        windows.get("seed"),
        settings.get("heldout_split") if isinstance(settings, dict) else None,
    )


def same_budget(first: float | None, second: float | None) -> bool:
    """Whether two budgets are equal as the pages show them (both known)."""
    return first is not None and second is not None and abs(first - second) <= BUDGET_TOLERANCE


def window_series(record: RunRecord, source: str, name: str) -> list[float] | None:
    """The run's ``name`` ("nll", "dense_nll", "kl", "top1") on each held-out window of ``source``;
    None when the run kept none (recorded before per-window numbers were kept) or kept
    something no run writes."""
    stored = (record.params or {}).get("per_window")
    numbers = stored.get(source) if isinstance(stored, dict) else None
    values = numbers.get(name) if isinstance(numbers, dict) else None
    if not isinstance(values, list) or not 0 < len(values) <= MAX_WINDOWS:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return None
    return [float(v) for v in values]


def comparable_runs(records: Sequence[RunRecord], reference: RunRecord) -> list[RunRecord]:
    """The runs (``reference`` among them) evaluated on the reference's held-out windows, oldest first."""
    key = windows_key(reference)
    if key is None:
        return [reference]
    return [r for r in records if r.id == reference.id or windows_key(r) == key]


@dataclass(frozen=True)
class MeasuredPoint:
    """One run's held-out numbers on one source, with their bootstrap intervals over its windows."""

    run_id: int
    allocator: str
    compensation: str  # what its kept units got after the cut ("none": surgery alone)
    budget: float  # requested fraction of prunable parameters removed
    source: str  # the held-out text
    perplexity: float
    perplexity_interval: Interval | None  # None: the run kept no per-window numbers
    kl: float | None  # mean KL(dense || pruned) per token; None: not measured
    kl_interval: Interval | None
    dense_perplexity: float | None

    @property
    def series(self) -> str:
        """The line it belongs to on a frontier: its allocator, and its compensation when it had one."""
        return self.allocator if self.compensation == "none" else f"{self.allocator} + {self.compensation}"


def measured_point(record: RunRecord, source: str) -> MeasuredPoint | None:
    """The run's numbers on ``source`` (None: it has no budget or no perplexity there)."""
    if record.budget is None or source not in record.perplexity:
        return None
    nll, kl = window_series(record, source, "nll"), window_series(record, source, "kl")
    return MeasuredPoint(
        run_id=int(record.id or 0),
        allocator=record.allocator,
        compensation=fitted_as(record),
        budget=float(record.budget),
        source=source,
        perplexity=float(record.perplexity[source]),
        perplexity_interval=perplexity_interval([nll]) if nll is not None else None,
        kl=float(record.kl[source]) if source in record.kl else None,
        kl_interval=mean_interval([kl]) if kl is not None else None,
        dense_perplexity=record.dense_perplexity.get(source),
    )


def measured_frontier(records: Sequence[RunRecord], reference: RunRecord, source: str | None = None) -> list[MeasuredPoint]:
    """Every run comparable with ``reference`` (same model and held-out windows) as a point on
    ``source`` (None: the reference's first held-out text), sorted by series and budget."""
    source = source or next(iter(reference.perplexity), None)
    if source is None:
        return []
    points = [p for r in comparable_runs(records, reference) if (p := measured_point(r, source)) is not None]
    return sorted(points, key=lambda p: (p.series, p.budget, p.run_id))


def dense_interval(records: Sequence[RunRecord], source: str) -> Interval | None:
    """The dense model's perplexity on ``source`` with its interval, from the first run that kept
    the dense per-window NLL (the same windows give the same dense numbers)."""
    for record in records:
        dense = window_series(record, source, "dense_nll")
        if dense is not None:
            return perplexity_interval([dense])
    return None
