"""Messages that survive a rerun: a page remembers what to say in a named slot, shown until replaced."""

from __future__ import annotations

import streamlit as st

TABLE_LINK_SLOT = "table_link"  # message slot: the table a link named could not be opened


def set_message(slot: str, level: str, text: str) -> None:
    """Remember a message for a page area (shown by `show_message` until replaced)."""
    st.session_state["app_messages"][slot] = (level, text)


def clear_message(slot: str) -> None:
    st.session_state["app_messages"].pop(slot, None)


def show_message(slot: str) -> None:
    level, text = st.session_state["app_messages"].get(slot, (None, None))
    if text:
        {"error": st.error, "warning": st.warning, "success": st.success, "info": st.info}[level](text)
