"""A link that names no table opens the newest cached one, and Setup says so."""

from __future__ import annotations

import streamlit as st

from explorer.messages import set_message
from explorer.session_jobs import session_job
from explorer.table_state import current_table, set_table
from gap_engine.core.errors import GapError
from gap_engine.model.identity import model_may_load


def autoload_latest():
    """Once per session, for a link that names no table: open the newest cached table, and say
    so on Setup with every cached table listed (the choice is never silent).

    Returns:
        The table opened, or None (already done, a table or build in the session, an empty cache).
    """
    if st.session_state.get("app_autoloaded"):
        return None
    st.session_state["app_autoloaded"] = True
    if current_table() is not None or session_job("table") is not None:
        return None
    from gap_engine.tables import cache

    try:
        rows = sorted(cache.list_tables(), key=lambda r: r.get("created") or "", reverse=True)
        # A table of a model folder since deleted can be browsed, never pruned: not opened unasked.
        openable = [row for row in rows if model_may_load(str(row.get("model")))]
        table = cache.get_table(openable[0]["key"]) if openable else None
    except GapError:
        return None
    if table is None:
        return None
    set_table(table)
    listed = "; ".join(f"`{r['key']}` ({_table_summary(r)})" for r in rows[:8]) + (f"; and {len(rows) - 8} more" if len(rows) > 8 else "")
    set_message(
        "setup",
        "info",
        f"The link names no table, so the most recent cached table of a model that is still there was opened: `{table.key}` ({_table_summary(openable[0])}). "
        f"The cache holds {len(rows)}: {listed}. Pick another under Cached tables below, or build one.",
    )
    return table


def _table_summary(row: dict) -> str:
    """'smollm2-135m, fisher, 16 x 256 tokens of wiki-sample, built 2026-12-01T10:00' of a cache row."""
    spec = row.get("spec") or {}  # TableSpec.summary(): flat fields
    return (
        f"{row.get('model')}, {spec.get('estimator', '?')}, {spec.get('n_samples', '?')} x {spec.get('seq_len', '?')} tokens "
        f"of {spec.get('data', '?')}, built {str(row.get('created') or '?')[:16].replace('T', ' ')}"
    )
