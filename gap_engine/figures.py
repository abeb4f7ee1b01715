"""Plotly figures of the loss table, the DP front, the plans and the run history.

Pure drawing: the engine's numbers in, a ``plotly.graph_objects.Figure`` out; no streamlit,
so the app, the exported HTML/PNG files and the stakeholder report (`report`) draw the
same pictures. Every figure names its template (``plotly_white``): inside a Streamlit
process the default template is Streamlit's, whose placeholder colours only its own
front end resolves, so a PNG or HTML export of an untemplated figure comes out black.
Colour scales are explicit lists for the same reason (no ``reversescale`` for a theme to
drop).

Losses are in nats per token (mean next-token NLL, or mean KL to the dense model).
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.colors import sequential
from plotly.subplots import make_subplots

from .front_view import budget_steps, step_at_budget

TEMPLATE = "plotly_white"
KIND_LABEL = {"attn": "attention", "mlp": "MLP", "block": "block"}
ATTN_COLOR = "#4C78A8"
MLP_COLOR = "#F58518"
UNIFORM_COLOR = "#54A24B"
DP_COLOR = "#333333"
CURRENT_COLOR = "#E45756"
TEXT_COLOR = "#31333F"
BASELINE_SYMBOLS = {"uniform": "square", "flap": "diamond", "owl": "triangle-up", "evo": "star"}
BASELINE_COLORS = {"uniform": UNIFORM_COLOR, "flap": "#B279A2", "owl": "#9D755D", "evo": "#72B7B2"}
BYTES_PER_PARAM = 4  # the engine keeps weights in float32
SLIDER_STEPS = 101  # steps of an exported planner figure's own slider
DEPTH_SCALE = "Viridis"  # layer depth, shallow (dark) to deep (yellow)


def _off_placeholder(color: str) -> str:
    """Streamlit's front end rewrites the colours #000001..#0000ff (its theme placeholders)
    wherever they occur, even with ``theme=None``: Magma's darkest, #000004, became a light
    pink in the app while the PNG export drew it black. Nudge such colours off the range."""
    return "#010005" if color.lower().startswith("#0000") and len(color) == 7 else color


# High loss dark, as in a printed heat map; an explicit list, so no theme can flip it.
HEAT_SCALE = [[i / (len(sequential.Magma_r) - 1), _off_placeholder(c)] for i, c in enumerate(sequential.Magma_r)]
OBJECTIVE_NAME = {"nll": "NLL", "kl": "KL"}

# The run history's columns as a reader should see them (one place: table, charts, report).
RUN_COLUMN_LABELS = {
    "id": "run",
    "created": "when (UTC)",
    "model": "model",
    "table_key": "loss table",
    "method": "allocation",
    "budget": "budget (of prunable)",
    "dense_params": "dense parameters",
    "pruned_params": "parameters after",
    "predicted_loss": "predicted loss increase",
    "actual_loss": "measured loss increase",
    "prefill_speedup": "prefill speed vs dense",
    "decode_speedup": "decode speed vs dense",
    "checkpoint": "checkpoint",
    "seconds": "run time (s)",
    "note": "note",
}
_SOURCE_COLUMN_LABELS = {
    "ppl": "perplexity ({})",
    "dense_ppl": "dense perplexity ({})",
    "kl": "KL to dense ({})",
    "top1": "top-1 agreement ({})",
}


def column_label(name: str) -> str:
    """What a reader sees for a run-history column (``ppl:wiki-sample`` -> ``perplexity (wiki-sample)``)."""
    if name in RUN_COLUMN_LABELS:
        return RUN_COLUMN_LABELS[name]
    prefix, _, source = str(name).partition(":")
    if source and prefix in _SOURCE_COLUMN_LABELS:
        return _SOURCE_COLUMN_LABELS[prefix].format(source)
    return str(name)


def loss_label(objective: str, what: str = "increase") -> str:
    """Axis title of a loss: ``NLL increase (nats/token)``."""
    return f"{OBJECTIVE_NAME.get(objective, objective)} {what} (nats/token)"


def _kinds(table) -> list[str]:
    seen = []
    for _, kind in table.components:
        if kind not in seen:
            seen.append(kind)
    return seen


def _log_ticks(low: float, high: float) -> tuple[list[float], list[str]]:
    """One tick per decade between low and high (> 0), written as plain numbers."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    values = [10.0**e for e in range(first, last + 1)]
    return values, [f"{v:g}" for v in values]


