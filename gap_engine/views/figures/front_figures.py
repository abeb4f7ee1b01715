"""Figures of the DP front and of one plan: per-layer rate bars beside predicted loss against budget."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from gap_engine.model.units import ComponentGeometry
from gap_engine.plan.front_view import RemovedShares, budget_steps, removed_shares, step_at_budget
from gap_engine.views.figures.style import (
    ATTN_COLOR,
    BYTES_PER_PARAM,
    CURRENT_COLOR,
    DP_COLOR,
    MLP_COLOR,
    OBJECTIVE_NAME,
    SLIDER_STEPS,
    TEMPLATE,
    TEXT_COLOR,
    UNIFORM_COLOR,
    allocator_style,
    loss_label,
)

if TYPE_CHECKING:
    from gap_engine.pipeline.runs import BaselinePlan

BASIS_TEXT = {"measured": "sum of measured cells", "estimated": "sum of estimated cells", "mixed": "measured + estimated cells"}


def row_basis(table, row: dict) -> str:
    """What a front row's prediction sums: "measured", "estimated" or "mixed" cells."""
    return table.basis(table.cells_for(row["attention_rates"], row["mlp_rates"]))


def step_readout(row: dict, dense_total: int | None, objective: str, basis: str | None = None) -> str:
    """One line for a front row: budget, parameters removed and left, predicted loss (and,
    given ``basis``, whether that prediction sums measured or estimated cells).

    A row charged for bias compensation (``bias_params``) removes ``removed`` net of its biases:
    the line says what the cut removes, the biases it adds, and what is left with them.
    """
    removed = int(row["removed"])
    biases = int(row.get("bias_params") or 0)
    text = f"<b>Budget {row['budget']:.2%}</b> of prunable params · removes {removed + biases:,}"
    if biases:
        text += f", adds {biases:,} bias params"
    if dense_total:
        left = dense_total - removed
        text += f" ({removed / dense_total:.1%} of all, net) · {left:,} params left, {left * BYTES_PER_PARAM / 2**20:.0f} MiB fp32"
    text += f" · predicted {OBJECTIVE_NAME.get(objective, objective)} {row['predicted_loss']:+.4f} nats/token"
    return text + (f" ({BASIS_TEXT[basis]})" if basis else "")


def measured_traces(runs: list[dict] | None) -> list:
    """Pruned and measured runs of a table (``id``, ``allocator``, ``budget``,
    ``predicted_loss``, ``actual_loss``) as x marks on the loss-vs-budget panel: the
    measured loss beside the front's prediction."""
    traces = []
    runs = runs or []
    for allocator in sorted({str(run["allocator"]) for run in runs}):
        points = [run for run in runs if str(run["allocator"]) == allocator]
        traces.append(
            go.Scatter(
                x=[run["budget"] * 100 for run in points],
                y=[run["actual_loss"] for run in points],
                mode="markers",
                name=f"{allocator}: measured",
                marker=dict(size=10, symbol="x", color=allocator_style(allocator)[1]),
                customdata=[[run["id"], run["predicted_loss"]] for run in points],
                hovertemplate="run %{customdata[0]}, budget %{x:.2f}%<br>measured +%{y:.4f}<br>predicted +%{customdata[1]:.4f}"
                "<extra>" + allocator + " measured</extra>",
            )
        )
    return traces


SHARE_AXIS = "share removed"  # the bars' axis when they show what is really cut
RATE_AXIS = "rate asked"  # the bars' axis when only the rates are known


