"""The app's figures: the drawing lives in `gap_engine.figures` (the report draws the same).

What stays here is display maths the planner used to read off the table (`uniform_curve`,
`slider_rows`); it moves into the engine's allocation stage.
"""

from __future__ import annotations

import numpy as np

from gap_engine.figures import (  # noqa: F401  (the pages' names for the engine's figures)
    ATTN_COLOR,
    BASELINE_SYMBOLS,
    BYTES_PER_PARAM,
    KIND_LABEL,
    MLP_COLOR,
    SLIDER_STEPS,
    UNIFORM_COLOR,
    column_label,
    heatmap_figure,
    history_figure,
    loss_label,
    planner_figure,
    predicted_vs_actual_figure,
    sensitivity_figure,
)


def uniform_curve(table, n_points: int = 120, smoothed: bool = True) -> dict:
    """The uniform baseline read off the table: every component at one common rate u.

    Each row's removed parameters and loss are read linearly between grid rates, so this
    is a display curve (the exact, unit-rounded uniform plan is `allocation`'s ``uniform``).
    Returns arrays: rate u, budget (fraction of prunable), predicted loss.
    """
    grid = np.asarray(table.rate_grid, dtype=float)
    losses = np.asarray(table.losses(smoothed), dtype=float)
    removed = np.asarray(table.removed, dtype=float)
    u = np.linspace(0.0, grid[-1], n_points)
    rem = np.array([[np.interp(x, grid, removed[c]) for x in u] for c in range(len(removed))]).sum(axis=0)
    loss = np.array([[np.interp(x, grid, losses[c]) for x in u] for c in range(len(losses))]).sum(axis=0)
    return {"rate": u, "budget": rem / table.dense_prunable, "loss": loss}


def slider_rows(front: list[dict], steps: int = SLIDER_STEPS) -> tuple[np.ndarray, list[dict]]:
    """``steps`` budgets evenly from 0 to the front's largest, each with its optimum row."""
    top = front[-1]["budget"] if front else 0.0
    budgets = np.linspace(0.0, top, steps)
    row_budgets = np.array([row["budget"] for row in front])
    picks = [front[min(int(np.searchsorted(row_budgets, b - 1e-12)), len(front) - 1)] for b in budgets]
    return budgets, picks
