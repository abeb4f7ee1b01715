"""The front as the app and the report show it (front_view) and the figures drawn from it.

On a tiny real loss table of SmolLM2-135M (news-sample, 2 windows of 16 tokens, taylor,
rates 0 / 0.25 / 0.5 / 0.75): slider steps are front rows, a step's plan is its row to the
parameter, the uniform line is made of the uniform baseline's own plans, and the figures
carry what a reader needs (units, one colour bar, no duplicate legend entries, axes that
fit the DP front, colours no theme rewrites).
"""

from __future__ import annotations

import numpy as np
import pytest

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import BudgetError, PlanError
from gap_engine.model.units import block_geometries
from gap_engine.pipeline.runs import BaselinePlan
from gap_engine.pipeline.stages import loss_table as build_table
from gap_engine.plan.allocators import plan_from_table
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.front_view import (
    budget_steps,
    front_row_at,
    grid_indices,
    grid_shares,
    net_removed_fraction,
    removed_shares,
    row_plan,
    step_at_budget,
    uniform_line,
)
from gap_engine.plan.problem import Constraints, charged_counts
from gap_engine.tables.artefact import TableSpec
from gap_engine.views import figures

pytestmark = pytest.mark.slow  # the real built-in model

TINY_SPEC = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", rate_grid=(0.0, 0.25, 0.5, 0.75))


@pytest.fixture(scope="module")
def table(smol):
    return build_table(smol, TINY_SPEC, use_cache=False)


@pytest.fixture(scope="module")
def front(table):
    return front_rows(table, dp_front(table))


# ---- steps -------------------------------------------------------------------------------------
def test_steps_are_front_rows_spread_evenly_in_budget(front):
    assert budget_steps(front, max_steps=len(front)) == list(range(len(front)))
    steps = budget_steps(front, max_steps=50)
    assert steps[0] == 0 and steps[-1] == len(front) - 1
    assert all(a < b for a, b in zip(steps, steps[1:])) and len(steps) <= 50
    budgets = np.array([front[i]["budget"] for i in steps])
    gaps = np.diff(budgets)
    assert gaps.max() < 3 * (budgets[-1] - budgets[0]) / 49  # no hole bigger than a few even steps
    with pytest.raises(BudgetError):
        budget_steps(front, max_steps=1)


def test_a_rows_own_budget_finds_that_row(front):
    steps = budget_steps(front, max_steps=80)
    for position, index in enumerate(steps):
        assert step_at_budget(front, steps, front[index]["budget"]) == position
    assert step_at_budget(front, steps, 0.999) == len(steps) - 1
    # a budget between steps: the first step that removes at least it
    position = step_at_budget(front, steps, 0.2)
    assert front[steps[position]]["budget"] >= 0.2 > front[steps[position - 1]]["budget"]


