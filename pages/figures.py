"""Plotly figures of the app, built from what the engine returns (no Streamlit here).

The planner figure carries the whole Pareto front: a native Plotly slider whose steps
swap the bars, the loss marker and the readouts in the browser (zero-duration animation
frames), so the per-layer rates follow the pointer while it moves, with no round trip to
the server.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from gap_engine.allocate.front import front_at_budgets, uniform_curve

KIND_LABEL = {"attn": "attention", "mlp": "MLP", "block": "block"}
ATTN_COLOR = "#4C78A8"
MLP_COLOR = "#F58518"
UNIFORM_COLOR = "#54A24B"
BASELINE_SYMBOLS = {"uniform": "square", "flap": "diamond", "owl": "triangle-up", "evo": "star"}
BYTES_PER_PARAM = 4  # the engine keeps weights in float32
SLIDER_STEPS = 101


def _kinds(table) -> list[str]:
    seen = []
    for _, kind in table.components:
        if kind not in seen:
            seen.append(kind)
    return seen


def sensitivity_figure(table, kinds=None, log_y: bool = False, smoothed: bool = True) -> go.Figure:
    """One line per layer (loss increase against rate), one panel per component kind."""
    kinds = [k for k in (kinds or _kinds(table)) if k in _kinds(table)] or _kinds(table)
    losses = table.losses(smoothed)
    rates = np.asarray(table.rate_grid, dtype=float)
    colors = sample_colorscale("Viridis", np.linspace(0, 1, max(2, table.num_layers)))
    fig = make_subplots(rows=1, cols=len(kinds), shared_yaxes=True, subplot_titles=[KIND_LABEL[k] for k in kinds])
    for col, kind in enumerate(kinds, start=1):
        for row, (layer, k) in enumerate(table.components):
            if k != kind:
                continue
            y = np.asarray(losses[row], dtype=float)
            # zeros and negative noise have no place on a log axis
            keep = y > 0 if log_y else np.ones_like(y, dtype=bool)
            x, y, removed = rates[keep], y[keep], np.asarray(table.removed[row])[keep]
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines+markers",
                    name=f"layer {layer}",
                    legendgroup=f"layer {layer}",
                    showlegend=col == 1,
                    line=dict(color=colors[layer], width=1.5),
                    marker=dict(size=4),
                    customdata=removed[:, None],
                    hovertemplate=f"layer {layer} {KIND_LABEL[kind]}<br>rate %{{x:.4g}}<br>loss increase %{{y:.6g}}"
                    "<br>removes %{customdata[0]:,} params<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="pruning rate", row=1, col=col)
    fig.update_yaxes(title_text=f"{table.spec.objective} increase" + (" (log)" if log_y else ""), type="log" if log_y else "linear", row=1, col=1)
    for col in range(2, len(kinds) + 1):
        fig.update_yaxes(type="log" if log_y else "linear", row=1, col=col)
    fig.update_layout(height=460, margin=dict(t=40, b=40), legend=dict(font=dict(size=10)), title_text=None)
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
    """Layers x rates, one heatmap per component kind; hover gives the exact numbers and how
    each cell was filled. When a table mixes measured and estimated cells (``refine``), a
    ring marks every measured one."""
    kinds = _kinds(table)
    losses = table.losses(smoothed)
    rates = [f"{r:.3g}" for r in table.rate_grid]
    notes = cell_notes(table)
    cutting = table.removed > 0
    marked = table.measured_cells() & cutting
    mixed = bool(marked.any()) and not bool(marked[cutting].all())
    fig = make_subplots(rows=1, cols=len(kinds), shared_yaxes=True, subplot_titles=[KIND_LABEL[k] for k in kinds])
    zmax = float(np.max(losses)) if losses.size else 1.0
    for col, kind in enumerate(kinds, start=1):
        rows = [r for r, (_, k) in enumerate(table.components) if k == kind]
        layers = [table.components[r][0] for r in rows]
        z = np.asarray(losses[rows], dtype=float)
        shown = np.log10(np.clip(z, 1e-6, None)) if log_color else z
        fig.add_trace(
            go.Heatmap(
                z=shown,
                x=rates,
                y=layers,
                customdata=np.stack([z, table.removed[rows]], axis=-1),
                text=notes[rows],
                coloraxis="coloraxis",
                hovertemplate=f"layer %{{y}} {KIND_LABEL[kind]}<br>rate %{{x}}<br>loss increase %{{customdata[0]:.6g}}"
                "<br>removes %{customdata[1]:,} params<br>%{text}<extra></extra>",
            ),
            row=1,
            col=col,
        )
        if mixed:
            cells = [(rates[r], table.components[c][0]) for c in rows for r in range(len(rates)) if marked[c, r]]
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in cells], y=[y for _, y in cells], mode="markers", name="measured exactly",
                    marker=dict(symbol="circle-open", size=7, color="#00B5E2", line=dict(width=2)),
                    showlegend=col == 1, hoverinfo="skip",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="pruning rate", row=1, col=col)
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=1)
    fig.update_layout(
        height=max(360, 16 * table.num_layers + 120),
        margin=dict(t=40, b=40),
        coloraxis=dict(
            colorscale="Magma",
            reversescale=True,
            cmin=None if log_color else 0.0,
            cmax=None if log_color else zmax,
            colorbar=dict(title="log10 Δ" if log_color else "Δ loss"),
        ),
    )
    return fig


BASIS_TEXT = {"measured": "sum of measured cells", "estimated": "sum of estimated cells", "mixed": "sum of measured and estimated cells"}


def step_title(budget: float, row: dict, dense_total: int, objective: str, basis: str | None = None) -> str:
    removed = int(row["removed"])
    pruned = dense_total - removed
    return (
        f"<b>Budget {budget:.1%}</b> of prunable params · removes {removed / 1e6:.2f}M "
        f"({removed / dense_total:.1%} of all) · {pruned / 1e6:.1f}M params left, "
        f"{pruned * BYTES_PER_PARAM / 2**20:.0f} MiB fp32 · predicted {objective} +{row['predicted_loss']:.4f}"
        + (f" ({BASIS_TEXT[basis]})" if basis else "")
    )


def row_basis(table, row: dict) -> str:
    """What a front row's prediction sums: "measured", "estimated" or "mixed" cells."""
    return table.basis(table.cells_for(row["attention_rates"], row["mlp_rates"]))


