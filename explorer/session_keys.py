"""The session-state conventions every page follows.

Each page owns the keys with its prefix (``setup_``, ``sens_``, ``planner_``, ``eval_``,
``export_``, ``recover_``) and initialises them behind a guard with `init_page`. What pages
hand to each other lives under ``app_``:

    app_table        the current LossTable (Setup puts it there)
    app_model        the model name the table was built for
    app_budget       the budget chosen on the planner (fraction of prunable parameters)
    app_constraints  the planner's constraints as a dict (locked, max_rate, coupled)
    app_compensation the compensation after the cut the runs apply (a COMPENSATIONS name), one
                     selector drawn on the planner and on Prune & evaluate: the planner's front
                     pays for the biases it adds, so its parameter counts are the run's
    app_plan         the dp plan at the chosen budget (RatePlan dict): the plan the planner released
    app_plan_hash    its content hash (`RatePlan.content_hash`); the URL carries it, and the
                     plan is stored under it (`gap_engine.plan.store`) so a reload gets it back
    app_plan_missing why the plan the URL named could not be restored (None: nothing missing)
    app_uploaded_plan a plan uploaded on the Export page and checked against the model
    app_jobs         job kind -> id of this session's latest job of that kind
    app_seen_jobs    ids of finished jobs whose outcome was already applied
    app_messages     message slot -> what a page says there (`explorer.messages`)
    app_confirm      destructive button -> what it was pressed for (`explorer.confirm`)

Streamlit forgets the value of a widget that a run does not draw (the user is on another
page); `keep_widget_values` (called by app.py at the top of every run) re-assigns the
registered keys so they survive page switches.
"""

from __future__ import annotations

import streamlit as st

from gap_engine.core.config import DEFAULT_BUDGET, DEFAULT_COMPENSATION, DEFAULT_MAX_RATE

PLAN_OWN = "the plan's own"  # the run criterion selector's default: the plan's criterion chooses the units

SHARED_DEFAULTS = {
    "app_table": None,
    "app_model": None,
    "app_budget": DEFAULT_BUDGET,
    "app_constraints": {"locked": {}, "max_rate": DEFAULT_MAX_RATE, "coupled": False},
    "app_compensation": DEFAULT_COMPENSATION,
    "app_plan": None,
    "app_plan_hash": None,
    "app_plan_missing": None,
    "app_uploaded_plan": None,
    "app_jobs": {},
    "app_seen_jobs": [],
    "app_messages": {},
    "app_confirm": {},
    "app_baselines": None,
    "app_last_run": None,
    "app_last_recovery": None,
}
_PERSIST = "_app_widget_keys"
SHARED_WIDGETS = ("app_compensation",)  # widgets drawn on more than one page: kept across page switches


def init_shared() -> None:
    """Create the shared ``app_`` keys once per session."""
    for key, value in SHARED_DEFAULTS.items():
        if key not in st.session_state:
            st.session_state[key] = value.copy() if isinstance(value, (dict, list)) else value
    st.session_state.setdefault(_PERSIST, set()).update(SHARED_WIDGETS)


def init_page(prefix: str, defaults: dict) -> None:
    """Guarded initialisation of one page's widget values (all keys must start with ``prefix``)."""
    init_shared()
    registered = st.session_state.setdefault(_PERSIST, set())
    for key, value in defaults.items():
        assert key.startswith(prefix), f"{key} does not start with the page prefix {prefix}"
        if key not in st.session_state:
            st.session_state[key] = value
        registered.add(key)


def keep_widget_values() -> None:
    """Re-assign registered widget values so a page switch does not drop them."""
    for key in st.session_state.get(_PERSIST, ()):
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]
