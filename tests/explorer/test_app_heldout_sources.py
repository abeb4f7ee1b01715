"""Prune & evaluate offers every built-in held-out source, the held-out-only ones included, while
Setup offers only the sources a table can calibrate on (AppTest; the real built-in model behind
the page, a tiny real table)."""

from __future__ import annotations

import pytest
from app_fixtures import cached_table, fresh_cache, start, tiny_table  # noqa: F401

from gap_engine.core.config import BUILTIN_TEXT_NAMES, HELDOUT_TEXT_NAMES

pytestmark = pytest.mark.slow  # the real built-in model behind the page


def test_heldout_selector_offers_the_heldout_only_sources_and_setup_does_not(cached_table):
    at = start("explorer/evaluate.py")
    assert list(at.multiselect(key="eval_sources").options) == list(HELDOUT_TEXT_NAMES)
    setup = start("explorer/setup.py")
    assert list(setup.selectbox(key="setup_builtin_data").options) == list(BUILTIN_TEXT_NAMES)