# ---- the loss table -----------------------------------------------------------------------
def sensitivity_figure(table, kinds=None, log_y: bool = True, smoothed: bool = True) -> go.Figure:
    """One line per layer (loss increase against rate), one panel per component kind.

    Lines are coloured by depth with one colour bar (no legend of 2L entries); on the
    default log axis a few large curves no longer flatten the rest, and ticks are whole
    decades in plain numbers.
    """
    kinds = [k for k in (kinds or _kinds(table)) if k in _kinds(table)] or _kinds(table)
    losses = np.asarray(table.losses(smoothed), dtype=float)
    rates = np.asarray(table.rate_grid, dtype=float)
    n_layers = max(2, table.num_layers)
    colors = sample_colorscale(DEPTH_SCALE, np.linspace(0, 1, n_layers))
    fig = make_subplots(
        rows=1, cols=len(kinds), shared_yaxes=True, horizontal_spacing=0.04, subplot_titles=[KIND_LABEL[k] for k in kinds]
    )
    scale_shown = False
    for col, kind in enumerate(kinds, start=1):
        for row, (layer, k) in enumerate(table.components):
            if k != kind:
                continue
            y = losses[row]
            keep = y > 0 if log_y else np.ones_like(y, dtype=bool)  # zeros and noise have no place on a log axis
            x, y, removed = rates[keep], y[keep], np.asarray(table.removed[row])[keep]
            marker = dict(size=4, color=colors[layer])
            if not scale_shown and len(x):  # the one colour bar rides on the first drawn line's markers
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
                    name=f"layer {layer} {KIND_LABEL[kind]}",
                    showlegend=False,
                    line=dict(color=colors[layer], width=1.5),
                    marker=marker,
                    customdata=removed[:, None],
                    hovertemplate=f"layer {layer} {KIND_LABEL[kind]}<br>rate %{{x:.4g}}<br>+%{{y:.4g}} nats/token"
                    "<br>removes %{customdata[0]:,} params<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="pruning rate of the component", range=[-0.02, float(rates[-1]) + 0.02], row=1, col=col)
    y_title = loss_label(table.spec.objective)
    if log_y:
        shown = losses[np.isin([k for _, k in table.components], kinds)]
        positive = shown[shown > 0]
        low, high = (float(positive.min()), float(positive.max())) if positive.size else (1e-4, 1.0)
        tickvals, ticktext = _log_ticks(low, high)
        for col in range(1, len(kinds) + 1):
            fig.update_yaxes(
                type="log", tickvals=tickvals, ticktext=ticktext, range=[math.log10(low) - 0.1, math.log10(high) + 0.1], row=1, col=col
            )
    fig.update_yaxes(title_text=y_title + (", log scale" if log_y else ""), row=1, col=1)
    fig.update_layout(template=TEMPLATE, height=460, margin=dict(t=40, b=50, l=70, r=20), showlegend=False)
    return fig


def heatmap_figure(table, smoothed: bool = True, log_color: bool = False) -> go.Figure:
    """Layers x rates, one heatmap per component kind, darker = larger loss; hover gives the numbers."""
    kinds = _kinds(table)
    losses = np.asarray(table.losses(smoothed), dtype=float)
    rates = [f"{r:.3g}" for r in table.rate_grid]
    fig = make_subplots(
        rows=1, cols=len(kinds), shared_yaxes=True, horizontal_spacing=0.04, subplot_titles=[KIND_LABEL[k] for k in kinds]
    )
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
                coloraxis="coloraxis",
                hovertemplate=f"layer %{{y}} {KIND_LABEL[kind]}<br>rate %{{x}}<br>+%{{customdata[0]:.4g}} nats/token"
                "<br>removes %{customdata[1]:,} params<extra></extra>",
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


