"""Figures of the run history: a metric against budget per allocator, predicted against measured."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from gap_engine.views.figures.style import BASELINE_COLORS, BASELINE_SYMBOLS, TEMPLATE, column_label


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
                hovertemplate="run %{customdata[0]}, budget %{customdata[1]:.2f}%<br>predicted %{x:.4f}<br>measured %{y:.4f}<extra></extra>",
            )
        )
    fig.update_layout(
        template=TEMPLATE,
        height=420,
        # Short axis titles and the legend under the plot: on a 390 px phone the titles fit and
        # the modebar (top right) covers nothing.
        margin=dict(t=40, b=120, l=60, r=20),
        xaxis_title="predicted increase (table, nats/token)",
        yaxis_title="measured (calibration, nats/token)",
        legend=dict(orientation="h", x=0.0, y=-0.3, yanchor="top"),
    )
    return fig


RUN_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D", "#333333")


def runs_rates_figure(runs: list[tuple[str, list[float], list[float]]]) -> go.Figure:
    """The per-layer rates of several runs overlaid: attention on the left, MLP on the right.

    Args:
        runs: (label, attention rates, MLP rates) per run, one colour each.
    """
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06, subplot_titles=("attention", "MLP"))
    for i, (label, attention, mlp) in enumerate(runs):
        color = RUN_COLORS[i % len(RUN_COLORS)]
        for col, rates in ((1, attention), (2, mlp)):
            fig.add_trace(
                go.Scatter(
                    x=list(range(len(rates))),
                    y=[100 * r for r in rates],
                    mode="lines+markers",
                    name=label,
                    legendgroup=label,
                    showlegend=col == 1,
                    line=dict(color=color, width=2, shape="hvh"),
                    marker=dict(size=6, color=color),
                    hovertemplate=f"{label}<br>layer %{{x}}: %{{y:.1f}}%<extra></extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_layout(
        template=TEMPLATE,
        height=360,
        margin=dict(t=40, b=50, l=60, r=20),
        legend=dict(orientation="h", yanchor="bottom", y=-0.35, x=0),
    )
    fig.update_xaxes(title_text="layer", dtick=5)
    fig.update_yaxes(title_text="rate (% of the component removed)", range=[0, 100], row=1, col=1)
    fig.update_yaxes(range=[0, 100], row=1, col=2)
    return fig


CURVE_FONT = 14  # px: the recovery charts are read from across a room in a demo


def curve_figure(points: list[dict], y: str, y_title: str, height: int = 300) -> go.Figure:
    """A training curve (``step`` against ``y`` of each point, e.g. a recovery's loss per step), in
    type a projector shows: 14 px ticks and titles."""
    steps = [p["step"] for p in points if p.get(y) is not None]
    values = [p[y] for p in points if p.get(y) is not None]
    fig = go.Figure(
        go.Scatter(x=steps, y=values, mode="lines+markers", marker=dict(size=5), hovertemplate="step %{x}<br>%{y:.4f}<extra></extra>")
    )
    fig.update_layout(
        template=TEMPLATE,
        height=height,
        margin=dict(t=20, b=55, l=70, r=20),
        font=dict(size=CURVE_FONT),
        xaxis=dict(title_text="step", tickfont=dict(size=CURVE_FONT)),
        yaxis=dict(title_text=y_title, tickfont=dict(size=CURVE_FONT)),
        showlegend=False,
    )
    return fig
