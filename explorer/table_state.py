"""The session's loss table and its dense model: set, read, or required by a page."""

from __future__ import annotations

import streamlit as st

from explorer.messages import TABLE_LINK_SLOT, clear_message, show_message
from explorer.page_paths import SETUP_PAGE
from explorer.session_keys import SHARED_DEFAULTS, init_page, init_shared
from gap_engine.pipeline.jobs import shared_model


def reference_model(name: str):
    """The dense model, loaded once per process and shared read-only with the jobs.

    Raises:
        GapError: from load_model (bad name or path, unreadable weights).
    """
    with st.spinner(f"Loading {name} ..."):
        return shared_model(name)


def current_table():
    return st.session_state.get("app_table")


def set_table(table) -> None:
    """Make ``table`` the current one; plans and constraints made for another table are dropped."""
    previous = st.session_state.get("app_table")
    clear_message(TABLE_LINK_SLOT)
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