# ---- the DP front and one plan ---------------------------------------------------------------
def step_readout(row: dict, dense_total: int | None, objective: str) -> str:
    """One line for a front row: budget, parameters removed and left, predicted loss."""
    removed = int(row["removed"])
    text = f"<b>Budget {row['budget']:.2%}</b> of prunable params · removes {removed:,}"
    if dense_total:
        left = dense_total - removed
        text += f" ({removed / dense_total:.1%} of all) · {left / 1e6:.1f}M params left, {left * BYTES_PER_PARAM / 2**20:.0f} MiB fp32"
    return text + f" · predicted {OBJECTIVE_NAME.get(objective, objective)} +{row['predicted_loss']:.4f} nats/token"


def rate_traces(num_layers: int, row: dict, locked: dict | None = None) -> list:
    """Bars of one plan's per-layer rates, the uniform rate at its budget, and the locked layers.

    The first three traces are always: attention bars, MLP bars, uniform line (the budget
    chart and the exported slider restyle exactly these).
    """
    layers = list(range(num_layers))
    budget = float(row["budget"])
    method = row.get("method", "GAP DP")  # a front row is the DP's; a reported plan names its own
    traces = [
        go.Bar(
            x=layers,
            y=row[key],
            name=f"{part} ({method})",
            marker_color=color,
            legendgroup=part,
            hovertemplate=f"layer %{{x}}<br>{part} rate %{{y:.3f}}<extra></extra>",
        )
        for key, part, color in (("attention_rates", "attention", ATTN_COLOR), ("mlp_rates", "MLP", MLP_COLOR))
    ] + [
        go.Scatter(
            x=[-0.5, num_layers - 0.5],
            y=[budget, budget],
            mode="lines",
            name="uniform: every layer at the budget's rate",
            legendgroup="uniform",
            line=dict(color=UNIFORM_COLOR, dash="dash", width=2),
            hovertemplate="uniform rate %{y:.3f}<extra></extra>",
        ),
    ]
    if locked:
        traces.append(
            go.Scatter(
                x=[int(k) for k in locked],
                y=[1.02] * len(locked),
                mode="markers",
                name="locked layer",
                marker=dict(symbol="x", size=9, color="#666"),
                customdata=[[float(v)] for v in locked.values()],
                hovertemplate="layer %{x} locked at rate %{customdata[0]:.3g}<extra></extra>",
            )
        )
    return traces


def front_traces(front: list[dict], row: dict | None, uniform: list[dict] | None, baselines: list[dict] | None, y_top: float) -> list:
    """DP front, exact uniform plans, baseline plans and the current point, all in % of prunable.

    The current point (when ``row`` is given) is the last trace. Baseline plans above ``y_top`` are drawn
    at the top edge as open triangles (their hover gives the true value), so the axis fits
    the DP front.
    """
    thinned = front if len(front) <= 400 else [front[i] for i in budget_steps(front, 400)]
    traces = [
        go.Scatter(
            x=[r["budget"] * 100 for r in thinned],
            y=[r["predicted_loss"] for r in thinned],
            mode="lines",
            name="GAP DP front",
            line=dict(color=DP_COLOR, width=2),
            hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.4f}<extra>GAP DP</extra>",
        )
    ]
    if uniform:
        traces.append(
            go.Scatter(
                x=[r["removed_fraction"] * 100 for r in uniform],
                y=[r["predicted_loss"] for r in uniform],
                mode="lines",
                name="uniform: every layer at the budget's rate",
                legendgroup="uniform",
                showlegend=False,  # one legend entry for uniform: the bars' dashed line
                line=dict(color=UNIFORM_COLOR, dash="dash", width=2),
                hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.4f}<extra>uniform plan</extra>",
            )
        )
    for method in sorted({b["method"] for b in baselines or [] if "error" not in b}):
        points = [b for b in baselines if b["method"] == method and "error" not in b]
        inside = [b for b in points if b["predicted_loss"] <= y_top]
        above = [b for b in points if b["predicted_loss"] > y_top]
        color = BASELINE_COLORS.get(method, "#888")
        if inside:
            traces.append(
                go.Scatter(
                    x=[b["removed_fraction"] * 100 for b in inside],
                    y=[b["predicted_loss"] for b in inside],
                    mode="markers",
                    name=f"{method} plan",
                    legendgroup=method,
                    marker=dict(size=9, symbol=BASELINE_SYMBOLS.get(method, "circle"), color=color, line=dict(color="white", width=1)),
                    hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.4f}<extra>" + method + "</extra>",
                )
            )
        if above:
            traces.append(
                go.Scatter(
                    x=[b["removed_fraction"] * 100 for b in above],
                    y=[y_top] * len(above),
                    mode="markers",
                    name=f"{method} plan (above the axis)",
                    legendgroup=method,
                    showlegend=not inside,
                    cliponaxis=False,
                    marker=dict(size=10, symbol="triangle-up-open", color=color, line=dict(width=2)),
                    customdata=[[b["predicted_loss"]] for b in above],
                    hovertemplate="budget %{x:.2f}%<br>predicted +%{customdata[0]:.4f} (above the axis)<extra>" + method + "</extra>",
                )
            )
    if row is None:
        return traces
    traces.append(
        go.Scatter(
            x=[row["budget"] * 100],
            y=[row["predicted_loss"]],
            mode="markers",
            name="chosen budget",
            marker=dict(size=14, color=CURRENT_COLOR, line=dict(color="white", width=2)),
            hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.4f}<extra>chosen</extra>",
        )
    )
    return traces


