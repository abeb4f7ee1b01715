"""Validation for meaning: the numbers a file holds must agree with each other (and with the
model, where it is at hand), not only have the right types.

``validate`` checks each field alone: an integer is an integer, a number is finite, a list has
its length. A file can pass all of that and still hold numbers no build produces, which every
later step would then repeat as if measured: a loss-table cell that removes parameters at rate
0, removals that shrink as the rate grows, cells that together remove more than the model has,
a smoothed row that is not the smoothing of its raw row, a loss of -1e300; a plan whose
parameter counts contradict each other. The checks here refuse those, with one line naming the
first cell or count at fault. They are pure (numpy and plain values), so the CLI, the cache and
the explorer's uploads share them, and a model-specific check (the parameters a model's
geometry removes at each rate) only compares against counts the caller computed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gap_engine.core.errors import GapError

# Per-token objectives (NLL, KL) past this are no measurement: a mean next-token loss of a
# million nats needs logits a million apart. Anything a build or an estimate writes is far below.
MAX_OBJECTIVE = 1e6
# Float noise allowed when a number is recomputed from others (the file's own are exact float64
# reprs, so only the order of operations differs).
REL_TOL = 1e-9
# The parameter counts a plan's ``params`` may hold, and how each follows from the others.
PLAN_COUNTS = ("dense_total", "dense_prunable", "pruned_prunable", "pruned_total", "removed")
PLAN_FRACTIONS = {"removed_fraction_of_prunable": "dense_prunable", "removed_fraction_of_total": "dense_total"}


def _first(mask: np.ndarray) -> tuple[int, int]:
    """(row, column) of the first True cell of a (C, R) mask."""
    row, column = np.argwhere(mask)[0]
    return int(row), int(column)


def _close(a: float, b: float, scale: float = 1.0) -> bool:
    return abs(a - b) <= REL_TOL * max(scale, abs(a), abs(b), 1.0)


def _check_rate_zero(rate_grid: np.ndarray, removed: np.ndarray, delta: np.ndarray, cell_objective: np.ndarray,
                     dense_objective: float, rows: Sequence[str], error: type[GapError]) -> None:  # fmt: skip
    """``error`` unless the rate-0 column is the dense model: nothing removed, no change of the loss."""
    what = "loss table"
    for dense_column in (int(i) for i in np.flatnonzero(np.asarray(rate_grid) == 0.0)):
        bad = np.flatnonzero(removed[:, dense_column] != 0)
        if bad.size:
            row = int(bad[0])
            raise error(f"{what} {rows[row]} removes {int(removed[row, dense_column]):,} parameters at rate 0; a rate of 0 removes nothing")
        bad = np.flatnonzero((delta[:, dense_column] != 0.0) | (cell_objective[:, dense_column] != dense_objective))
        if bad.size:
            row = int(bad[0])
            raise error(
                f"{what} {rows[row]} changes the loss at rate 0 (delta {delta[row, dense_column]:g}); a rate of 0 is the dense model"
            )


def check_table_cells(
    *,
    rate_grid: np.ndarray,
    removed: np.ndarray,
    delta: np.ndarray,
    cell_objective: np.ndarray,
    dense_objective: float,
    dense_prunable: int,
    measured: np.ndarray,
    rows: Sequence[str],
    smoothed: np.ndarray | None = None,
    expected_smoothed: np.ndarray | None = None,
    error: type[GapError],
) -> None:
    """``error`` (one line) unless a loss table's cells are what a build produces.

    Args:
        rate_grid: (R,) rates, ascending from 0 (checked by the spec).
        removed: (C, R) whole parameter counts per cell.
        delta, cell_objective: (C, R) raw objective increase and raw objective per cell.
        dense_objective: the dense model's objective on the same windows.
        dense_prunable: the dense model's prunable parameters.
        measured: (C, R) bool, measured (True) or estimated.
        rows: a name per row for messages ("layer 3 attn").
        smoothed, expected_smoothed: the file's smoothed table and the smoothing of its delta
            (``isotonic_smooth``), compared when both are given.
        error: the GapError subclass to raise.
    """
    what = "loss table"
    if not 0.0 <= dense_objective <= MAX_OBJECTIVE:
        raise error(f"{what} dense_objective {dense_objective:g} is not a loss (NLL and KL lie in [0, {MAX_OBJECTIVE:g}])")
    _check_rate_zero(rate_grid, removed, delta, cell_objective, dense_objective, rows, error)
    steps = np.diff(removed, axis=1)
    if np.any(steps < 0):
        c, r = _first(steps < 0)
        raise error(
            f"{what} {rows[c]} removes {int(removed[c, r + 1]):,} parameters at rate {rate_grid[r + 1]:g}, fewer than "
            f"{int(removed[c, r]):,} at rate {rate_grid[r]:g}; a higher rate never removes less"
        )
    most = int(removed.max(axis=1).sum()) if removed.size else 0
    if most >= dense_prunable:
        raise error(
            f"{what} cells remove up to {most:,} parameters together, not less than the model's {dense_prunable:,} prunable ones; "
            "every rate below 1 keeps part of each layer"
        )
    for name, values in (("delta", delta), ("cell_objective", cell_objective)):
        if np.any(np.abs(values) > MAX_OBJECTIVE):
            c, r = _first(np.abs(values) > MAX_OBJECTIVE)
            raise error(
                f"{what} {name} of {rows[c]} at rate {rate_grid[r]:g} is {values[c, r]:g}: no loss is that far past {MAX_OBJECTIVE:g}"
            )
    recomputed = cell_objective - dense_objective
    off = np.abs(delta - recomputed) > REL_TOL * np.maximum(1.0, np.abs(cell_objective))
    if np.any(off):
        c, r = _first(off)
        raise error(
            f"{what} delta of {rows[c]} at rate {rate_grid[r]:g} is {delta[c, r]:g}, but its cell objective "
            f"{cell_objective[c, r]:g} minus the dense {dense_objective:g} is {recomputed[c, r]:g}"
        )
    negative = np.asarray(measured, dtype=bool) & (cell_objective < -REL_TOL * max(1.0, dense_objective))
    if np.any(negative):
        c, r = _first(negative)
        raise error(
            f"{what} {rows[c]} at rate {rate_grid[r]:g} holds a measured loss of {cell_objective[c, r]:g}; NLL and KL are never negative"
        )
    if smoothed is not None and expected_smoothed is not None:
        off = np.abs(smoothed - expected_smoothed) > REL_TOL * np.maximum(1.0, np.abs(expected_smoothed))
        if np.any(off):
            c, r = _first(off)
            raise error(
                f"{what} smoothed value of {rows[c]} at rate {rate_grid[r]:g} is {smoothed[c, r]:g}, but smoothing its "
                f"delta row gives {expected_smoothed[c, r]:g}"
            )


def check_removed_matches(removed: np.ndarray, expected: np.ndarray, dense_prunable: int, expected_prunable: int, rows: Sequence[str],
                          rate_grid: np.ndarray, model: str, error: type[GapError]) -> None:  # fmt: skip
    """``error`` unless a table's parameter counts are those ``model``'s geometry removes at its rates."""
    if dense_prunable != expected_prunable:
        raise error(
            f"loss table counts {dense_prunable:,} prunable parameters, but {model} has {expected_prunable:,}: it is another model's table"
        )
    off = removed != expected
    if np.any(off):
        c, r = _first(off)
        raise error(
            f"loss table {rows[c]} removes {int(removed[c, r]):,} parameters at rate {rate_grid[r]:g}, but in {model} "
            f"that rate removes {int(expected[c, r]):,}: it is another model's table"
        )


def check_plan_params(params: Mapping[str, Any], error: type[GapError]) -> None:
    """``error`` unless a plan's recorded parameter counts agree with each other.

    Each count present must be a whole, non-negative number; removed at most dense_prunable;
    pruned_prunable = dense_prunable - removed, pruned_total = dense_total - removed, and each
    fraction its count over its whole. A plan made by ``make_plan`` always satisfies them.
    """
    counts: dict[str, int] = {}
    for name in PLAN_COUNTS:
        if name in params:
            value = params[name]
            if float(value) != math.floor(float(value)) or not 0 <= float(value) <= 1e15:
                raise error(f"plan params {name} = {value:g} is not a parameter count")
            counts[name] = int(value)
    if "removed" in counts and "dense_prunable" in counts and counts["removed"] > counts["dense_prunable"]:
        raise error(f"plan params removed {counts['removed']:,} is more than its dense_prunable {counts['dense_prunable']:,}")
    for whole, part, name in (("dense_prunable", "pruned_prunable", "pruned_prunable"), ("dense_total", "pruned_total", "pruned_total")):
        if {whole, part, "removed"} <= counts.keys() and counts[whole] - counts["removed"] != counts[part]:
            raise error(f"plan params {name} {counts[part]:,} is not {whole} {counts[whole]:,} minus removed {counts['removed']:,}")
    for name, whole in PLAN_FRACTIONS.items():
        if name not in params:
            continue
        fraction = float(params[name])
        if not 0.0 <= fraction < 1.0:
            raise error(f"plan params {name} = {fraction:g} is outside [0, 1)")
        if "removed" in counts and counts.get(whole) and not _close(fraction, counts["removed"] / counts[whole]):
            raise error(f"plan params {name} {fraction:g} is not removed / {whole} = {counts['removed'] / counts[whole]:g}")


# kept_indices.json key -> (the per-block width it must list, the dense config field its indices lie below)
KEPT_WIDTHS = {
    "kept_heads": ("num_attention_heads", "num_attention_heads"),
    "kept_kv_heads": ("num_key_value_heads", "num_key_value_heads"),
    "kept_channels": ("intermediate_size", "intermediate_size"),
}


def check_kept_fits(kept: Mapping[str, Any], widths: Sequence[Mapping[str, Any]], dense: Mapping[str, Any], where: str,
                    error: type[GapError]) -> None:  # fmt: skip
    """``error`` unless a checkpoint's kept indices (type-checked by ``validate.check_kept_indices``)
    describe its blocks: one list per block of config.json, each as long as the block's recorded
    width, every index below the dense model's count (``dense``: config.json's top-level fields)."""
    what = f"{where}/kept_indices.json"
    for key, (width, whole) in KEPT_WIDTHS.items():
        rows = kept[key]
        if len(rows) != len(widths):
            raise error(f"{what} {key} lists {len(rows)} blocks, but config.json has {len(widths)} layers")
        limit = dense.get(whole)
        for i, row in enumerate(rows):
            if len(row) != widths[i][width]:
                raise error(f"{what} {key}[{i}] lists {len(row)} units, but config.json keeps {widths[i][width]} in that block")
            if isinstance(limit, int) and row and max(row) >= limit:
                raise error(f"{what} {key}[{i}] names unit {max(row)}, but the dense model has {limit} ({whole})")
