"""The one budget, through AppTest: the budget chart's data, a release, and every page after it.

The chart's JavaScript runs only in a browser (tests/browser/test_browser.py drags it); here the
Python half is checked: what the chart is given (the front rows, the start at the app's
budget), what a release does (the hand-off the component's callback makes, under
``budget_chart.RELEASE_KEY``), and that Prune & evaluate and Export then use exactly the
released row. Same tiny real table and fresh cache as tests/explorer/test_app.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from app_fixtures import cached_table, fresh_cache, job_of, plotly_specs, start, texts, tiny_eval, tiny_table  # noqa: F401

from explorer import budget_chart
from gap_engine.evaluate import history
from gap_engine.model.rateplan import RatePlan
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.problem import Constraints, charged_counts
from gap_engine.plan.step import plan_criterion
from gap_engine.prune.compensations import default_for

pytestmark = pytest.mark.slow  # the real built-in model behind every page


def app_mode(table) -> str:
    """The compensation the planner's runs apply by default: none after the DP's step on SmolLM2 (OBS)."""
    return default_for(plan_criterion("dp", table)).mode


def app_front(table, lm) -> list[dict]:
    """The planner's front: charged for the biases of the default compensation, as the runs apply it."""
    counts = charged_counts(lm, app_mode(table))
    return front_rows(table, dp_front(table, biases=counts), counts)


def chart(at) -> dict:
    """The data the budget chart was mounted with."""
    found = [e.proto for e in at.get("bidi_component") if e.proto.component_name == "gap_budget_chart"]
    assert len(found) == 1
    return json.loads(found[0].json)


def metric(at, label: str) -> str:
    return next(str(m.value) for m in at.metric if m.label.startswith(label))


def release(at, data: dict, step: int, **override) -> None:
    """What the component's release callback leaves for the next run (see budget_chart)."""
    payload = {
        "front_id": data["front_id"],
        "step": step,
        "row": data["rows"][step],
        "removed": data["removed"][step],
        "budget": data["budgets"][step],
    } | override
    at.session_state[budget_chart.RELEASE_KEY] = payload
    at.run()
    assert not at.exception, [e.value for e in at.exception]