def front_y_top(front: list[dict]) -> float:
    """Top of the loss axis: the DP front fills the panel (baselines above it clip)."""
    return max([r["predicted_loss"] for r in front] + [1e-6]) * 1.08


def rates_figure(table, row: dict, locked: dict | None = None, height: int = 340) -> go.Figure:
    """The per-layer rates of one front row (the budget chart's left panel)."""
    fig = go.Figure(rate_traces(table.num_layers, row, locked))
    fig.update_layout(
        template=TEMPLATE,
        barmode="group",
        bargap=0.15,
        height=height,
        margin=dict(t=10, b=45, l=55, r=10),
        showlegend=False,  # the chart's own legend is HTML (it wraps on a phone)
        xaxis=dict(title_text="layer", range=[-0.6, table.num_layers - 0.4], fixedrange=True),
        yaxis=dict(title_text="rate (fraction removed)", range=[0, 1.06], fixedrange=True),
    )
    return fig


def front_figure(table, front: list[dict], row: dict | None = None, uniform=None, baselines=None, height: int = 340) -> go.Figure:
    """Predicted loss against budget, with ``row`` marked when given (the budget chart's right
    panel, which draws its moving point itself)."""
    y_top = front_y_top(front)
    fig = go.Figure(front_traces(front, row, uniform, baselines, y_top))
    top_budget = front[-1]["budget"] * 100 if front else 100.0
    fig.update_layout(
        template=TEMPLATE,
        height=height,
        margin=dict(t=10, b=45, l=60, r=10),
        showlegend=False,
        xaxis=dict(title_text="budget (% of prunable removed)", range=[-max(1.0, top_budget) * 0.03, max(1.0, top_budget) * 1.02]),
        yaxis=dict(title_text=loss_label(table.spec.objective), range=[0, y_top]),
    )
    return fig


