"""The session's planner state: its constraints, the front they give, and the released plan."""

from __future__ import annotations

import json

import streamlit as st

from explorer.session_keys import PLAN_OWN, SHARED_DEFAULTS
from explorer.table_state import reference_model
from gap_engine.core.config import DEFAULT_COMPENSATION
from gap_engine.core.errors import GapError
from gap_engine.pipeline.jobs import shared_model
from gap_engine.plan.allocators import counted_compensation
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.problem import Constraints, charged_counts
from gap_engine.plan.step import plan_criterion
from gap_engine.prune.criteria import is_sequential


def release_plan(plan, raw_constraints: dict) -> str:
    """Make ``plan`` the released plan every page uses, stored by its hash; returns the hash.

    A cache that cannot be written leaves the plan usable in this session (a reload then
    says it cannot restore it).
    """
    from gap_engine.plan import store as planstore

    try:
        digest = planstore.put_plan(plan, raw_constraints)
    except GapError:
        digest = plan.content_hash()
    st.session_state["app_plan"] = plan.to_dict()
    st.session_state["app_plan_hash"] = digest
    st.session_state["app_plan_missing"] = None
    return digest


def release_current_plan(table):
    """Release the plan the planner shows for this session's budget and constraints, when the
    planner was not opened in this session (a page opened directly): the same front row the
    budget chart starts at (`front_view.budget_steps`, `step_at_budget`) and the same
    `row_plan`, so it is the planner's plan, not a re-solve. Returns the RatePlan.

    Raises:
        GapError: the model cannot be loaded, or no plan satisfies the constraints.
    """
    from gap_engine.plan.front_view import budget_steps, row_plan, step_at_budget

    raw = st.session_state.get("app_constraints") or SHARED_DEFAULTS["app_constraints"]
    rows = session_front(table, raw)
    steps = budget_steps(rows)
    row = rows[steps[step_at_budget(rows, steps, float(st.session_state["app_budget"]))]]
    plan = row_plan(reference_model(table.model), table, row, plan_compensation(table))
    st.session_state["app_budget"] = float(row["budget"])
    release_plan(plan, raw)
    return plan


def constraints_from_state() -> Constraints:
    """The planner's constraints of this session."""
    return Constraints.from_dict(st.session_state.get("app_constraints"))


def constraints_json(raw: dict) -> str:
    """A canonical text of a constraints dict (a cache key)."""
    return json.dumps(raw, sort_keys=True)


def plan_compensation(table) -> str | None:
    """The compensation the planner's plans are counted for: the session's (``app_compensation``),
    as the DP's runs apply it; None where it adds nothing to count (``none``), so such plans are
    the uncharged plans they always were. A run whose criterion updates the kept columns itself
    (``obs``: the DP's step on Llama, or picked) applies none (``evaluate.run_compensation``), so
    nothing is charged."""
    picked, compensation = st.session_state.get("eval_criterion"), str(st.session_state.get("app_compensation") or DEFAULT_COMPENSATION)
    if is_sequential(str(picked) if picked and picked != PLAN_OWN else plan_criterion("dp", table, compensation)):
        return None
    counted = counted_compensation("dp", table, compensation)
    return None if counted in (None, "none") else counted


def session_front(table, raw: dict | None = None) -> list[dict]:
    """The planner's front for ``table`` under ``raw`` constraints (the session's when None),
    charged for the biases of the session's compensation (`plan_compensation`)."""
    raw = raw if raw is not None else (st.session_state.get("app_constraints") or SHARED_DEFAULTS["app_constraints"])
    return pareto_rows(table.key, constraints_json(raw), plan_compensation(table) or "none", table)


@st.cache_data(max_entries=32, show_spinner=False)
def pareto_rows(table_key: str, constraints_text: str, compensation: str, _table) -> list[dict]:
    """front.front_rows of the DP front for one table, constraints and compensation (cached per
    process): a compensation that adds biases has them paid from every budget, and each row
    says how many (``bias_params``).

    Raises:
        GapError: the model cannot be loaded (the biases need its geometry), or bad constraints.
    """
    counts = charged_counts(shared_model(_table.model), compensation) if compensation != "none" else None
    return front_rows(_table, dp_front(_table, Constraints.from_dict(json.loads(constraints_text)), biases=counts), counts)
