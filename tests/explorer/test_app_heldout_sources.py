"""Prune & evaluate offers every built-in held-out source, the held-out-only ones included, while
Setup offers only the sources a table can calibrate on (AppTest; the real built-in model behind
the page, a tiny real table)."""

from __future__ import annotations

import pytest
from app_fixtures import cached_table, fresh_cache, job_of, start, texts, tiny_table  # noqa: F401

from gap_engine.core.config import BUILTIN_TEXT_NAMES, HELDOUT_TEXT_NAMES

pytestmark = pytest.mark.slow  # the real built-in model behind the page


def test_heldout_selector_offers_the_heldout_only_sources_and_setup_does_not(cached_table):
    at = start("explorer/evaluate.py")
    assert list(at.multiselect(key="eval_sources").options) == list(HELDOUT_TEXT_NAMES)
    setup = start("explorer/setup.py")
    assert list(setup.selectbox(key="setup_builtin_data").options) == list(BUILTIN_TEXT_NAMES)


def test_setup_mixes_samples_in_the_order_named(fresh_cache):
    at = start()
    assert at.multiselect(key="setup_mixed_data").value == []
    assert list(at.multiselect(key="setup_mixed_data").options) == list(BUILTIN_TEXT_NAMES)  # never a held-out-only one
    at.selectbox(key="setup_builtin_data").set_value("news-sample")
    at.multiselect(key="setup_mixed_data").set_value(["news-sample", "wiki-sample"])  # the first sample again counts once
    at.radio(key="setup_estimator").set_value("taylor")
    at.number_input(key="setup_samples").set_value(2)
    at.number_input(key="setup_seq_len").set_value(16)
    at.text_input(key="setup_rate_grid").set_value("0, 0.5")
    at.button(key="setup_build").click().run()
    job = job_of(at, "table")
    assert job.wait(300), job.snapshot()
    at.run()
    assert not at.exception
    table = at.session_state["app_table"]
    assert table is not None and table.spec.windows.data == "news-sample,wiki-sample"
    assert any("news-sample,wiki-sample · 2 x 16 tokens" in t for t in texts(at.caption))
