"""What the Export page hands out beyond plain files: the planner figure and the stakeholder report.

Both draw the exact uniform line (`front_view.uniform_line`, cached per table and
constraints by the budget chart) and the baselines computed on the planner, so a file
shows what the app showed.
"""

from __future__ import annotations

import json

import streamlit as st

from explorer import budget_chart
from explorer.plan_state import session_front
from explorer.session_keys import SHARED_DEFAULTS
from explorer.table_state import reference_model
from gap_engine.core.config import DEFAULT_BUDGET
from gap_engine.core.errors import GapError, one_line
from gap_engine.evaluate import history
from gap_engine.model.rateplan import RatePlan, plan_hash
from gap_engine.model.units import block_geometries
from gap_engine.plan.problem import Constraints
from gap_engine.views import report
from gap_engine.views.figures.front_figures import planner_figure


def _baselines(table, raw: dict):
    stored = st.session_state.get("app_baselines")
    prefix = budget_chart.front_id_of(table, raw) + "|"  # computed for this front: its constraints and compensation
    return stored["rows"] if stored and stored.get("key", "").startswith(prefix) else None


def planner_export_figure(table):
    """The planner figure at the app's budget, with its own slider, for HTML/PNG files.

    Raises:
        GapError: the model cannot be loaded or does not fit the table.
    """
    lm = reference_model(table.model)
    table.check_model(lm)
    raw = st.session_state.get("app_constraints") or SHARED_DEFAULTS["app_constraints"]
    rows = session_front(table, raw)
    baselines = _baselines(table, raw)
    uniform = budget_chart.uniform_rows(table, lm, raw, rows[-1]["budget"], baselines) if rows else None
    budget = float(st.session_state.get("app_budget") or DEFAULT_BUDGET)
    digest = st.session_state.get("app_plan_hash")
    return planner_figure(
        table,
        rows,
        dense_total=lm.param_count(),
        active_budget=budget,
        locked={int(k): v for k, v in raw["locked"].items()},
        baselines=baselines,
        uniform=uniform,
        title=f"Released plan {digest}: budget {budget:.2%} of prunable parameters" if digest else None,
        counts=block_geometries(lm),
    )


def report_html(table, plan_dict: dict, run_id: int | None) -> str:
    """The stakeholder report of ``plan_dict`` (and of run ``run_id``'s numbers when given).

    Raises:
        GapError: a plan or run for another table or model, or an unloadable model.
    """
    plan = RatePlan.from_dict(dict(plan_dict))
    report.check_plan(table, plan)
    lm = reference_model(table.model)
    table.check_model(lm)
    session = Constraints.from_dict(st.session_state.get("app_constraints") or SHARED_DEFAULTS["app_constraints"])
    where = (f"run {run_id}" if run_id is not None else "the Budget planner's plan") + f", plan {plan.content_hash()}"
    inputs = report.report_inputs(plan, run_id, constraints=session, plan_name="the plan chosen for this report")
    plan, evaluation, constraints = inputs.plan, inputs.evaluation, inputs.constraints
    # the planner's constraints dict (its cache key), from the constraints the report uses
    raw = {
        "locked": {str(k): float(v) for k, v in dict(constraints.locked).items()},
        "max_rate": constraints.max_rate,
        "coupled": constraints.coupled,
    }
    rows = session_front(table, raw)
    baselines = _baselines(table, raw)
    uniform = budget_chart.uniform_rows(table, lm, raw, rows[-1]["budget"], baselines) if rows else None
    return report.build_report(
        table,
        plan,
        evaluation,
        constraints=constraints,
        uniform=uniform,
        baselines=baselines,
        dense_total=lm.param_count(),
        source=f"Downloaded from the GAP explorer's Export page ({where}); constraints {json.dumps(raw, sort_keys=True)}.",
        front=rows,
        counts=block_geometries(lm),
        story=inputs.story,
    )


def run_of_plan(plan_dict: dict) -> int | None:
    """The newest run that pruned exactly this plan (same table and rates), if any: its numbers
    belong in the plan's report."""
    try:
        records = history.runs()
    except GapError:
        return None
    try:
        wanted = plan_hash(plan_dict)
    except GapError:
        wanted = None
    for record in records[::-1]:
        if wanted is not None and (record.params or {}).get("plan_hash") == wanted:
            return record.id
    for record in records[::-1]:  # runs recorded before plans had a hash
        plan = record.plan or {}
        if (plan.get("table_key"), plan.get("attention_rates"), plan.get("mlp_rates")) == (
            plan_dict.get("table_key"),
            plan_dict.get("attention_rates"),
            plan_dict.get("mlp_rates"),
        ):
            return record.id
    return None


def report_problem(table, plan_dict: dict) -> str | None:
    """Why no report can be made for this plan and table (None: it can)."""
    if table is None:
        return "Load a loss table on Setup first: the report draws it."
    try:
        report.check_plan(table, RatePlan.from_dict(dict(plan_dict)))
    except GapError as exc:
        return f"No report for this plan with the current table: {one_line(exc)}."
    return None
