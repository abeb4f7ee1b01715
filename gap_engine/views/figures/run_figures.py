"""Figures of the run history: a metric against budget per allocator, predicted against measured, the measured frontier."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from gap_engine.views.figures.style import TEMPLATE, allocator_style, column_label


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
                marker=dict(size=10, symbol=allocator_style(str(allocator), None)[0], color=allocator_style(str(allocator), None)[1]),
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
                marker=dict(size=10, symbol=allocator_style(str(allocator), None)[0], color=allocator_style(str(allocator), None)[1]),
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


def _series_style(series: str) -> tuple[str, str]:
    """(colour, marker symbol) of a frontier line: its allocator's, DP black; a compensated
    line keeps its allocator's colour with an open marker."""
    allocator, _, compensation = series.partition(" + ")
    symbol, color = allocator_style(allocator, RUN_COLORS[sum(map(ord, allocator)) % len(RUN_COLORS)])
    return str(color), f"{symbol}-open" if compensation else symbol


def _error_bars(values: list[float], intervals: list) -> dict:
    """Plotly's asymmetric error bars of ``values`` (none where a point has no interval)."""
    return dict(
        type="data",
        symmetric=False,
        array=[0.0 if i is None else i.high - v for v, i in zip(values, intervals)],
        arrayminus=[0.0 if i is None else v - i.low for v, i in zip(values, intervals)],
        thickness=1.5,
        width=5,
    )


def measured_frontier_figure(points: list, dense=None) -> go.Figure:
    """Measured held-out perplexity (left) and KL to dense (right) against budget, one line per
    allocator (and compensation), each point a finished run with its 95% bootstrap interval over
    the held-out windows as error bars; a run recorded without per-window numbers is drawn
    without a bar and says so on hover.

    Args:
        points: ``measured.measured_frontier`` points, all on one source.
        dense: the dense model's perplexity Interval (``measured.dense_interval``), or None.
    """
    from plotly.subplots import make_subplots

    source = points[0].source if points else ""
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.1,
        subplot_titles=(f"perplexity on {source} (lower is better)", f"KL to the dense model on {source} (lower is better)"),
    )  # fmt: skip
    for series in dict.fromkeys(p.series for p in points):
        part = [p for p in points if p.series == series]
        color, symbol = _series_style(series)
        budgets = [100 * p.budget for p in part]
        notes = [
            f"run {p.run_id}" + ("" if p.perplexity_interval else " (no interval: recorded before per-window numbers were kept)")
            for p in part
        ]
        ppl = [p.perplexity for p in part]
        fig.add_trace(
            go.Scatter(
                x=budgets, y=ppl, mode="lines+markers", name=series, legendgroup=series,
                line=dict(color=color, width=2), marker=dict(size=9, color=color, symbol=symbol),
                error_y=_error_bars(ppl, [p.perplexity_interval for p in part]),
                customdata=notes, hovertemplate="%{customdata}<br>budget %{x:.2f}%<br>perplexity %{y:.2f}<extra>" + series + "</extra>",
            ),
            row=1, col=1,
        )  # fmt: skip
        with_kl = [p for p in part if p.kl is not None]
        kl = [p.kl for p in with_kl]
        fig.add_trace(
            go.Scatter(
                x=[100 * p.budget for p in with_kl], y=kl, mode="lines+markers", name=series, legendgroup=series, showlegend=False,
                line=dict(color=color, width=2), marker=dict(size=9, color=color, symbol=symbol),
                error_y=_error_bars(kl, [p.kl_interval for p in with_kl]),
                customdata=[n for n, p in zip(notes, part) if p.kl is not None],
                hovertemplate="%{customdata}<br>budget %{x:.2f}%<br>KL %{y:.4f} nats/token<extra>" + series + "</extra>",
            ),
            row=1, col=2,
        )  # fmt: skip
    if dense is not None and points:
        # A trace, not a shape: a shape's annotation on a log axis reads its y as a power of ten.
        budgets = [100 * p.budget for p in points]
        span = [min(budgets) - 1.0, max(budgets) + 1.0]
        label = f"dense {dense.estimate:.2f} [{dense.low:.2f}, {dense.high:.2f}]"
        fig.add_trace(
            go.Scatter(x=span, y=[dense.high] * 2, mode="lines", line=dict(width=0), showlegend=False, hoverinfo="skip"), row=1, col=1
        )
        fig.add_trace(
            go.Scatter(
                x=span, y=[dense.low] * 2, mode="lines", fill="tonexty", fillcolor="rgba(153,153,153,0.15)", line=dict(width=0),
                showlegend=False, hoverinfo="skip",
            ),
            row=1, col=1,
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(x=span, y=[dense.estimate] * 2, mode="lines", name=label, line=dict(color="#999", dash="dot"), hoverinfo="name"),
            row=1, col=1,
        )  # fmt: skip
    fig.update_layout(
        template=TEMPLATE,
        height=400,
        margin=dict(t=40, b=110, l=60, r=20),
        legend=dict(orientation="h", x=0.0, y=-0.25, yanchor="top", title=dict(text="allocator")),
    )
    fig.update_xaxes(title_text="budget (% of prunable parameters removed)")
    fig.update_yaxes(title_text="perplexity (log scale)", type="log", row=1, col=1)  # runs from 1.1x to 50x dense share one axis
    fig.update_yaxes(title_text="KL (nats/token)", rangemode="tozero", row=1, col=2)
    return fig