def test_row_plan_removes_exactly_the_rows_parameters(smol, table, front):
    for row in front[:: max(1, len(front) // 25)] + [front[-1]]:
        plan = row_plan(smol, table, row)
        assert plan.allocator == "dp" and plan.table_key == table.key
        assert plan.params["removed"] == row["removed"]
        assert plan.budget == row["budget"] and plan.predicted_loss == row["predicted_loss"]
        assert plan.attention_rates == row["attention_rates"] and plan.mlp_rates == row["mlp_rates"]
        plan.check_model(smol)


def test_a_charged_fronts_rows_are_the_plans_with_their_biases(smol, table):
    """A front charged for bias compensation: each row says how many biases the cut adds, its
    ``removed`` is net of them, and its plan leaves exactly ``dense - removed`` parameters with them."""
    counts = charged_counts(smol, "bias")
    charged = front_rows(table, dp_front(table, biases=counts), counts)
    plain = front_rows(table, dp_front(table))
    assert plain[-1]["bias_params"] == 0 and charged[-1]["bias_params"] > 0
    hidden = smol.model.config.hidden_size
    for row in charged[:: max(1, len(charged) // 12)] + [charged[-1]]:
        plan = row_plan(smol, table, row, "bias")
        params = plan.params
        assert plan.compensation == "bias"
        assert params["bias_params"] == row["bias_params"] and row["bias_params"] % hidden == 0
        assert params["removed"] - params["bias_params"] == row["removed"]
        assert params["pruned_total_with_biases"] == params["dense_total"] - row["removed"]
        assert net_removed_fraction(plan) == pytest.approx(row["budget"])
    with pytest.raises(PlanError, match="net of biases"):
        row_plan(smol, table, plain[len(plain) // 2] | {"removed": plain[len(plain) // 2]["removed"] + 1}, "bias")


def test_removed_shares_are_what_the_rates_really_cut(smol, table):
    """SmolLM2 keeps whole KV groups of 3 query heads: a rate rounds to a group, so attention
    rate 0.625 removes two of three groups (2/3 of the attention) and 0.125 removes none."""
    counts = block_geometries(smol)
    layers = smol.num_layers
    shares = removed_shares(counts, [0.625] * layers, [0.5] * layers, table.spec.channel_multiple)
    assert shares.attention == pytest.approx([2 / 3] * layers)
    assert "keeps 3 of 9 query heads (1 of 3 KV groups)" in shares.attention_text[0]
    assert "rate asked 0.625" in shares.attention_text[0]
    none = removed_shares(counts, [0.125] * layers, [0.0] * layers, table.spec.channel_multiple)
    assert none.attention == [0.0] * layers and none.mlp == [0.0] * layers
    block = counts[0]
    assert shares.mlp[0] == block.removed_at("mlp", 0.5, table.spec.channel_multiple) / block.params_at(
        "mlp", 0.0, table.spec.channel_multiple
    )
    grid = grid_shares(smol, table)  # one per grid rate: what the browser looks a row's bars up in
    assert len(grid) == len(table.rate_grid) and grid[0].attention == [0.0] * layers
    assert grid[2].attention == removed_shares(counts, [0.5] * layers, [0.5] * layers, table.spec.channel_multiple).attention


def test_replanning_at_a_rows_budget_is_not_the_row(smol, table, front):
    """Why the page plans from the row: re-solving at its budget picks another optimum for some rows."""
    differ = 0
    for row in front[:: max(1, len(front) // 30)]:
        replanned = plan_from_table(smol, table, row["budget"], "dp")
        differ += (replanned.attention_rates, replanned.mlp_rates) != (row["attention_rates"], row["mlp_rates"])
    assert differ > 0


def test_grid_indices_map_rates_and_refuse_off_grid_ones(table, front):
    row = front[len(front) // 2]
    indices = grid_indices(table.rate_grid, row["attention_rates"])
    assert [float(table.rate_grid[i]) for i in indices] == row["attention_rates"]
    with pytest.raises(PlanError, match="not on the table's grid"):
        grid_indices(table.rate_grid, [0.3])


def test_uniform_line_is_the_uniform_baselines_own_plans(smol, table, front):
    constraints = Constraints(locked={0: 0.0})
    line = uniform_line(smol, table, constraints, front[-1]["budget"], step=0.1, extra=(0.225,))
    assert [r["removed_fraction"] for r in line] == sorted(r["removed_fraction"] for r in line)
    by_budget = {r["budget"]: r for r in line}
    assert 0.225 in by_budget and 0.3 in by_budget
    for budget in (0.225, 0.3):
        plan = plan_from_table(smol, table, budget, "uniform", constraints)
        assert plan.attention_rates[0] == plan.mlp_rates[0] == 0.0
        assert by_budget[budget]["predicted_loss"] == pytest.approx(plan.predicted_loss)
        assert by_budget[budget]["removed_fraction"] == pytest.approx(plan.params["removed_fraction_of_prunable"])


# ---- figures -----------------------------------------------------------------------------------
def _colors(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [c for v in value for c in _colors(v)]
    if isinstance(value, dict):
        return [c for v in value.values() for c in _colors(v)]
    return []


def test_sensitivity_reads_at_a_glance(table):
    fig = figures.sensitivity_figure(table)
    lines = [t for t in fig.data if t.type == "scatter"]
    assert len(lines) == 60 and not any(t.showlegend for t in lines)
    scales = [t for t in lines if t.marker.showscale]
    assert len(scales) == 1 and scales[0].marker.colorbar.title.text == "layer"
    assert [a.text for a in fig.layout.annotations] == ["attention", "MLP"]  # apart, one panel each
    assert fig.layout.yaxis.type == "log" and "nats/token" in fig.layout.yaxis.title.text
    ticks = list(fig.layout.yaxis.tickvals)
    assert all(np.isclose(np.log10(v), round(np.log10(v))) for v in ticks)  # whole decades only
    assert list(fig.layout.yaxis.ticktext) == [f"{v:g}" for v in ticks]
    assert fig.layout.template.layout.paper_bgcolor == "white"
    linear = figures.sensitivity_figure(table, log_y=False)
    assert linear.layout.yaxis.type in (None, "linear")


def test_the_layers_to_compare_are_the_most_and_least_sensitive(table):
    middle = len(table.rate_grid) // 2
    per_layer = np.zeros(table.num_layers)
    for row, (layer, _) in enumerate(table.components):
        per_layer[layer] += table.smoothed[row, middle]
    picked = figures.layers_to_compare(table)
    ranked = list(np.argsort(-per_layer, kind="stable"))
    assert picked == sorted(ranked[:2] + ranked[-2:])
    fig = figures.sensitivity_figure(table, layers=picked)
    lines = [t for t in fig.data if t.type == "scatter"]
    assert len(lines) == 2 * len(picked) and {t.name for t in lines} == {f"layer {layer}" for layer in picked}
    assert [t.name for t in lines if t.showlegend] == [f"layer {layer}" for layer in picked]  # named once, attention panel
    assert fig.layout.showlegend and not any(t.marker.showscale for t in lines)


def test_heatmap_colours_are_explicit_and_no_theme_placeholder(table):
    fig = figures.heatmap_figure(table)
    scale = fig.layout.coloraxis.colorscale
    assert not fig.layout.coloraxis.reversescale
    assert scale[0][1] == "#fcfdbf" and scale[-1][1] == "#010005"  # low light, high (almost) black
    placeholders = [c for c in _colors(fig.to_plotly_json()) if c.lower().startswith("#0000") and len(c) == 7]
    assert placeholders == []


def test_planner_figure_steps_are_rows_with_one_legend_entry_each(smol, table, front):
    baselines = [
        BaselinePlan("uniform", 0.3, removed_fraction=0.3, predicted_loss=50.0),  # far above the front
        BaselinePlan("flap", 0.2, removed_fraction=0.2, predicted_loss=front[0]["predicted_loss"]),
        BaselinePlan("owl", 0.9, error="beyond reach"),  # drawn nowhere
    ]
    uniform = uniform_line(smol, table, Constraints(), front[-1]["budget"], step=0.1)
    fig = figures.planner_figure(table, front, smol.param_count(), active_budget=0.2, baselines=baselines, uniform=uniform)
    slider = fig.layout.sliders[0]
    frames = {f.name: f for f in fig.frames}
    picks = sorted(set(budget_steps(front, figures.SLIDER_STEPS)) | {front.index(front_row_at(front, 0.2))})
    assert len(slider.steps) == len(picks)
    for step, index in zip(slider.steps, picks):
        row = front[index]
        assert step.label == f"{row['budget']:.2%}"  # the label is the row's own budget
        readout = frames[step.args[0][0]].data[3].text[0]
        assert f"removes {row['removed']:,}" in readout and f"+{row['predicted_loss']:.4f}" in readout
    active = front[picks[slider.active]]
    assert active["budget"] >= 0.2 and step_at_budget(front, picks, 0.2) == slider.active
    shown = [t.name for t in fig.data if t.showlegend is not False and t.name]
    assert len(shown) == len(set(shown)), shown
    assert sum(name.startswith("uniform:") for name in shown) == 1  # the bars' line and the plans' line share it
    top = fig.layout.yaxis3.range[1]
    assert top == pytest.approx(max(r["predicted_loss"] for r in front) * 1.08)  # the DP front fills the panel
    clipped = [t for t in fig.data if t.name == "uniform plan (above the axis)"]
    assert len(clipped) == 1 and list(clipped[0].y) == [top] and clipped[0].customdata[0][0] == 50.0
    assert not [t.name for t in fig.data if t.name and t.name.startswith("owl")]  # a budget out of reach is drawn nowhere


def test_baseline_plans_keep_the_columns_of_their_rows():
    planned = BaselinePlan("uniform", 0.2, removed_fraction=0.2001, predicted_loss=1.5, attention_rates=[0.1], mlp_rates=[0.3])
    assert planned.planned and planned.to_dict() == {
        "allocator": "uniform",
        "budget": 0.2,
        "removed_fraction": 0.2001,
        "predicted_loss": 1.5,
        "attention_rates": [0.1],
        "mlp_rates": [0.3],
    }
    out_of_reach = BaselinePlan("owl", 0.9, error="budget 90% is beyond reach")
    assert not out_of_reach.planned and out_of_reach.to_dict() == {"allocator": "owl", "budget": 0.9, "error": "budget 90% is beyond reach"}


def test_an_exported_planner_opens_at_the_released_budget_itself(smol, table, front):
    """The file shows the app's budget, not the nearest of its thinned steps."""
    thinned = set(budget_steps(front, figures.SLIDER_STEPS))
    off_grid = [i for i in range(1, len(front) - 1) if i not in thinned]
    assert off_grid, "the tiny front must have more rows than the exported slider's steps"
    for index in (off_grid[0], off_grid[len(off_grid) // 2], off_grid[-1]):
        row = front[index]
        fig = figures.planner_figure(table, front, smol.param_count(), active_budget=row["budget"], title="Released plan abc")
        slider = fig.layout.sliders[0]
        assert slider.steps[slider.active].label == f"{row['budget']:.2%}"
        assert f"removes {row['removed']:,}" in fig.data[3].text[0]  # the readout the file opens with
    assert fig.layout.title.text == "Released plan abc"


def test_history_names_are_for_people():
    assert figures.column_label("ppl:wiki-sample") == "perplexity (wiki-sample)"
    assert figures.column_label("kl:news-sample") == "held-out KL to dense (news-sample)"
    assert figures.column_label("prefill_speedup") == "prefill speed vs dense"
    assert figures.column_label("something_new") == "something_new"
    import pandas as pd

    frame = pd.DataFrame(
        {"id": [1, 2], "created": ["a", "b"], "allocator": ["dp", "uniform"], "budget": [0.2, 0.2], "ppl:wiki-sample": [20.0, 25.0]}
    )
    fig = figures.history_figure(frame, "ppl:wiki-sample")
    assert fig.layout.yaxis.title.text == "perplexity (wiki-sample)"
    assert "ppl:" not in fig.data[0].hovertemplate