def planner_figure(
    table,
    front: list[dict],
    dense_total: int | None,
    active_budget: float = 0.2,
    locked: dict | None = None,
    baselines: list[dict] | None = None,
    steps: int = SLIDER_STEPS,
    uniform: list[dict] | None = None,
) -> go.Figure:
    """Per-layer rates beside predicted loss vs budget, with Plotly's own slider (for files).

    The exported and reported planner: every slider step is a front row, labelled with the
    row's own budget, and is a zero-duration animation frame that swaps the bars, the
    uniform line, the readout and the current point in the browser (no server).

    Args:
        table: the LossTable.
        front: allocation.front_rows of the DP front (by increasing budget).
        dense_total: all parameters of the dense model (readouts), or None.
        active_budget: the chosen budget; the step of the first row removing at least it is shown.
        locked: layer -> locked rate, marked on the bars.
        baselines: rows of jobs.baselines_task (method, budget, removed_fraction, predicted_loss).
        steps: the most slider steps (rows are thinned evenly in budget).
        uniform: rows of front_view.uniform_line (the exact uniform plans), or None.
    Returns:
        The figure, with ``frames`` (one per step, named ``s<i>``) and ``layout.sliders[0]``.
    """
    objective = table.spec.objective
    fig = make_subplots(
        rows=2,
        cols=2,
        column_widths=[0.58, 0.42],
        row_heights=[0.08, 0.92],
        horizontal_spacing=0.09,
        vertical_spacing=0.1,
        specs=[[{"colspan": 2}, None], [{}, {}]],
        subplot_titles=("", "Pruning rate per layer", f"Predicted {OBJECTIVE_NAME.get(objective, objective)} increase vs budget"),
    )
    if not front:
        fig.update_layout(template=TEMPLATE, height=560)
        return fig
    picks = budget_steps(front, max(2, steps))
    active = step_at_budget(front, picks, active_budget)
    row = front[picks[active]]
    for trace in rate_traces(table.num_layers, row, locked):
        fig.add_trace(trace, row=2, col=1)
    readout_index = len(fig.data)
    fig.add_trace(
        go.Scatter(
            x=[0.0],
            y=[0.5],
            mode="text",
            text=[step_readout(row, dense_total, objective)],
            textposition="middle right",
            textfont=dict(size=14, color=TEXT_COLOR),
            showlegend=False,
            hoverinfo="skip",
            cliponaxis=False,
        ),
        row=1,
        col=1,
    )
    y_top = front_y_top(front)
    for trace in front_traces(front, row, uniform, baselines, y_top):
        fig.add_trace(trace, row=2, col=2)
    marker_index = len(fig.data) - 1
    frames, slider_steps = [], []
    for i, index in enumerate(picks):
        step = front[index]
        b = float(step["budget"])
        frames.append(
            go.Frame(
                name=f"s{i}",
                traces=[0, 1, 2, readout_index, marker_index],
                data=[
                    go.Bar(y=step["attention_rates"]),
                    go.Bar(y=step["mlp_rates"]),
                    go.Scatter(y=[b, b]),
                    go.Scatter(text=[step_readout(step, dense_total, objective)]),
                    go.Scatter(x=[b * 100], y=[step["predicted_loss"]]),
                ],
            )
        )
        slider_steps.append(
            dict(
                method="animate",
                label=f"{b:.2%}",
                value=f"{b:.6f}",
                args=[[f"s{i}"], {"mode": "immediate", "frame": {"duration": 0, "redraw": False}, "transition": {"duration": 0}}],
            )
        )
    fig.frames = frames
    fig.update_layout(
        template=TEMPLATE,
        barmode="group",
        bargap=0.15,
        height=600,
        margin=dict(t=50, b=40, l=60, r=20),  # the top margin keeps the modebar off the readout
        legend=dict(orientation="h", y=-0.3, x=0.0),
        sliders=[
            dict(
                active=active,
                steps=slider_steps,
                currentvalue=dict(prefix="Budget: ", suffix=" of prunable parameters", font=dict(size=13, color=TEXT_COLOR)),
                font=dict(size=1, color="rgba(0,0,0,0)"),  # a label per step would overlap; the current value shows it
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
    fig.update_xaxes(title_text="layer", range=[-0.6, table.num_layers - 0.4], row=2, col=1)
    fig.update_yaxes(title_text="rate (fraction removed)", range=[0, 1.06], row=2, col=1)
    top_budget = front[-1]["budget"] * 100
    fig.update_xaxes(title_text="budget (% of prunable parameters removed)", range=[-max(1.0, top_budget) * 0.03, max(1.0, top_budget) * 1.02], row=2, col=2)
    fig.update_yaxes(title_text=loss_label(objective), range=[0, y_top], row=2, col=2)
    return fig


def plan_figure(
    table,
    front: list[dict],
    row: dict,
    dense_total: int | None = None,
    locked: dict | None = None,
    uniform: list[dict] | None = None,
    baselines: list[dict] | None = None,
) -> go.Figure:
    """One plan beside the DP front: its per-layer rates, and its point on loss-vs-budget (static).

    ``row`` is a front row or any plan in the same shape (``budget`` = removed fraction of
    prunable, ``removed``, ``predicted_loss`` (None: no point), ``attention_rates``,
    ``mlp_rates``): a plan that is not the DP's shows where it sits against the front.
    """
    objective = table.spec.objective
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.58, 0.42],
        horizontal_spacing=0.1,
        subplot_titles=("Pruning rate per layer", f"Predicted {OBJECTIVE_NAME.get(objective, objective)} increase vs budget"),
    )
    for trace in rate_traces(table.num_layers, row, locked):
        fig.add_trace(trace, row=1, col=1)
    y_top = front_y_top(front + ([row] if row.get("predicted_loss") is not None else []))
    for trace in front_traces(front, row, uniform, baselines, y_top):
        fig.add_trace(trace, row=1, col=2)
    fig.update_layout(
        template=TEMPLATE,
        barmode="group",
        bargap=0.15,
        height=470,
        title=dict(text=step_readout(row, dense_total, objective) if row.get("predicted_loss") is not None else None, font=dict(size=13)),
        margin=dict(t=80, b=40, l=60, r=20),
        legend=dict(orientation="h", y=-0.2, x=0.0),
    )
    fig.update_xaxes(title_text="layer", range=[-0.6, table.num_layers - 0.4], row=1, col=1)
    fig.update_yaxes(title_text="rate (fraction removed)", range=[0, 1.06], row=1, col=1)
    top_budget = max([r["budget"] for r in front] + [row["budget"]]) * 100
    fig.update_xaxes(title_text="budget (% of prunable parameters removed)", range=[-max(1.0, top_budget) * 0.03, max(1.0, top_budget) * 1.02], row=1, col=2)
    fig.update_yaxes(title_text=loss_label(objective), range=[0, y_top], row=1, col=2)
    return fig


# ---- the run history ------------------------------------------------------------------------
def history_figure(frame, metric: str) -> go.Figure:
    """One point per run: budget against ``metric``, coloured by allocation, hover with the run id."""
    fig = go.Figure()
    for method, part in frame.groupby("method"):
        part = part.sort_values("budget")
        fig.add_trace(
            go.Scatter(
                x=part["budget"] * 100,
                y=part[metric],
                mode="markers+lines",
                name=str(method),
                marker=dict(size=10, symbol=BASELINE_SYMBOLS.get(str(method), "circle"), color=BASELINE_COLORS.get(str(method))),
                customdata=np.stack([part["id"], part["created"]], axis=-1),
                hovertemplate="run %{customdata[0]} (%{customdata[1]})<br>budget %{x:.1f}%<br>"
                + column_label(metric)
                + " %{y:.5g}<extra>"
                + str(method)
                + "</extra>",
            )
        )
    fig.update_layout(
        template=TEMPLATE,
        height=380,
        margin=dict(t=30, b=50, l=60, r=20),
        xaxis_title="budget (% of prunable parameters removed)",
        yaxis_title=column_label(metric),
        legend=dict(title=dict(text="allocation")),
    )
    return fig


def predicted_vs_actual_figure(frame) -> go.Figure:
    """Predicted against measured calibration loss increase, one point per run."""
    part = frame.dropna(subset=["predicted_loss", "actual_loss"])
    fig = go.Figure()
    if len(part):
        top = float(max(part["predicted_loss"].max(), part["actual_loss"].max())) * 1.05
        fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="predicted = measured", line=dict(dash="dot", color="#999")))
    for method, rows in part.groupby("method"):
        fig.add_trace(
            go.Scatter(
                x=rows["predicted_loss"],
                y=rows["actual_loss"],
                mode="markers",
                name=str(method),
                marker=dict(size=10, symbol=BASELINE_SYMBOLS.get(str(method), "circle"), color=BASELINE_COLORS.get(str(method))),
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