def rate_traces(num_layers: int, row: dict, locked: dict | None = None, shares: RemovedShares | None = None) -> list:
    """Bars of one plan's per-layer rates, the uniform rate at its budget, and the locked layers.

    With ``shares`` (`front_view.removed_shares` of the row's rates) the bars are what the rates
    really remove (attention rounds to whole GQA shapes: rate 0.125 may remove nothing) and the
    hover says which heads, groups and channels stay; without, the rates as asked.

    The first three traces are always: attention bars, MLP bars, uniform line (the budget
    chart and the exported slider restyle exactly these).
    """
    layers = list(range(num_layers))
    budget = float(row["budget"])
    source = row.get("label", "GAP DP")  # a front row is the DP's; a reported plan names its own
    parts = (("attention_rates", "attention", ATTN_COLOR), ("mlp_rates", "MLP", MLP_COLOR))
    if shares is not None:
        traces = [
            go.Bar(
                x=layers,
                y=values,
                name=f"{part} removed ({source})",
                marker_color=color,
                legendgroup=part,
                customdata=texts,
                hovertemplate="layer %{x}: %{customdata}<extra></extra>",
            )
            for values, texts, part, color in (
                (shares.attention, shares.attention_text, "attention", ATTN_COLOR),
                (shares.mlp, shares.mlp_text, "MLP", MLP_COLOR),
            )
        ]
    else:
        traces = [
            go.Bar(
                x=layers,
                y=row[key],
                name=f"{part} rate ({source})",
                marker_color=color,
                legendgroup=part,
                hovertemplate=f"layer %{{x}}<br>{part} rate asked %{{y:.3f}}<extra></extra>",
            )
            for key, part, color in parts
        ]
    traces += [
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


def front_traces(
    front: list[dict], row: dict | None, uniform: list[dict] | None, baselines: list[BaselinePlan] | None, y_top: float
) -> list:
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
    baselines = baselines or []
    for allocator in sorted({b.allocator for b in baselines if b.planned}):
        # (removed fraction, predicted loss) of every budget the allocator reached (only those have both)
        planned = [
            (b.removed_fraction, b.predicted_loss)
            for b in baselines
            if b.allocator == allocator and b.removed_fraction is not None and b.predicted_loss is not None
        ]
        inside = [(removed, loss) for removed, loss in planned if loss <= y_top]
        above = [(removed, loss) for removed, loss in planned if loss > y_top]
        symbol, color = allocator_style(allocator)
        if inside:
            traces.append(
                go.Scatter(
                    x=[removed * 100 for removed, _ in inside],
                    y=[loss for _, loss in inside],
                    mode="markers",
                    name=f"{allocator} plan",
                    legendgroup=allocator,
                    marker=dict(size=9, symbol=symbol, color=color, line=dict(color="white", width=1)),
                    hovertemplate="budget %{x:.2f}%<br>predicted +%{y:.4f}<extra>" + allocator + "</extra>",
                )
            )
        if above:
            traces.append(
                go.Scatter(
                    x=[removed * 100 for removed, _ in above],
                    y=[y_top] * len(above),
                    mode="markers",
                    name=f"{allocator} plan (above the axis)",
                    legendgroup=allocator,
                    showlegend=not inside,
                    cliponaxis=False,
                    marker=dict(size=10, symbol="triangle-up-open", color=color, line=dict(width=2)),
                    customdata=[[loss] for _, loss in above],
                    hovertemplate="budget %{x:.2f}%<br>predicted +%{customdata[0]:.4f} (above the axis)<extra>" + allocator + "</extra>",
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


def _shares(table, counts: Sequence[ComponentGeometry] | None, row: dict) -> RemovedShares | None:
    """What ``row``'s rates really remove on ``counts``'s blocks (None without them)."""
    if counts is None:
        return None
    return removed_shares(counts, row["attention_rates"], row["mlp_rates"], table.spec.channel_multiple)


def rates_figure(table, row: dict, locked: dict | None = None, height: int = 340, shares: RemovedShares | None = None) -> go.Figure:
    """The per-layer rates of one front row (the budget chart's left panel): what they really
    remove when ``shares`` is given (`rate_traces`)."""
    fig = go.Figure(rate_traces(table.num_layers, row, locked, shares))
    fig.update_layout(
        template=TEMPLATE,
        barmode="group",
        bargap=0.15,
        height=height,
        margin=dict(t=10, b=45, l=55, r=10),
        showlegend=False,  # the chart's own legend is HTML (it wraps on a phone)
        xaxis=dict(title_text="layer", range=[-0.6, table.num_layers - 0.4], fixedrange=True),
        yaxis=dict(title_text=SHARE_AXIS if shares is not None else RATE_AXIS, range=[0, 1.06], fixedrange=True),
    )
    return fig


def front_figure(
    table, front: list[dict], row: dict | None = None, uniform=None, baselines=None, height: int = 340, measured=None
) -> go.Figure:
    """Predicted loss against budget, with ``row`` marked when given (the budget chart's right
    panel, which draws its moving point itself); ``measured`` runs (`measured_traces`) are
    drawn as x marks beside the prediction."""
    y_top = max([front_y_top(front)] + [float(run["actual_loss"]) * 1.08 for run in measured or []])
    fig = go.Figure(front_traces(front, row, uniform, baselines, y_top) + measured_traces(measured))
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
    baselines: list[BaselinePlan] | None = None,
    steps: int = SLIDER_STEPS,
    uniform: list[dict] | None = None,
    title: str | None = None,
    counts: Sequence[ComponentGeometry] | None = None,
) -> go.Figure:
    """Per-layer rates beside predicted loss vs budget, with Plotly's own slider (for files).

    The exported and reported planner: every slider step is a front row, labelled with the
    row's own budget, and is a zero-duration animation frame that swaps the bars, the
    uniform line, the readout and the current point in the browser (no server).

    Args:
        table: the LossTable.
        front: front.front_rows of the DP front (by increasing budget).
        dense_total: all parameters of the dense model (readouts), or None.
        active_budget: the chosen budget; the first row removing at least it is shown, and is
            always a step of its own (thinning never moves the file to a neighbouring budget).
        locked: layer -> locked rate, marked on the bars.
        baselines: pipeline.baseline_rows' plans (allocator, budget, removed_fraction, predicted_loss).
        steps: the most slider steps (rows are thinned evenly in budget).
        uniform: rows of front_view.uniform_line (the exact uniform plans), or None.
        title: a line above the chart (the released plan's hash and budget, say), or None.
        counts: the model's blocks (``units.block_geometries``): the bars then show what each
            rate really removes (`rate_traces`); None: the rates as asked.
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
    chosen = step_at_budget(front, list(range(len(front))), active_budget)
    picks = sorted(set(budget_steps(front, max(2, steps))) | {chosen})
    active = picks.index(chosen)
    row = front[picks[active]]
    for trace in rate_traces(table.num_layers, row, locked, _shares(table, counts, row)):
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
        shares = _shares(table, counts, step)
        bars = (
            [go.Bar(y=step["attention_rates"]), go.Bar(y=step["mlp_rates"])]
            if shares is None
            else [go.Bar(y=shares.attention, customdata=shares.attention_text), go.Bar(y=shares.mlp, customdata=shares.mlp_text)]
        )
        frames.append(
            go.Frame(
                name=f"s{i}",
                traces=[0, 1, 2, readout_index, marker_index],
                data=[
                    *bars,
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
        margin=dict(t=80 if title else 50, b=40, l=60, r=20),  # the top margin keeps the modebar off the readout
        title=dict(text=title, font=dict(size=13), x=0.0, xanchor="left") if title else None,
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
    fig.update_yaxes(title_text=SHARE_AXIS if counts is not None else RATE_AXIS, range=[0, 1.06], row=2, col=1)
    top_budget = front[-1]["budget"] * 100
    fig.update_xaxes(
        title_text="budget (% of prunable parameters removed)",
        range=[-max(1.0, top_budget) * 0.03, max(1.0, top_budget) * 1.02],
        row=2,
        col=2,
    )
    fig.update_yaxes(title_text=loss_label(objective), range=[0, y_top], row=2, col=2)
    return fig


def plan_figure(
    table,
    front: list[dict],
    row: dict,
    dense_total: int | None = None,
    locked: dict | None = None,
    uniform: list[dict] | None = None,
    baselines: list[BaselinePlan] | None = None,
    counts: Sequence[ComponentGeometry] | None = None,
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
    for trace in rate_traces(table.num_layers, row, locked, _shares(table, counts, row)):
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
    fig.update_yaxes(title_text=SHARE_AXIS if counts is not None else RATE_AXIS, range=[0, 1.06], row=1, col=1)
    top_budget = max([r["budget"] for r in front] + [row["budget"]]) * 100
    fig.update_xaxes(
        title_text="budget (% of prunable parameters removed)",
        range=[-max(1.0, top_budget) * 0.03, max(1.0, top_budget) * 1.02],
        row=1,
        col=2,
    )
    fig.update_yaxes(title_text=loss_label(objective), range=[0, y_top], row=1, col=2)
    return fig