def planner_figure(
    table,
    front: list[dict],
    dense_total: int,
    active_budget: float = 0.2,
    locked: dict | None = None,
    baselines: list[dict] | None = None,
    steps: int = SLIDER_STEPS,
    measured: list[dict] | None = None,
) -> go.Figure:
    """Per-layer rates (bars) beside predicted loss vs budget, both driven by one Plotly slider.

    Every slider step is a zero-duration animation frame: it swaps the y values of the two
    bar traces, the uniform-rate line, the current-point marker and the readout line, in
    the browser. Frames with ``redraw: false`` change only those traces, where a
    ``method: "update"`` step replots the whole figure (measured about 2.5x slower, see
    bench/bench_app.py); the traces' data in the graph div is updated either way.

    Args:
        table: the LossTable.
        front: allocate.front_rows of the DP front (by increasing budget).
        dense_total: all parameters of the dense model (for the readouts).
        active_budget: where the slider starts.
        locked: layer -> locked rate, marked on the bars.
        baselines: rows of pipeline.baseline_rows (allocator, budget, removed_fraction, predicted_loss).
        steps: slider steps from 0 to the largest reachable budget.
        measured: runs of this table that were pruned and measured (id, allocator, budget,
            predicted_loss, actual_loss): drawn beside the predicted front.
    Returns:
        The figure, with ``frames`` (one per step, named ``b<i>``) and ``layout.sliders[0]``.
    """
    layers = list(range(table.num_layers))
    budgets, picks = front_at_budgets(front, steps)
    active = int(np.argmin(np.abs(budgets - active_budget))) if len(budgets) else 0
    curve = uniform_curve(table)
    objective = table.spec.objective

    def uniform_rate(b: float) -> float:
        return float(np.interp(b, curve["budget"], curve["rate"]))

    fig = make_subplots(
        rows=2,
        cols=2,
        column_widths=[0.6, 0.4],
        row_heights=[0.07, 0.93],
        horizontal_spacing=0.08,
        vertical_spacing=0.09,
        specs=[[{"colspan": 2}, None], [{}, {}]],
        subplot_titles=("", "Pruning rate per layer", f"{objective} increase vs budget: predicted (line), measured (x)"),
    )
    start = picks[active]
    b0 = float(budgets[active])
    fig.add_trace(
        go.Bar(x=layers, y=start["attention_rates"], name="attention (GAP DP)", marker_color=ATTN_COLOR,
               hovertemplate="layer %{x}<br>attention rate %{y:.3f}<extra></extra>"),
        row=2, col=1,
    )
    fig.add_trace(
        go.Bar(x=layers, y=start["mlp_rates"], name="MLP (GAP DP)", marker_color=MLP_COLOR,
               hovertemplate="layer %{x}<br>MLP rate %{y:.3f}<extra></extra>"),
        row=2, col=1,
    )
    fig.add_trace(
        go.Scatter(x=[-0.5, table.num_layers - 0.5], y=[uniform_rate(b0)] * 2, mode="lines", name="uniform, same budget",
                   line=dict(color=UNIFORM_COLOR, dash="dash", width=2),
                   hovertemplate="uniform rate %{y:.3f}<extra></extra>"),
        row=2, col=1,
    )
    readout_index = len(fig.data)
    fig.add_trace(
        go.Scatter(x=[0.0], y=[0.5], mode="text", text=[step_title(b0, start, dense_total, objective, row_basis(table, start))],
                   textposition="middle right", textfont=dict(size=13, color="#31333F"),
                   showlegend=False, hoverinfo="skip", cliponaxis=False),
        row=1, col=1,
    )
    if locked:
        fig.add_trace(
            go.Scatter(x=list(locked), y=[1.02] * len(locked), mode="markers", name="locked layer",
                       marker=dict(symbol="x", size=9, color="#666"),
                       customdata=[[v] for v in locked.values()],
                       hovertemplate="layer %{x} locked at rate %{customdata[0]:.3g}<extra></extra>"),
            row=2, col=1,
        )
    line_rows = front if len(front) <= 400 else [front[i] for i in np.unique(np.linspace(0, len(front) - 1, 400).round().astype(int))]
    fig.add_trace(
        go.Scatter(x=[r["budget"] * 100 for r in line_rows], y=[r["predicted_loss"] for r in line_rows], mode="lines",
                   name="GAP DP front", line=dict(color="#333", width=2),
                   hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.5f}<extra>DP</extra>"),
        row=2, col=2,
    )
    fig.add_trace(
        go.Scatter(x=curve["budget"] * 100, y=curve["loss"], mode="lines", name="uniform (table)",
                   line=dict(color=UNIFORM_COLOR, dash="dash"),
                   hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.5f}<extra>uniform</extra>"),
        row=2, col=2,
    )
    for allocator in sorted({row["allocator"] for row in baselines or [] if "error" not in row}):
        rows = [row for row in baselines if row["allocator"] == allocator and "error" not in row]
        fig.add_trace(
            go.Scatter(x=[r["removed_fraction"] * 100 for r in rows], y=[r["predicted_loss"] for r in rows],
                       mode="markers", name=f"{allocator} plan", marker=dict(size=9, symbol=BASELINE_SYMBOLS.get(allocator, "circle")),
                       hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.5f}<extra>" + allocator + "</extra>"),
            row=2, col=2,
        )
    for allocator in sorted({str(run["allocator"]) for run in measured or []}):
        runs = [run for run in measured if str(run["allocator"]) == allocator]
        fig.add_trace(
            go.Scatter(x=[run["budget"] * 100 for run in runs], y=[run["actual_loss"] for run in runs], mode="markers",
                       name=f"{allocator}: measured", marker=dict(size=10, symbol="x", color="#E45756" if allocator == "dp" else "#72B7B2"),
                       customdata=[[run["id"], run["predicted_loss"]] for run in runs],
                       hovertemplate="run %{customdata[0]}, budget %{x:.2f}%<br>measured +%{y:.5f}<br>predicted +%{customdata[1]:.5f}"
                       "<extra>" + allocator + " measured</extra>"),
            row=2, col=2,
        )
    marker_index = len(fig.data)
    fig.add_trace(
        go.Scatter(x=[start["budget"] * 100], y=[start["predicted_loss"]], mode="markers", name="current budget",
                   marker=dict(size=14, color="#E45756", line=dict(color="white", width=2)),
                   hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.5f}<extra>current</extra>"),
        row=2, col=2,
    )
    frames, slider_steps = [], []
    for i, (b, row) in enumerate(zip(budgets, picks)):
        u = uniform_rate(float(b))
        frames.append(
            go.Frame(
                name=f"b{i}",
                traces=[0, 1, 2, readout_index, marker_index],
                data=[
                    go.Bar(y=row["attention_rates"]),
                    go.Bar(y=row["mlp_rates"]),
                    go.Scatter(y=[u, u]),
                    go.Scatter(text=[step_title(float(b), row, dense_total, objective, row_basis(table, row))]),
                    go.Scatter(x=[row["budget"] * 100], y=[row["predicted_loss"]]),
                ],
            )
        )
        slider_steps.append(
            dict(
                method="animate",
                label=f"{b:.1%}",
                value=f"{b:.6f}",
                args=[[f"b{i}"], {"mode": "immediate", "frame": {"duration": 0, "redraw": False}, "transition": {"duration": 0}}],
            )
        )
    fig.frames = frames
    top_loss = max([r["predicted_loss"] for r in front] + [float(np.max(curve["loss"]))]) if front else 1.0
    top_loss = max([top_loss] + [float(run["actual_loss"]) for run in measured or []])
    fig.update_layout(
        template="plotly_white",
        barmode="group",
        bargap=0.15,
        height=560,
        margin=dict(t=20, b=40, l=60, r=20),
        legend=dict(orientation="h", y=-0.36, x=0.0),
        sliders=[
            dict(
                active=active,
                steps=slider_steps,
                currentvalue=dict(prefix="Budget: ", suffix=" of prunable parameters", font=dict(size=13, color="#31333F")),
                font=dict(size=1, color="rgba(0,0,0,0)"),  # 101 tick labels would overlap; the current value shows it
                tickcolor="rgba(0,0,0,0.25)",
                ticklen=3,
                minorticklen=0,
                pad=dict(t=45, b=10),
                len=1.0,
                x=0.0,
                transition=dict(duration=0),
            )
        ],
    )
    fig.update_xaxes(visible=False, range=[0, 1], fixedrange=True, row=1, col=1)
    fig.update_yaxes(visible=False, range=[0, 1], fixedrange=True, row=1, col=1)
    fig.update_xaxes(title_text="layer", range=[-0.6, table.num_layers - 0.4], dtick=max(1, table.num_layers // 15), row=2, col=1)
    fig.update_yaxes(title_text="rate (fraction removed)", range=[0, 1.06], row=2, col=1)
    top_budget = front[-1]["budget"] * 100 if front else 100.0
    fig.update_xaxes(title_text="budget (% of prunable parameters removed)", range=[0, max(1.0, top_budget) * 1.02], row=2, col=2)
    fig.update_yaxes(title_text=f"{objective} increase", range=[0, max(top_loss, 1e-6) * 1.05], row=2, col=2)
    return fig


def history_figure(frame, metric: str) -> go.Figure:
    """One point per run: budget against ``metric``, coloured by allocator, hover with the run id."""
    fig = go.Figure()
    for allocator, part in frame.groupby("allocator"):
        fig.add_trace(
            go.Scatter(
                x=part["budget"] * 100,
                y=part[metric],
                mode="markers+lines",
                name=str(allocator),
                marker=dict(size=10, symbol=BASELINE_SYMBOLS.get(str(allocator), "circle")),
                customdata=np.stack([part["id"], part["created"]], axis=-1),
                hovertemplate="run %{customdata[0]} (%{customdata[1]})<br>budget %{x:.1f}%<br>"
                + metric
                + " %{y:.5g}<extra>"
                + str(allocator)
                + "</extra>",
            )
        )
    fig.update_layout(
        height=380,
        margin=dict(t=30, b=40),
        xaxis_title="budget (% of prunable parameters)",
        yaxis_title=metric,
    )
    return fig


def predicted_vs_actual_figure(frame) -> go.Figure:
    """Predicted against measured calibration loss increase, one point per run."""
    part = frame.dropna(subset=["predicted_loss", "actual_loss"])
    fig = go.Figure()
    if len(part):
        top = float(max(part["predicted_loss"].max(), part["actual_loss"].max())) * 1.05
        fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="predicted = actual", line=dict(dash="dot", color="#999")))
    for allocator, rows in part.groupby("allocator"):
        fig.add_trace(
            go.Scatter(
                x=rows["predicted_loss"],
                y=rows["actual_loss"],
                mode="markers",
                name=str(allocator),
                marker=dict(size=10, symbol=BASELINE_SYMBOLS.get(str(allocator), "circle")),
                customdata=np.stack([rows["id"], rows["budget"] * 100], axis=-1),
                hovertemplate="run %{customdata[0]}, budget %{customdata[1]:.1f}%<br>predicted %{x:.5f}<br>actual %{y:.5f}<extra></extra>",
            )
        )
    fig.update_layout(height=380, margin=dict(t=30, b=40), xaxis_title="predicted loss increase (table)", yaxis_title="actual increase (calibration)")
    return fig
