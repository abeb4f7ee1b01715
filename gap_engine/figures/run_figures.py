"""Figures of the run history: a metric against budget per allocator, predicted against measured."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from .style import BASELINE_COLORS, BASELINE_SYMBOLS, TEMPLATE, column_label


def history_figure(frame, metric: str) -> go.Figure:
    """One point per run: budget against ``metric``, coloured by allocator, hover with the run id."""
    fig = go.Figure()
    for allocator, part in frame.groupby("allocator"):
        part = part.sort_values("budget")
        fig.add_trace(
            go.Scatter(
                x=part["budget"] * 100,
                y=part[metric],
                mode="markers+lines",
                name=str(allocator),
                marker=dict(size=10, symbol=BASELINE_SYMBOLS.get(str(allocator), "circle"), color=BASELINE_COLORS.get(str(allocator))),
                customdata=np.stack([part["id"], part["created"]], axis=-1),
                hovertemplate="run %{customdata[0]} (%{customdata[1]})<br>budget %{x:.1f}%<br>"
                + column_label(metric)
                + " %{y:.5g}<extra>"
                + str(allocator)
                + "</extra>",
            )
        )
    fig.update_layout(
        template=TEMPLATE,
        height=380,
        margin=dict(t=30, b=50, l=60, r=20),
        xaxis_title="budget (% of prunable parameters removed)",
        yaxis_title=column_label(metric),
        legend=dict(title=dict(text="allocator")),
    )
    return fig


def predicted_vs_actual_figure(frame) -> go.Figure:
    """Predicted against measured calibration loss increase, one point per run."""
    part = frame.dropna(subset=["predicted_loss", "actual_loss"])
    fig = go.Figure()
    if len(part):
        top = float(max(part["predicted_loss"].max(), part["actual_loss"].max())) * 1.05
        fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="predicted = measured", line=dict(dash="dot", color="#999")))
    for allocator, rows in part.groupby("allocator"):
        fig.add_trace(
            go.Scatter(
                x=rows["predicted_loss"],
                y=rows["actual_loss"],
                mode="markers",
                name=str(allocator),
                marker=dict(size=10, symbol=BASELINE_SYMBOLS.get(str(allocator), "circle"), color=BASELINE_COLORS.get(str(allocator))),
                customdata=np.stack([rows["id"], rows["budget"] * 100], axis=-1),
                hovertemplate="run %{customdata[0]}, budget %{customdata[1]:.1f}%<br>predicted %{x:.4f}<br>measured %{y:.4f}<extra></extra>",
            )
        )
    fig.update_layout(
        template=TEMPLATE,
        height=380,
        margin=dict(t=30, b=50, l=60, r=20),
        xaxis_title="predicted loss increase, table (nats/token)",
        yaxis_title="measured increase, calibration (nats/token)",
    )
    return fig
