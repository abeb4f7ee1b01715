"""Figures of the loss table: one sensitivity curve per layer, and the layers x rates heat map."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from gap_engine.views.figures.style import (
    DEPTH_SCALE,
    HEAT_SCALE,
    KIND_LABEL,
    OBJECTIVE_NAME,
    TEMPLATE,
    component_kinds,
    log_ticks,
    loss_label,
)


def layers_to_compare(table, smoothed: bool = True, count: int = 4) -> list[int]:
    """A few layers worth comparing first: the most and the least sensitive (``count // 2``
    each, by the summed loss increase of their components at the grid's middle rate), in
    layer order."""
    middle = len(table.rate_grid) // 2
    losses = np.asarray(table.losses(smoothed), dtype=float)[:, middle]
    per_layer = np.zeros(table.num_layers)
    for row, (layer, _) in enumerate(table.components):
        per_layer[layer] += losses[row]
    order = [int(i) for i in np.argsort(-per_layer, kind="stable")]
    most = order[: max(1, count // 2)]
    least = [layer for layer in order[::-1] if layer not in most][: max(0, count - len(most))]
    return sorted(most + least)


def sensitivity_figure(table, kinds=None, log_y: bool = True, smoothed: bool = True, layers=None) -> go.Figure:
    """One line per layer (loss increase against rate), one panel per component kind.

    Lines are coloured by depth with one colour bar (no legend of 2L entries); on the
    default log axis a few large curves do not flatten the rest, and ticks are whole
    decades in plain numbers. With ``layers`` (a few picked to compare) only those are drawn,
    each named once in a legend; a log axis has no 0, so a picked layer's cells at or below 0
    (a part the model does not miss, or noise) sit on a floor under the lowest decade, ticked
    "≤ 0" and said so on hover: every picked layer stays on the chart.
    """
    picked = None if layers is None else {int(layer) for layer in layers}
    kinds = [k for k in (kinds or component_kinds(table)) if k in component_kinds(table)] or component_kinds(table)
    losses = np.asarray(table.losses(smoothed), dtype=float)
    rates = np.asarray(table.rate_grid, dtype=float)
    n_layers = max(2, table.num_layers)
    colors = sample_colorscale(DEPTH_SCALE, np.linspace(0, 1, n_layers))
    shown = losses[np.isin([k for _, k in table.components], kinds)]
    positive = shown[shown > 0]
    low, high = (float(positive.min()), float(positive.max())) if positive.size else (1e-4, 1.0)
    floor = 10.0 ** (math.floor(math.log10(low)) - 0.5) if log_y and picked is not None else None  # half a decade under the lowest tick
    floored = False
    fig = make_subplots(rows=1, cols=len(kinds), shared_yaxes=True, horizontal_spacing=0.04, subplot_titles=[KIND_LABEL[k] for k in kinds])
    scale_shown = False
    for col, kind in enumerate(kinds, start=1):
        for row, (layer, k) in enumerate(table.components):
            if k != kind or (picked is not None and layer not in picked):
                continue
            value = losses[row]
            removed = np.asarray(table.removed[row])
            if floor is not None:
                keep = removed > 0  # a cell that removes nothing (rate 0) has nothing to show
            else:
                keep = value > 0 if log_y else np.ones_like(value, dtype=bool)  # zeros and noise have no place on a log axis
            low_cells = keep & (value <= 0) if floor is not None else np.zeros_like(keep)
            floored = floored or bool(low_cells.any())
            x, y = rates[keep], np.where(low_cells, floor or 0.0, value)[keep]
            said = [f"{v:+.4g} (≤ 0: drawn at the axis floor)" if under else f"{v:+.4g}" for v, under in zip(value[keep], low_cells[keep])]
            marker = dict(size=4, color=colors[layer])
            if low_cells.any():
                marker = dict(size=[9 if under else 4 for under in low_cells[keep]], color=colors[layer],
                              symbol=["triangle-down-open" if under else "circle" for under in low_cells[keep]])  # fmt: skip
            if picked is None and not scale_shown and len(x):  # the one colour bar rides on the first drawn line's markers
                marker = dict(
                    size=4,
                    color=[layer] * len(x),
                    colorscale=DEPTH_SCALE,
                    cmin=0,
                    cmax=n_layers - 1,
                    showscale=True,
                    colorbar=dict(title=dict(text="layer"), thickness=12, len=0.9),
                )
                scale_shown = True
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines+markers",
                    name=f"layer {layer}" if picked is not None else f"layer {layer} {KIND_LABEL[kind]}",
                    legendgroup=f"layer {layer}",
                    showlegend=picked is not None and col == 1,  # a few picked layers: named once, in a legend
                    line=dict(color=colors[layer], width=1.5),
                    marker=marker,
                    customdata=[[int(r), text] for r, text in zip(removed[keep], said)],
                    hovertemplate=f"layer {layer} {KIND_LABEL[kind]}<br>rate %{{x:.4g}}<br>%{{customdata[1]}} nats/token"
                    "<br>removes %{customdata[0]:,} params<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="pruning rate of the component", range=[-0.02, float(rates[-1]) + 0.02], row=1, col=col)
    y_title = loss_label(table.spec.objective)
    if log_y:
        tickvals, ticktext = log_ticks(low, high)
        bottom = math.log10(low) - 0.1
        if floored and floor is not None:
            tickvals, ticktext, bottom = [floor, *tickvals], ["≤ 0", *ticktext], math.log10(floor) - 0.15
        for col in range(1, len(kinds) + 1):
            fig.update_yaxes(type="log", tickvals=tickvals, ticktext=ticktext, range=[bottom, math.log10(high) + 0.1], row=1, col=col)
    fig.update_yaxes(title_text=y_title + (", log scale" if log_y else ""), row=1, col=1)
    fig.update_layout(
        template=TEMPLATE,
        height=460,
        margin=dict(t=40, b=50 if picked is None else 100, l=70, r=20),
        showlegend=picked is not None,
        legend=dict(orientation="h", y=-0.22, x=0.0),
    )
    return fig


def cell_notes(table) -> np.ndarray:
    """(C, R) text per cell: measured exactly or estimated, and on how many token positions."""
    measured = table.measured_cells()
    tokens = table.cell_tokens
    notes = np.empty(measured.shape, dtype=object)
    for c in range(measured.shape[0]):
        for r in range(measured.shape[1]):
            how = "removes nothing" if table.removed[c, r] == 0 else ("measured exactly" if measured[c, r] else "estimated (gradient)")
            notes[c, r] = how if tokens is None or table.removed[c, r] == 0 else f"{how} on {int(tokens[c, r]):,} tokens"
    return notes


def heatmap_figure(table, smoothed: bool = True, log_color: bool = False) -> go.Figure:
    """Layers x rates, one heatmap per component kind, darker = larger loss; hover gives the
    numbers and how each cell was filled. When a table mixes measured and estimated cells
    (``refine``), a ring marks every measured one."""
    kinds = component_kinds(table)
    losses = np.asarray(table.losses(smoothed), dtype=float)
    rates = [f"{r:.3g}" for r in table.rate_grid]
    notes = cell_notes(table)
    cutting = table.removed > 0
    marked = table.measured_cells() & cutting
    mixed = bool(marked.any()) and not bool(marked[cutting].all())
    fig = make_subplots(rows=1, cols=len(kinds), shared_yaxes=True, horizontal_spacing=0.04, subplot_titles=[KIND_LABEL[k] for k in kinds])
    zmax = float(np.max(losses)) if losses.size else 1.0
    for col, kind in enumerate(kinds, start=1):
        rows = [r for r, (_, k) in enumerate(table.components) if k == kind]
        layers = [table.components[r][0] for r in rows]
        z = losses[rows]
        shown = np.log10(np.clip(z, 1e-6, None)) if log_color else z
        fig.add_trace(
            go.Heatmap(
                z=shown,
                x=rates,
                y=layers,
                customdata=np.stack([z, table.removed[rows]], axis=-1),
                text=notes[rows],
                coloraxis="coloraxis",
                hovertemplate=f"layer %{{y}} {KIND_LABEL[kind]}<br>rate %{{x}}<br>+%{{customdata[0]:.4g}} nats/token"
                "<br>removes %{customdata[1]:,} params<br>%{text}<extra></extra>",
            ),
            row=1,
            col=col,
        )
        if mixed:
            cells = [(rates[r], table.components[c][0]) for c in rows for r in range(len(rates)) if marked[c, r]]
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in cells],
                    y=[y for _, y in cells],
                    mode="markers",
                    name="measured exactly",
                    marker=dict(symbol="circle-open", size=7, color="#00B5E2", line=dict(width=2)),
                    showlegend=col == 1,
                    hoverinfo="skip",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="pruning rate", row=1, col=col)
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=1)
    unit = OBJECTIVE_NAME.get(table.spec.objective, table.spec.objective) + " increase"
    fig.update_layout(
        template=TEMPLATE,
        height=max(360, 16 * table.num_layers + 120),
        margin=dict(t=40, b=50, l=60, r=20),
        coloraxis=dict(
            colorscale=HEAT_SCALE,
            cmin=None if log_color else 0.0,
            cmax=None if log_color else zmax,
            colorbar=dict(title=dict(text=f"log10 {unit}" if log_color else f"{unit}<br>(nats/token)"), thickness=12),
        ),
    )
    return fig
