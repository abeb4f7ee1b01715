"""Destructive actions: a button that asks first, and the question that does it.

``app_confirm`` maps a destructive button's key to the thing it was pressed for (a run id, a
table key, a folder): the question shows under the button while that thing is still the one picked.
"""

from __future__ import annotations

import streamlit as st


def ask_first(where, label: str, key: str, target, **button) -> None:
    """A destructive action's button: pressing it asks (see `confirmation`), never acts."""
    where.button(label, key=key, on_click=_ask, args=(key, target), **button)


def _ask(key: str, target) -> None:
    st.session_state["app_confirm"][key] = target


def _dismiss(key: str) -> None:
    st.session_state["app_confirm"].pop(key, None)


def _confirmed(key: str, action, args: tuple) -> None:
    st.session_state["app_confirm"].pop(key, None)
    action(*args)


def confirmation(key: str, target, question: str, confirm_label: str, action, args: tuple = ()) -> None:
    """The question under `ask_first`'s button ``key`` while it was pressed for ``target``: what
    will be deleted, a button that does it (``action(*args)``, a callback, so the page that
    follows no longer shows what was deleted) and one that keeps it."""
    if st.session_state["app_confirm"].get(key) != target:
        return
    with st.container(border=True, key=f"{key}_question"):
        st.warning(question, icon=":material/warning:")
        c1, c2 = st.columns(2)
        c1.button(
            confirm_label, key=f"{key}_confirm", type="primary", on_click=_confirmed, args=(key, action, args), icon=":material/delete:"
        )
        c2.button("Keep it", key=f"{key}_keep", on_click=_dismiss, args=(key,))
