"""The session's loss table and its dense model: set, read, or required by a page."""

from __future__ import annotations

import streamlit as st

from explorer.messages import TABLE_LINK_SLOT, clear_message, show_message
from explorer.page_paths import SETUP_PAGE
from explorer.session_keys import SHARED_DEFAULTS, init_page, init_shared
from gap_engine.core.config import DEFAULT_COMPENSATION
from gap_engine.pipeline.jobs import shared_model
from gap_engine.plan.step import table_model_type
from gap_engine.prune.compensations import family_default


def reference_model(name: str):
    """The dense model, loaded once per process and shared read-only with the jobs.

    Raises:
        GapError: from load_model (bad name or path, unreadable weights).
    """
    with st.spinner(f"Loading {name} ..."):
        return shared_model(name)


def current_table():
    return st.session_state.get("app_table")


def default_compensation(table) -> str:
    """The compensation a run on ``table``'s model gets unless one is picked: its family's default
    (``bias``; ``bias+refit`` on Gemma 3), or the general one before any table."""
    return family_default(table_model_type(table)) if table is not None else DEFAULT_COMPENSATION


def set_table(table) -> None:
    """Make ``table`` the current one; plans and constraints made for another table are dropped. A
    compensation left at the previous model's default follows to this model's (one picked stays)."""
    previous = st.session_state.get("app_table")
    clear_message(TABLE_LINK_SLOT)
    if st.session_state.get("app_compensation") in (None, default_compensation(previous)):
        st.session_state["app_compensation"] = default_compensation(table)
    st.session_state["app_table"] = table
    st.session_state["app_model"] = table.model
    if previous is None or previous.key != table.key:
        st.session_state["app_plan"] = None
        st.session_state["app_plan_hash"] = None
        st.session_state["app_baselines"] = None
        if previous is None or previous.num_layers != table.num_layers:
            st.session_state["app_constraints"] = dict(SHARED_DEFAULTS["app_constraints"], locked={})


def table_page(prefix: str, defaults: dict, title: str):
    """Start a page that needs a loss table: its widget state, its title, and the current table
    (or a pointer to Setup, and the page stops)."""
    init_page(prefix, defaults)
    st.title(title)
    return require_table()


def require_table():
    """The current table, or stop the page with a pointer to Setup."""
    init_shared()
    table = current_table()
    if table is None:
        show_message(TABLE_LINK_SLOT)  # a link that named a table this cache lacks: said here, not only on Setup
        st.info("No loss table yet: build one or load a cached one on the **Setup** page.")
        st.page_link(SETUP_PAGE, label="Go to Setup", icon=":material/settings:")
        st.stop()
    return table
