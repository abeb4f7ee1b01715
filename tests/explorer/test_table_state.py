"""The session's table (explorer/table_state.py): opening a table of another model family moves a
compensation left at the old model's default to the new model's, and keeps one the user picked."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from synthetic_tables import synthetic_table

from explorer import table_state


def _typed(table, model_type, key):
    return dataclasses.replace(table, extras=dict(table.extras) | {"model_type": model_type}, key=key)


def test_a_compensation_left_at_its_default_follows_the_model_family(make_tiny, monkeypatch):
    session: dict = {"app_compensation": "bias", "app_constraints": {}}
    monkeypatch.setattr(table_state, "st", SimpleNamespace(session_state=session))
    monkeypatch.setattr(table_state, "clear_message", lambda slot: None)
    llama = _typed(synthetic_table(make_tiny("llama")), "llama", "llama-table")
    gemma = _typed(synthetic_table(make_tiny("gemma3_text")), "gemma3_text", "gemma-table")

    table_state.set_table(gemma)  # from no table: the general default becomes Gemma 3's
    assert session["app_compensation"] == "bias+refit" == table_state.default_compensation(gemma)
    table_state.set_table(llama)
    assert session["app_compensation"] == "bias"
    session["app_compensation"] = "refit"  # picked by the user: kept across tables
    table_state.set_table(gemma)
    assert session["app_compensation"] == "refit"