def test_the_chart_carries_the_front_rows_and_starts_at_the_apps_budget(cached_table, smol):
    at = start("explorer/planner.py")
    data = chart(at)
    front = app_front(cached_table, smol)
    steps = data["rows"]
    assert steps == list(range(len(front)))  # a small front: every row is a step
    assert data["budgets"] == [r["budget"] for r in front]
    assert data["removed"] == [r["removed"] for r in front]
    assert app_mode(cached_table) == "none" and data["bias"] == [r["bias_params"] for r in front] == [0] * len(front)
    grid = data["grid"]
    for i in (0, len(steps) // 2, len(steps) - 1):
        assert [grid[k] for k in data["attn"][i]] == front[steps[i]]["attention_rates"]
        assert [grid[k] for k in data["mlp"][i]] == front[steps[i]]["mlp_rates"]
    active = front[steps[data["active"]]]
    assert active["budget"] >= 0.2 > front[steps[data["active"] - 1]]["budget"]  # the first row removing 20%
    # Readouts, plan and budget are that row, to the parameter.
    assert at.session_state["app_budget"] == active["budget"]
    plan = RatePlan.from_dict(dict(at.session_state["app_plan"]))
    plan.check_model(smol)
    assert plan.params["removed"] == active["removed"] + active["bias_params"] and plan.attention_rates == active["attention_rates"]
    assert metric(at, "Removed parameters") == f"{plan.params['removed']:,}"  # what the cut removes
    left = plan.params["dense_total"] - active["removed"]  # the pruned model's (OBS, SmolLM2's DP step, adds no bias)
    assert left == plan.params["pruned_total"] and metric(at, "Parameters left") == f"{left:,}"
    assert active["bias_params"] == 0 and not any("bias parameters" in t for t in texts(at.caption))
    assert metric(at, "Predicted") == f"+{active['predicted_loss']:.4f}"
    # The figures the browser starts from; legends are HTML there (they wrap on a phone).
    front_fig = json.loads(data["front_figure"])
    assert not front_fig["layout"]["showlegend"]
    assert "chosen budget" not in [t.get("name") for t in front_fig["data"]]  # the browser draws the moving point
    assert front_fig["layout"]["yaxis"]["range"][1] == pytest.approx(max(r["predicted_loss"] for r in front) * 1.08)
    labels = [item["label"] for item in data["legend"]]
    assert len(labels) == len(set(labels)) and sum(label.startswith("uniform") for label in labels) == 1
    # plotly.js comes from the installed package, through the constant loader component.
    loader = [e.proto for e in at.get("bidi_component") if e.proto.component_name == "gap_plotly_js"]
    assert len(loader) == 1 and "plotly.js v" in loader[0].js_content and "window.Plotly" in loader[0].js_content
    assert not plotly_specs(at)  # no separate Plotly chart and no second budget slider
    assert not at.slider


def test_a_release_sets_the_one_budget_every_page_uses(cached_table, smol):
    at = start("explorer/planner.py")
    data = chart(at)
    step = int(np.searchsorted(data["budgets"], 0.4))
    before = at.session_state["app_budget"]
    release(at, data, step, front_id="another table|{}")  # a stale release is ignored
    assert at.session_state["app_budget"] == before
    release(at, data, step, removed=data["removed"][step] + 1)  # and so is one that names another row
    assert at.session_state["app_budget"] == before

    release(at, data, step)
    budget, removed = data["budgets"][step], data["removed"][step] + data["bias"][step]  # the cut, the biases' share with it
    assert at.session_state["app_budget"] == budget
    assert chart(at)["active"] == step  # the chart starts where it was released
    assert metric(at, "Removed parameters") == f"{removed:,}"
    plan = RatePlan.from_dict(dict(at.session_state["app_plan"]))
    assert plan.params["removed"] == removed and plan.budget == budget

    at.switch_page("explorer/evaluate.py")
    at.run()
    assert metric(at, "Budget from the planner") == f"{budget:.2%}"
    assert any(f"removes {removed:,} parameters" in t for t in texts(at.caption))

    at.switch_page("explorer/export.py")
    at.run()
    assert not at.exception
    assert at.selectbox(key="export_plan_source").value == "planner"
    assert f"dp at {budget:.2%}" in at.selectbox(key="export_plan_source").format_func("planner")
    buttons = {b.proto.label: b.proto for b in at.get("download_button")}
    assert "Download report (HTML)" in buttons and not buttons["Download report (HTML)"].disabled
    # A download never reruns the page: a rerun re-registers every file built on click, and a
    # second click in the meantime (the report right after the plan) asked for one just dropped.
    assert all(b.ignore_rerun for b in buttons.values()), [label for label, b in buttons.items() if not b.ignore_rerun]


@pytest.mark.heavy
def test_locks_hold_in_every_step(cached_table):
    at = start("explorer/planner.py")
    at.multiselect(key="planner_locked").set_value([0, 29]).run()
    assert at.session_state["app_constraints"]["locked"] == {"0": 0.0, "29": 0.0}
    data = chart(at)
    zero = data["grid"].index(0.0)
    assert all(a[0] == m[0] == a[29] == m[29] == zero for a, m in zip(data["attn"], data["mlp"]))
    assert "locked layer" in [item["label"] for item in data["legend"]]
    plan = at.session_state["app_plan"]
    assert plan["attention_rates"][0] == plan["mlp_rates"][29] == 0.0
    # Locking every layer leaves no budget to choose: a warning, no crash.
    at.multiselect(key="planner_locked").set_value(list(range(30))).run()
    assert not at.exception
    assert any("unlock layers" in t for t in texts(at.warning))


@pytest.mark.heavy
def test_baseline_markers_lie_on_the_uniform_line(cached_table):
    at = start("explorer/planner.py")
    at.multiselect(key="planner_baseline_allocators").set_value(["uniform"]).run()
    at.button(key="planner_compute_baselines").click().run()
    job = job_of(at, "baselines")
    assert job.wait(240), job.snapshot()
    at.run()
    assert job.status == "done", job.error
    front = json.loads(chart(at)["front_figure"])
    traces = {t.get("name"): t for t in front["data"]}
    markers = [t for name, t in traces.items() if name and name.startswith("uniform plan")]
    assert markers, list(traces)
    line = next(t for name, t in traces.items() if name and name.startswith("uniform:"))
    points = set(zip(np.round(line["x"], 9), np.round(line["y"], 9)))
    for trace in markers:
        for x, y, extra in zip(trace["x"], trace["y"], trace.get("customdata") or [None] * len(trace["x"])):
            y = extra[0] if extra else y  # a clipped marker carries its true value
            assert (round(x, 9), round(y, 9)) in points
    assert "uniform plan" in [item["label"] for item in chart(at)["legend"]]
    assert not at.exception


def test_sensitivity_is_readable_by_default_and_drawn_as_exported(cached_table):
    at = start("explorer/sensitivity.py")
    charts = at.get("plotly_chart")
    assert [c.proto.theme for c in charts] == ["", ""]  # theme=None: the figure's own colours, as in a PNG
    heatmap, curves = (json.loads(c.proto.spec) for c in charts)  # the heatmap leads
    assert curves["layout"]["yaxis"]["type"] == "log" and "nats/token" in curves["layout"]["yaxis"]["title"]["text"]
    assert not any(t.get("marker", {}).get("showscale") for t in curves["data"])  # a few picked layers: a legend, no colour bar
    assert sum(1 for t in curves["data"] if t.get("showlegend")) == 4  # each picked layer named once
    assert heatmap["layout"]["coloraxis"]["colorscale"][-1][1] == "#010005"


@pytest.mark.heavy  # the browser test drags, releases and evaluates the same way
def test_evaluate_prunes_the_released_row_and_shows_it_readably(cached_table, smol):
    at = start("explorer/planner.py")
    data = chart(at)
    step = int(np.searchsorted(data["budgets"], 0.35))
    release(at, data, step)
    row_removed = data["removed"][step]
    at.switch_page("explorer/evaluate.py")
    at.run()
    tiny_eval(at)
    at.button(key="eval_run").click().run()
    job = job_of(at, "prune_eval")
    assert job.wait(400), job.snapshot()
    at.run()
    assert job.status == "done", job.error
    result = at.session_state["app_last_run"]
    # Pruned exactly the released row; the default bias compensation adds a bias to each o_proj and down_proj that lost inputs.
    added = (result.compensation or {}).get("bias_params", 0)
    assert (added > 0) == ("bias" in str((result.compensation or {}).get("mode", "")))
    assert result.params_before - result.params_after == row_removed  # the row's removal is net of the biases
    assert result.plan["attention_rates"] == at.session_state["app_plan"]["attention_rates"]
    assert result.plan["budget"] == data["budgets"][step]
    # People's names in the history table; generations in a table that wraps.
    tables = [list(d.value.columns) for d in at.dataframe]
    columns = next(c for c in tables if "run" in c)  # the history table
    assert "perplexity (news-sample)" in columns and "allocator" in columns
    assert not any(c.startswith(("ppl:", "kl:")) for c in columns)
    assert len(at.table) == 1 and list(at.table[0].value.columns) == ["prompt", "dense", "pruned"]
    assert at.selectbox(key="eval_metric").format_func(at.selectbox(key="eval_metric").value) == "perplexity (news-sample)"
    assert history.list_runs()["budget"].tolist() == [data["budgets"][step]]


def test_release_of_checks_front_row_and_count(cached_table):
    front = front_rows(cached_table, dp_front(cached_table, Constraints()))
    good = {"front_id": "f", "row": 5, "removed": front[5]["removed"]}
    assert budget_chart.release_of(front, "f", good) is front[5]
    for bad in (None, "x", good | {"front_id": "g"}, good | {"row": len(front)}, good | {"row": True}, good | {"removed": 1}):
        assert budget_chart.release_of(front, "f", bad) is None


def release_payload(data: dict, step: int) -> dict:
    return {
        "front_id": data["front_id"],
        "step": step,
        "row": data["rows"][step],
        "removed": data["removed"][step],
        "budget": data["budgets"][step],
    }


def test_a_release_whose_rerun_shows_another_page_is_the_plan_that_page_prunes(cached_table, smol):
    """A release whose rerun is a page switch (the user clicked Prune & evaluate right after the
    keys stopped; or the planner's run was interrupted by the switch) is applied before that page
    draws: its budget and plan, together, not the plan before it."""
    at = start("explorer/planner.py")
    data = chart(at)
    step = data["active"] + 3
    at.session_state[budget_chart.RELEASE_KEY] = release_payload(data, step)
    at.switch_page("explorer/evaluate.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    budget, removed = data["budgets"][step], data["removed"][step] + data["bias"][step]
    assert at.session_state["app_budget"] == budget
    plan = RatePlan.from_dict(dict(at.session_state["app_plan"]))
    assert plan.budget == budget and plan.params["removed"] == removed
    assert at.session_state["app_plan_hash"] == plan.content_hash()
    assert metric(at, "Budget from the planner") == f"{budget:.2%}"
    assert any(f"The planner's DP plan `{plan.content_hash()}`: removes {removed:,} parameters" in t for t in texts(at.caption))
    assert at.query_params["plan"] == plan.content_hash() and float(at.query_params["budget"]) == budget


def test_prune_and_evaluate_waits_when_the_sessions_plan_moved_after_the_page_was_drawn(cached_table, smol):
    """Start carries the plan the page showed; when the session's plan moved after the page was
    drawn (a release applied by a run that a newer one interrupted before it drew), nothing starts,
    the page says so and shows the new plan, and the next press prunes that one."""
    from gap_engine.plan.front_view import row_plan

    at = start("explorer/planner.py")
    data = chart(at)
    at.switch_page("explorer/evaluate.py")
    at.run()
    tiny_eval(at)
    at.run()
    shown = at.session_state["app_plan_hash"]
    assert any(f"The planner's DP plan `{shown}`" in t for t in texts(at.caption))
    front = app_front(cached_table, smol)
    moved = row_plan(smol, cached_table, front[data["rows"][data["active"] + 5]], None)  # counted for no bias, as the page
    at.session_state["app_plan"], at.session_state["app_plan_hash"] = moved.to_dict(), moved.content_hash()
    at.session_state["app_budget"] = moved.budget
    at.button(key="eval_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "prune_eval" not in at.session_state["app_jobs"]  # nothing pruned: not the plan shown, not the one it left
    (said,) = [t for t in texts(at.warning) if "nothing was started" in t]
    assert f"changed to `{moved.content_hash()}`" in said and f"showed `{shown}`" in said
    assert any(f"The planner's DP plan `{moved.content_hash()}`" in t for t in texts(at.caption))  # shown now
    at.button(key="eval_run").click().run()
    job = job_of(at, "prune_eval")
    assert job.params["plan_hash"] == moved.content_hash() and f"plan {moved.content_hash()}" in job.label
    assert f"Running: {job.label}" in [h.value for h in at.subheader]  # the panel names the run being pruned, not an older one
    job.cancel()


def test_prune_and_evaluate_waits_for_a_budget_the_keeper_hands_over_with_the_click(cached_table, smol):
    """The slider's step reaches Prune & evaluate through the keeper (the planner was left before the
    keys were sent) in the same message as a click on Start: the button's callback runs before the
    keeper's, so the page it was pressed on showed the plan before; nothing starts, the page says so
    and shows the slider's plan, and the next press prunes that one."""
    at = start("explorer/planner.py")
    data = chart(at)
    at.switch_page("explorer/evaluate.py")
    at.run()
    tiny_eval(at)
    at.run()
    before = at.session_state["app_plan_hash"]
    step = data["active"] + 4
    entry = release_payload(data, step) | {"id": "k1"}
    at.session_state[budget_chart.KEEPER_KEY] = {"unsaved": entry}  # the keeper's state in the click's message
    at.session_state[budget_chart.RELEASE_KEY] = entry  # what its callback hands over after the button's
    at.button(key="eval_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "prune_eval" not in at.session_state["app_jobs"]
    (said,) = [t for t in texts(at.warning) if "nothing was started" in t]
    assert f"({data['budgets'][step]:.2%}) was still reaching this page" in said
    slider_plan = at.session_state["app_plan_hash"]
    assert slider_plan != before and at.session_state["app_budget"] == data["budgets"][step]
    assert any(f"The planner's DP plan `{slider_plan}`" in t for t in texts(at.caption))
    at.session_state[budget_chart.KEPT_KEY] = "k1"  # its callback ran in that run
    at.button(key="eval_run").click().run()
    job = job_of(at, "prune_eval")
    assert job.params["plan_hash"] == slider_plan and job.params["budget"] == data["budgets"][step]
    job.cancel()
